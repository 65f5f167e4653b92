"""KV store: one program per (block of tokens, KV head) writes K and V rows into their slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import FP8_MAX, FP8_SCALE_MIN, is_fp8

SUPPORTED_CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
_FP8_MAX = tl.constexpr(FP8_MAX)
_SCALE_MIN = tl.constexpr(FP8_SCALE_MIN)


@triton.jit
def _round_e4m3(x):
    # Round fp32 to the nearest e4m3fn value (ties to even) before the cast, so the cast is exact
    # and every backend (the CPU interpreter included) writes the same bytes.
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # keep 3 mantissa bits
    normal = bits.to(tl.float32, bitcast=True)
    ax = tl.abs(x)
    sub = (ax + 16384.0) - 16384.0  # subnormals: multiples of 2**-9, ties to even
    sub = tl.where(x < 0, -sub, sub)
    return tl.where(ax < 0.015625, sub, normal)


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
):
    offs_d = tl.arange(0, HEAD_DIM)
    x = tl.load(
        X + offs_t[:, None] * stride_xt + head * stride_xh + offs_d[None, :],
        mask=t_ok[:, None],
        other=0.0,
    )
    dst = C + slot[:, None] * stride_ct + head * stride_ch + offs_d[None, :]
    if FP8:
        x = x.to(tl.float32)
        # IEEE division (div_rn), as torch computes it: the scales and bytes match the reference
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), _FP8_MAX), _SCALE_MIN)
        xq = tl.clamp(tl.math.div_rn(x, scale[:, None]), -_FP8_MAX, _FP8_MAX)
        tl.store(dst, _round_e4m3(xq).to(C.dtype.element_ty), mask=t_ok[:, None])
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
    FP8: tl.constexpr,
):
    head = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < num_tokens
    slot = tl.load(LOC + offs_t, mask=t_ok, other=0).to(tl.int64)
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
    block_t: int = 16,
    num_warps: int = 4,
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
    """
    fp8 = _check(k, v, k_cache, v_cache, loc, k_scale, v_scale)
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    if head_dim & (head_dim - 1):
        raise ValueError(f"store_kv: head_dim {head_dim} must be a power of two")
    ks = k_scale if fp8 else k_cache  # placeholder pointers, never read when not fp8
    vs = v_scale if fp8 else v_cache
    grid = (triton.cdiv(tokens, block_t), kv_heads)
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
        FP8=fp8,
        num_warps=num_warps,
    )
