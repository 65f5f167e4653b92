"""CPU mode: torch implementations of the speculative-decoding ops sgl_kernel's CPU build lacks.

SGLang 0.5.23 calls ``torch.ops.sgl_kernel.<op>_cpu`` for speculative decoding on CPU (slot
assignment, tree-mask decoding, greedy tree verification), but the CPU sgl_kernel paired with
it ships none of them, so no speculative algorithm can decode on CPU. This module defines the
ones the chain/tree verify path uses, in the ``sgl_kernel`` op namespace with the schemas
SGLang's wrappers call, following the CUDA kernels' contracts. Only an op that is missing is
defined (nothing of SGLang's is replaced); installed in CPU mode only.
"""

from __future__ import annotations

import torch

_LIB: torch.library.Library | None = None

SCHEMAS = {
    "assign_req_to_token_pool_cpu": (
        "(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, "
        "Tensor end_offset, Tensor out_cache_loc, int pool_len) -> ()"
    ),
    "assign_extend_cache_locs_cpu": (
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor start_offset, "
        "Tensor end_offset, Tensor(a!) out_cache_loc, int pool_len) -> ()"
    ),
    "reconstruct_indices_from_tree_mask_cpu": (
        "(Tensor tree_mask, Tensor verified_seq_len, Tensor(a!) positions, "
        "Tensor(b!) retrive_index, Tensor(c!) retrive_next_token, "
        "Tensor(d!) retrive_next_sibling, int batch_size, int draft_token_num) -> ()"
    ),
    "verify_tree_greedy_cpu": (
        "(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num, "
        "Tensor candidates, Tensor retrive_index, Tensor retrive_next_token, "
        "Tensor retrive_next_sibling, Tensor target_predict) -> ()"
    ),
    "fill_accept_out_cache_loc_cpu": (
        "(Tensor accept_index, Tensor out_cache_loc, Tensor(a!) accept_out_cache_loc) -> ()"
    ),
}


def _spans(start_offset: torch.Tensor, end_offset: torch.Tensor):
    starts, ends = start_offset.tolist(), end_offset.tolist()
    cum = 0
    for b, (s, e) in enumerate(zip(starts, ends, strict=True)):
        yield b, s, e, cum
        cum += e - s


def assign_req_to_token_pool(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    """req_to_token[req b, start..end) = the next (end - start) entries of out_cache_loc."""
    for b, s, e, cum in _spans(start_offset, end_offset):
        row = int(req_pool_indices[b])
        req_to_token[row, s:e] = out_cache_loc[cum : cum + e - s].to(req_to_token.dtype)


def assign_extend_cache_locs(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    """out_cache_loc, packed per request = req_to_token[req b, start..end)."""
    for b, s, e, cum in _spans(start_offset, end_offset):
        row = int(req_pool_indices[b])
        out_cache_loc[cum : cum + e - s] = req_to_token[row, s:e].to(out_cache_loc.dtype)


def reconstruct_indices_from_tree_mask(
    tree_mask,
    verified_seq_len,
    positions,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    batch_size,
    draft_token_num,
) -> None:
    """tree_mask[b, i, j] marks node j an ancestor of node i (row-major, flat). Writes each
    node's position (ancestors + verified length), its flat index, first child and next
    sibling (-1 when none)."""
    bs, n = batch_size, draft_token_num
    if bs == 0:
        return
    mask = tree_mask.reshape(bs, n, n).bool()
    idx = torch.arange(n, device=mask.device)
    anc = mask & (idx[None, :] < idx[:, None])[None]  # [bs, i, j]: strict ancestors
    positions.view(bs, n).copy_(anc.sum(-1) + verified_seq_len.view(bs, 1).to(positions.dtype))
    retrive_index.view(bs, n).copy_(torch.arange(bs * n, device=mask.device).view(bs, n))
    parent = torch.where(anc, idx[None, None, :], -1).amax(-1)  # [bs, n]
    big = n
    # first child: min{k > tid : anc[k, tid]}
    child = torch.where(anc.transpose(1, 2), idx[None, None, :], big).amin(-1)
    retrive_next_token.view(bs, n).copy_(torch.where(child < big, child, -1))
    # next sibling: min{k > tid : parent[k] == parent[tid]}, none for the root
    later = idx[None, :] > idx[:, None]  # [tid, k]
    same = (parent[:, None, :] == parent[:, :, None]) & later[None]
    sib = torch.where(same, idx[None, None, :], big).amin(-1)
    sib = torch.where((sib < big) & (parent >= 0), sib, -1)
    retrive_next_sibling.view(bs, n).copy_(sib)


def verify_tree_greedy(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    target_predict,
) -> None:
    """Walk each request's tree from the root, following the child whose draft token equals
    the target's greedy token after the last accepted node; record accepted nodes, their
    count, and the target's tokens at them (the bonus token at the last one)."""
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    target = target_predict.reshape(-1).tolist()
    cand, ridx = candidates.tolist(), retrive_index.tolist()
    nxt, sib = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    for b in range(bs):
        last = ridx[b][0]
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, steps):
            cur = nxt[b][cur]
            while cur != -1 and cand[b][cur] != target[last]:
                cur = sib[b][cur]
            if cur == -1:
                break
            predicts[last] = target[last]
            accepted += 1
            accept_index[b, accepted] = ridx[b][cur]
            last = ridx[b][cur]
        accept_token_num[b] = accepted
        predicts[last] = target[last]


def fill_accept_out_cache_loc(accept_index, out_cache_loc, accept_out_cache_loc) -> None:
    """Pack out_cache_loc[i] for every accepted index i (-1 entries skipped), in order."""
    flat = accept_index.reshape(-1)
    picked = flat[flat != -1].long()
    accept_out_cache_loc[: picked.numel()] = out_cache_loc[picked].to(accept_out_cache_loc.dtype)


IMPLS = {
    "assign_req_to_token_pool_cpu": assign_req_to_token_pool,
    "assign_extend_cache_locs_cpu": assign_extend_cache_locs,
    "reconstruct_indices_from_tree_mask_cpu": reconstruct_indices_from_tree_mask,
    "verify_tree_greedy_cpu": verify_tree_greedy,
    "fill_accept_out_cache_loc_cpu": fill_accept_out_cache_loc,
}


def missing_ops() -> list[str]:
    """Ops SGLang will call that sgl_kernel does not define (none when sgl_kernel cannot load
    in this process: SGLang then cannot call it either)."""
    try:
        import sgl_kernel  # noqa: F401 - loads sgl_kernel's own CPU ops first
    except ImportError:
        return []
    return [name for name in SCHEMAS if not hasattr(torch.ops.sgl_kernel, name)]


def install() -> list[str]:
    """Define the missing ops; returns their names (empty when sgl_kernel has them all)."""
    global _LIB
    missing = missing_ops()
    if not missing:
        return []
    if _LIB is None:
        _LIB = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name in missing:
        _LIB.define(name + SCHEMAS[name])
        _LIB.impl(name, IMPLS[name], "CPU")
    return missing
