"""Index-key store: one replicated index head per token into the per-layer index cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import FP8_MAX, FP8_SCALE_MIN, is_fp8, is_int4, next_pow2, scaled_index
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
    INT4: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
    SCALE_MIN: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    if INT4:
        _write_int4(X, C, CS, LOC, t, num_tokens, stride_x, INDEX_DIM, BLOCK_D, SCALE_MIN)
    else:
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


@triton.jit
def _write_int4(
    X,
    C,
    CS,
    LOC,
    t,
    num_tokens,
    stride_x,
    INDEX_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCALE_MIN: tl.constexpr,
):
    """Packed 4-bit keys (common.INT4_DTYPE; 7 is common.INT4_MAX): scale = amax / 7, q =
    floor(x / scale + 0.5) clamped to [-7, 7], byte j = (q[j] + 8) | (q[j + INDEX_DIM / 2] + 8)
    << 4. BLOCK_D covers half a row."""
    half: tl.constexpr = INDEX_DIM // 2
    j = tl.arange(0, BLOCK_D)
    t_ok = t < num_tokens
    mask = t_ok[:, None] & (j < half)[None, :]
    src = X + t.to(tl.int64)[:, None] * stride_x + j[None, :]
    lo = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(lo), axis=1), tl.max(tl.abs(hi), axis=1))
    scale = tl.maximum(tl.math.div_rn(amax, 7.0), SCALE_MIN)
    q_lo = tl.clamp(tl.floor(tl.math.div_rn(lo, scale[:, None]) + 0.5), -7.0, 7.0).to(tl.int32)
    q_hi = tl.clamp(tl.floor(tl.math.div_rn(hi, scale[:, None]) + 0.5), -7.0, 7.0).to(tl.int32)
    byte = ((q_lo + 8) | ((q_hi + 8) << 4)).to(tl.uint8)
    slot = tl.load(LOC + t, mask=t_ok, other=0).to(tl.int64)
    tl.store(C + slot[:, None] * half + j[None, :], byte, mask=mask)
    tl.store(CS + slot, scale, mask=t_ok)


def index_write(
    index_k: torch.Tensor,
    index_cache: torch.Tensor,
    loc: torch.Tensor,
    index_scale: torch.Tensor | None = None,
) -> None:
    """Store each token's index key at its slot (alongside the KV store, same `loc`).

    index_k: [tokens, index_dim] bf16/fp16/fp32, last dim contiguous (the replicated index head).
    index_cache: [num_slots, index_dim] contiguous, bf16/fp16/fp32 or float8_e4m3fn; or packed
      4-bit keys, [num_slots, index_dim / 2] uint8 (common.INT4_DTYPE, index_dim even).
    loc: [tokens] int32/int64 slot ids (SGLang's out_cache_loc).
    index_scale: [num_slots] fp32, fp8 and 4-bit only: `max(amax|x| / 448, 1e-12)` per token
      (4-bit: `max(amax|x| / 7, 1e-12)`), written here.
    Writes index_cache[loc] (and index_scale[loc]).
    """
    tokens, index_dim = index_k.shape
    fp8, int4 = is_fp8(index_cache.dtype), is_int4(index_cache.dtype)
    row = index_dim // 2 if int4 else index_dim
    assert index_k.stride(1) == 1 and index_cache.is_contiguous(), (
        "index_k rows and index_cache contiguous"
    )
    ok = index_cache.dim() == 2 and index_cache.shape[1] == row and row * (1 + int4) == index_dim
    assert ok, f"index_cache {tuple(index_cache.shape)} must be [num_slots, {row}]" + (
        " (packed 4-bit keys of an even index_dim)" if int4 else ""
    )
    assert loc.shape == (tokens,) and loc.dtype in (torch.int32, torch.int64), (
        "loc: [tokens] int32/int64"
    )
    assert not scaled_index(index_cache.dtype) or (
        index_scale is not None
        and index_scale.dtype == torch.float32
        and index_scale.shape == index_cache.shape[:1]
    ), "fp8 and 4-bit index caches need index_scale [num_slots] fp32"
    if tokens == 0:
        return
    block_t = 16
    scale = index_scale if scaled_index(index_cache.dtype) else index_cache
    index_write_kernel[(triton.cdiv(tokens, block_t),)](
        index_k,
        index_cache,
        scale,
        loc,
        tokens,
        index_k.stride(0),
        INDEX_DIM=index_dim,
        BLOCK_T=block_t,
        BLOCK_D=next_pow2(row),
        FP8=fp8,
        INT4=int4,
        FP8_MAX_C=FP8_MAX,
        SCALE_MIN=FP8_SCALE_MIN,
    )
