"""The torch speculative ops defined for CPU mode, against hand-built trees and chains."""

from __future__ import annotations

import torch

from sgl_atom import cpu_spec_ops as ops


def _tree_mask(parents: list[int]) -> torch.Tensor:
    """Row i marks i and all its ancestors (the layout SGLang's tree masks use)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            mask[i, j] = True
            j = parents[j]
    return mask.reshape(-1)


def _reconstruct(masks: list[torch.Tensor], seq_lens: list[int], n: int):
    bs = len(masks)
    out = [torch.full((bs * n,), -7, dtype=torch.int64) for _ in range(1)]
    out += [torch.full((bs, n), -7, dtype=torch.int64) for _ in range(3)]
    ops.reconstruct_indices_from_tree_mask(torch.cat(masks), torch.tensor(seq_lens), *out, bs, n)
    return out


def test_reconstruct_tree_with_siblings():
    # 0 -> {1, 2}, 1 -> {3}, 2 -> {4}
    positions, index, child, sibling = _reconstruct([_tree_mask([-1, 0, 0, 1, 2])], [10], 5)
    assert positions.tolist() == [10, 11, 11, 12, 12]
    assert index.tolist() == [[0, 1, 2, 3, 4]]
    assert child.tolist() == [[1, 3, 4, -1, -1]]
    assert sibling.tolist() == [[-1, 2, -1, -1, -1]]


def test_reconstruct_chains_in_a_batch():
    n = 5
    chain = _tree_mask([-1, 0, 1, 2, 3])
    positions, index, child, sibling = _reconstruct([chain, chain], [3, 8], n)
    assert positions.tolist() == [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert index.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert child.tolist() == [[1, 2, 3, 4, -1]] * 2
    assert sibling.tolist() == [[-1] * n] * 2


def _verify(candidates, target, parents_per_req, steps):
    bs, n = candidates.shape
    masks = [_tree_mask(p) for p in parents_per_req]
    _, index, child, sibling = _reconstruct(masks, [0] * bs, n)
    predicts = torch.full((bs * n,), -5, dtype=torch.int32)
    accept_index = torch.full((bs, steps), -1, dtype=torch.int32)
    accepted = torch.full((bs,), -5, dtype=torch.int32)
    ops.verify_tree_greedy(
        predicts, accept_index, accepted, candidates, index, child, sibling, target
    )
    return predicts, accept_index, accepted


def test_verify_chain_accepts_longest_matching_prefix():
    # request 0 matches 2 drafts then misses; request 1 matches all 3; request 2 none
    candidates = torch.tensor([[9, 4, 5, 6], [9, 4, 5, 6], [9, 4, 5, 6]])
    target = torch.tensor([[4, 5, 7, 1], [4, 5, 6, 2], [8, 3, 3, 3]])
    chain = [-1, 0, 1, 2]
    predicts, accept_index, accepted = _verify(candidates, target, [chain] * 3, steps=4)
    assert accepted.tolist() == [2, 3, 0]
    assert accept_index.tolist() == [[0, 1, 2, -1], [4, 5, 6, 7], [8, -1, -1, -1]]
    # committed tokens are the target's at the accepted nodes, bonus at the last one
    assert predicts[[0, 1, 2]].tolist() == [4, 5, 7]
    assert predicts[[4, 5, 6, 7]].tolist() == [4, 5, 6, 2]
    assert predicts[8].item() == 8


def test_verify_tree_follows_the_matching_sibling():
    # 0 -> {1, 2}; the target's token after the root is node 2's
    candidates = torch.tensor([[9, 4, 5, 6, 7]])
    target = torch.tensor([[5, 0, 7, 0, 3]])
    _, accept_index, accepted = _verify(candidates, target, [[-1, 0, 0, 1, 2]], steps=3)
    assert accepted.tolist() == [2]
    assert accept_index.tolist() == [[0, 2, 4]]


def test_slot_assignment_round_trip():
    req_to_token = torch.zeros(3, 12, dtype=torch.int32)
    pool_idx = torch.tensor([2, 0])
    start, end = torch.tensor([3, 5]), torch.tensor([6, 7])
    locs = torch.tensor([100, 101, 102, 200, 201])
    ops.assign_req_to_token_pool(pool_idx, req_to_token, start, end, locs, 12)
    assert req_to_token[2, 3:6].tolist() == [100, 101, 102]
    assert req_to_token[0, 5:7].tolist() == [200, 201]
    assert int(req_to_token.count_nonzero()) == 5
    back = torch.full((5,), -1, dtype=torch.int64)
    ops.assign_extend_cache_locs(pool_idx, req_to_token, start, end, back, 12)
    assert back.tolist() == locs.tolist()


def test_fill_accept_out_cache_loc_packs_accepted_slots():
    accept_index = torch.tensor([[0, 1, -1], [3, -1, -1]], dtype=torch.int32)
    out_cache_loc = torch.tensor([50, 51, 52, 53, 54, 55])
    dst = torch.full((6,), -1, dtype=torch.int64)
    ops.fill_accept_out_cache_loc(accept_index, out_cache_loc, dst)
    assert dst.tolist() == [50, 51, 53, -1, -1, -1]
