"""KV store: one program per (block of tokens, KV head) writes K and V rows into their slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import FP8_MAX, FP8_SCALE_MIN, is_fp8
from ..fp8 import round_e4m3

SUPPORTED_CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
_FP8_MAX = tl.constexpr(FP8_MAX)
_SCALE_MIN = tl.constexpr(FP8_SCALE_MIN)
# fp8 arithmetic -> (reciprocal + fma correction instead of a division per element,
# the GPU's rounding conversion instead of rounding in software); all write the same bytes
QUANT = {"div": (False, False), "rcp": (True, False), "fast": (True, True)}
DEFAULT_QUANT = "fast"
DEFAULT_FP8_BLOCK_T = 16
DEFAULT_FP8_HEADS = 8  # all heads of a token: its scales fill whole sectors (H200: 0.64 -> 0.48 ms)
# Up to this many tokens (a decode or verify step, a short extend) each program takes one head:
# with all 8 in one program a decode step's store is one or a few programs walking 16 row tiles
# one after another, 9.6-10.8 us per layer in the server at batch 1-64 (0.31-0.35 ms of a step)
# against 1.4-2 us for the bf16 store, which takes one head per program
# (benchmarks/results/server_profile.md).
FP8_ALL_HEADS_MIN_TOKENS = 1024


@triton.jit
def _div_by_row(x, scale):
    # x / scale[:, None] correctly rounded without a division per element: with r = RN(1 / scale)
    # and q0 = RN(x * r) within one ulp, q0 + RN(x - q0 * scale) * r rounds to RN(x / scale)
    # (Markstein's theorem; the fma residual is exact). A zero residual keeps q0, so -0.0 stays.
    r = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[:, None]
    q0 = x * r
    e = tl.fma(-q0, scale[:, None], x)
    return tl.where(e == 0.0, q0, tl.fma(e, r, q0))


@triton.jit
def _store_rows(
    X,
    C,
    S,
    slot,
    offs_t,
    t_ok,
    head,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_ch,
    stride_st,
    HEAD_DIM: tl.constexpr,
    FP8: tl.constexpr,
    FAST: tl.constexpr,
    HW_ROUND: tl.constexpr,
):
    offs_d = tl.arange(0, HEAD_DIM)
    x = tl.load(  # int64 rows: a bulk store of over 2^31 / stride_xt tokens stays in range
        X + offs_t.to(tl.int64)[:, None] * stride_xt + head * stride_xh + offs_d[None, :],
        mask=t_ok[:, None],
        other=0.0,
    )
    dst = C + slot[:, None] * stride_ct + head * stride_ch + offs_d[None, :]
    if FP8:
        x = x.to(tl.float32)
        # IEEE division (div_rn), as torch computes it: the scales and bytes match the reference
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), _FP8_MAX), _SCALE_MIN)
        if FAST:
            xq = _div_by_row(x, scale)
        else:
            xq = tl.math.div_rn(x, scale[:, None])
        xq = tl.clamp(xq, -_FP8_MAX, _FP8_MAX)
        if HW_ROUND:  # the GPU's conversion rounds to nearest even, as torch's cast
            tl.store(
                dst, xq.to(C.dtype.element_ty, fp_downcast_rounding="rtne"), mask=t_ok[:, None]
            )
        else:
            tl.store(dst, round_e4m3(xq).to(C.dtype.element_ty), mask=t_ok[:, None])
        tl.store(S + slot * stride_st + head, scale, mask=t_ok)
    else:
        tl.store(dst, x.to(C.dtype.element_ty), mask=t_ok[:, None])


@triton.jit
def store_kv_kernel(
    K,
    V,
    KC,
    VC,
    KS,
    VS,
    LOC,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_ch,
    stride_st,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HEADS: tl.constexpr,
    FP8: tl.constexpr,
    FAST: tl.constexpr,
    HW_ROUND: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < num_tokens
    slot = tl.load(LOC + offs_t, mask=t_ok, other=0).to(tl.int64)
    # HEADS heads per program: a slot's scales (adjacent fp32s) are written together
    for i in tl.static_range(HEADS):
        head = tl.program_id(1) * HEADS + i
        _store_rows(
            K,
            KC,
            KS,
            slot,
            offs_t,
            t_ok,
            head,
            stride_kt,
            stride_kh,
            stride_ct,
            stride_ch,
            stride_st,
            HEAD_DIM,
            FP8,
            FAST,
            HW_ROUND,
        )
        _store_rows(
            V,
            VC,
            VS,
            slot,
            offs_t,
            t_ok,
            head,
            stride_vt,
            stride_vh,
            stride_ct,
            stride_ch,
            stride_st,
            HEAD_DIM,
            FP8,
            FAST,
            HW_ROUND,
        )


def _check(k, v, k_cache, v_cache, loc, k_scale, v_scale) -> bool:
    assert k.dim() == 3 and k.shape == v.shape, "k, v: [tokens, kv_heads, head_dim]"
    assert k.stride(2) == 1 and v.stride(2) == 1, "k, v: head_dim must be contiguous"
    assert k_cache.shape == v_cache.shape and k_cache.shape[1:] == k.shape[1:], (
        f"cache {tuple(k_cache.shape)} does not hold rows of {tuple(k.shape[1:])}"
    )
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "k_cache, v_cache: contiguous"
    assert k_cache.dtype == v_cache.dtype, "k_cache and v_cache dtypes differ"
    if k_cache.dtype not in SUPPORTED_CACHE_DTYPES:
        raise ValueError(
            f"store_kv: cache dtype {k_cache.dtype} unsupported; "
            f"use one of {SUPPORTED_CACHE_DTYPES}"
        )
    assert loc.dim() == 1 and loc.shape[0] == k.shape[0], "loc: [tokens]"
    assert loc.dtype in (torch.int32, torch.int64), "loc: int32 or int64 slot indices"
    fp8 = is_fp8(k_cache.dtype)
    if fp8:
        assert k_scale is not None and v_scale is not None, "fp8 cache needs k_scale and v_scale"
        for s in (k_scale, v_scale):
            assert s.dtype == torch.float32 and s.is_contiguous(), "scales: contiguous fp32"
            assert s.shape == k_cache.shape[:2], "scales: [num_slots, kv_heads]"
    return fp8


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    block_t: int | None = None,
    num_warps: int = 4,
    quant: str | None = None,
    heads_per_program: int | None = None,
) -> None:
    """Write new K/V rows into the paged token pool.

    k, v: [tokens, kv_heads, head_dim], any float dtype, head_dim contiguous (token and head
      strides free, so slices of a fused qkv tensor need no copy).
    k_cache, v_cache: [num_slots, kv_heads, head_dim], contiguous; bf16/fp16/fp32 (rows are
      copied, cast to the cache dtype) or float8_e4m3fn (rows are quantized).
    loc: [tokens] int32/int64 slot of each token (`page_id * page_size + offset`).
    k_scale, v_scale: [num_slots, kv_heads] fp32, required for fp8: the kernel writes
      scale = max(amax|row| / 448, 1e-12) and the e4m3fn row round(x / scale).
    Writes k_cache[loc], v_cache[loc] (and k_scale[loc], v_scale[loc] for fp8); nothing else.
    block_t (tokens per program), num_warps, heads_per_program (rounded down to a divisor of
      kv_heads): tuning; by default an fp8 store of FP8_ALL_HEADS_MIN_TOKENS tokens or more
      takes all heads of a token per program, a smaller one (a decode step) one head.
    quant: the fp8 arithmetic, a `QUANT` name; all write the same bytes (default "fast" on
      GPU; "div" under the CPU interpreter, whose fma is not fused).
    """
    fp8 = _check(k, v, k_cache, v_cache, loc, k_scale, v_scale)
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    if head_dim & (head_dim - 1):
        raise ValueError(f"store_kv: head_dim {head_dim} must be a power of two")
    ks = k_scale if fp8 else k_cache  # placeholder pointers, never read when not fp8
    vs = v_scale if fp8 else v_cache
    cpu = k.device.type == "cpu"
    fast, hw_round = QUANT[quant or ("div" if cpu else DEFAULT_QUANT)]
    block_t = block_t or (16 if cpu or not fp8 else DEFAULT_FP8_BLOCK_T)
    few = tokens < FP8_ALL_HEADS_MIN_TOKENS
    heads = heads_per_program or (1 if cpu or not fp8 or few else DEFAULT_FP8_HEADS)
    heads = max(h for h in range(1, min(heads, kv_heads) + 1) if kv_heads % h == 0)
    grid = (triton.cdiv(tokens, block_t), kv_heads // heads)
    store_kv_kernel[grid](
        k,
        v,
        k_cache,
        v_cache,
        ks,
        vs,
        loc,
        tokens,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_T=block_t,
        HEADS=heads,
        FP8=fp8,
        FAST=fast,
        HW_ROUND=hw_round,
        num_warps=num_warps,
    )
