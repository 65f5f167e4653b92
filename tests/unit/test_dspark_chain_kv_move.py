"""Why the ATOM_DSPARK worker makes no KV move after a verify: in a chain the accepted rows
already lead each request's verify window, so SGLang's move_accept_tokens_to_target_kvcache
would copy every row onto itself (and the M3 target's MiniMaxSparseKVPool does not implement
move_kv_cache). Its two location fills, run as SGLang runs them, give the same slots."""

from __future__ import annotations

import pytest
import torch

WINDOW = 5  # k + 1 verify tokens per request


@pytest.mark.parametrize("accepted", [[1], [5, 1, 3], [2, 2, 5, 4]], ids=["one", "three", "four"])
def test_chain_accept_move_is_the_identity(accepted):
    from sglang.kernels.ops.speculative.cache_locs import fill_front_out_cache_loc_func
    from sglang.kernels.ops.speculative.eagle import fill_accept_out_cache_loc_func

    acc = torch.tensor(accepted)
    bs, size = acc.numel(), acc.numel() * WINDOW
    gen = torch.Generator().manual_seed(bs)
    out_cache_loc = torch.randperm(1000, generator=gen)[:size].to(torch.int64) + 1
    cols = torch.arange(WINDOW)[None]
    chain = torch.arange(bs)[:, None] * WINDOW + cols  # a chain's accepted rows: a prefix
    accept_index = torch.where(cols < acc[:, None], chain, -1).to(torch.int32)
    front = torch.full((size,), -7, dtype=torch.int64)
    moved = torch.full((size,), -7, dtype=torch.int64)
    fill_front_out_cache_loc_func(acc, out_cache_loc, front)  # where the move writes
    fill_accept_out_cache_loc_func(accept_index, out_cache_loc, moved, size)  # what it reads
    n = int(acc.sum())
    assert torch.equal(front[:n], moved[:n])
    assert set(front[:n].tolist()) <= set(out_cache_loc.tolist())
