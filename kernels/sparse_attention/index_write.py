"""Index-key store: one replicated index head per token into the per-layer index cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import FP8_MAX, FP8_SCALE_MIN, is_fp8, next_pow2
from ..fp8 import round_e4m3


@triton.jit
def index_write_kernel(
    X,
    C,
    CS,
    LOC,
    num_tokens,
    stride_x,
    INDEX_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
    SCALE_MIN: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    t_ok = t < num_tokens
    mask = t_ok[:, None] & (d < INDEX_DIM)[None, :]
    x = tl.load(X + t.to(tl.int64)[:, None] * stride_x + d[None, :], mask=mask, other=0.0).to(
        tl.float32
    )
    slot = tl.load(LOC + t, mask=t_ok, other=0).to(tl.int64)
    dst = C + slot[:, None] * INDEX_DIM + d[None, :]
    if FP8:
        # as the K/V store: IEEE division (div_rn, as torch) and rounding to e4m3 in software,
        # so the cast is exact (Triton's interpreter does not round its fp8 cast correctly)
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), FP8_MAX_C), SCALE_MIN)
        y = tl.clamp(tl.math.div_rn(x, scale[:, None]), -FP8_MAX_C, FP8_MAX_C)
        tl.store(dst, round_e4m3(y).to(C.dtype.element_ty), mask=mask)
        tl.store(CS + slot, scale, mask=t_ok)
    else:
        tl.store(dst, x.to(C.dtype.element_ty), mask=mask)


def index_write(
    index_k: torch.Tensor,
    index_cache: torch.Tensor,
    loc: torch.Tensor,
    index_scale: torch.Tensor | None = None,
) -> None:
    """Store each token's index key at its slot (alongside the KV store, same `loc`).

    index_k: [tokens, index_dim] bf16/fp16/fp32, last dim contiguous (the replicated index head).
    index_cache: [num_slots, index_dim] contiguous, bf16/fp16/fp32 or float8_e4m3fn.
    loc: [tokens] int32/int64 slot ids (SGLang's out_cache_loc).
    index_scale: [num_slots] fp32, fp8 only: `max(amax|x| / 448, 1e-12)` per token, written here.
    Writes index_cache[loc] (and index_scale[loc]).
    """
    tokens, index_dim = index_k.shape
    fp8 = is_fp8(index_cache.dtype)
    assert index_k.stride(1) == 1 and index_cache.is_contiguous(), (
        "index_k rows and index_cache contiguous"
    )
    assert index_cache.dim() == 2 and index_cache.shape[1] == index_dim, (
        f"index_cache {tuple(index_cache.shape)} must be [num_slots, {index_dim}]"
    )
    assert loc.shape == (tokens,) and loc.dtype in (torch.int32, torch.int64), (
        "loc: [tokens] int32/int64"
    )
    assert not fp8 or (
        index_scale is not None
        and index_scale.dtype == torch.float32
        and index_scale.shape == index_cache.shape[:1]
    ), "fp8 index cache needs index_scale [num_slots] fp32"
    if tokens == 0:
        return
    block_t = 16
    scale = index_scale if fp8 else index_cache
    index_write_kernel[(triton.cdiv(tokens, block_t),)](
        index_k,
        index_cache,
        scale,
        loc,
        tokens,
        index_k.stride(0),
        INDEX_DIM=index_dim,
        BLOCK_T=block_t,
        BLOCK_D=next_pow2(index_dim),
        FP8=fp8,
        FP8_MAX_C=FP8_MAX,
        SCALE_MIN=FP8_SCALE_MIN,
    )
