"""Shared pieces of the paged attention kernels: supported values, checks, one KV tile step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import is_fp8

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
SUPPORTED_Q_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
MAX_GQA_GROUP = 16


def unsupported_reason(
    head_dim: int,
    page_size: int,
    kv_dtype: torch.dtype,
    q_dtype: torch.dtype = torch.bfloat16,
    gqa_group: int = 1,
) -> str | None:
    """None when the kernels run this configuration, else a sentence naming the bad value."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {head_dim} is not supported; supported: {SUPPORTED_HEAD_DIMS}"
    if page_size not in SUPPORTED_PAGE_SIZES:
        return f"page size {page_size} is not supported; supported: {SUPPORTED_PAGE_SIZES}"
    if kv_dtype not in SUPPORTED_KV_DTYPES:
        return f"KV cache dtype {kv_dtype} is not supported; supported: {SUPPORTED_KV_DTYPES}"
    if q_dtype not in SUPPORTED_Q_DTYPES:
        return f"query dtype {q_dtype} is not supported; supported: {SUPPORTED_Q_DTYPES}"
    if not 1 <= gqa_group <= MAX_GQA_GROUP:
        return f"GQA group {gqa_group} (q_heads / kv_heads) is not supported; 1..{MAX_GQA_GROUP}"
    if not is_fp8(kv_dtype) and kv_dtype != q_dtype:
        return f"KV cache dtype {kv_dtype} differs from query dtype {q_dtype}; use fp8 or {q_dtype}"
    return None


def check_supported(
    head_dim: int,
    page_size: int,
    kv_dtype: torch.dtype,
    q_dtype: torch.dtype = torch.bfloat16,
    gqa_group: int = 1,
) -> None:
    """Raise ValueError naming the unsupported value (for backend start-up checks)."""
    reason = unsupported_reason(head_dim, page_size, kv_dtype, q_dtype, gqa_group)
    if reason is not None:
        raise ValueError(f"atom attention kernels: {reason}")


def check_inputs(q, k_cache, v_cache, page_table, seq_lens, page_size, k_scale, v_scale) -> bool:
    """Assert the shared layout (kernels/README.md); return whether the cache is fp8."""
    assert q.dim() == 3 and q.stride(2) == 1, "q: [tokens, q_heads, head_dim], head_dim contiguous"
    assert k_cache.dim() == 3 and k_cache.shape == v_cache.shape, (
        "k/v cache: [slots, kv_heads, head_dim]"
    )
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "k/v cache must be contiguous"
    assert k_cache.dtype == v_cache.dtype, "k_cache and v_cache dtypes differ"
    q_heads, head_dim = q.shape[1:]
    kv_heads = k_cache.shape[1]
    assert k_cache.shape[2] == head_dim, (
        f"cache head_dim {k_cache.shape[2]} != q head_dim {head_dim}"
    )
    assert q_heads % kv_heads == 0, f"q_heads {q_heads} not a multiple of kv_heads {kv_heads}"
    check_supported(head_dim, page_size, k_cache.dtype, q.dtype, q_heads // kv_heads)
    assert k_cache.shape[0] % page_size == 0, "num_slots must be a multiple of page_size"
    assert (
        page_table.dim() == 2 and page_table.dtype == torch.int32 and page_table.stride(1) == 1
    ), "page_table: [batch, max_pages] int32, row-contiguous"
    assert seq_lens.dim() == 1 and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous(), (
        "seq_lens: [batch] int32 contiguous"
    )
    assert page_table.shape[0] >= seq_lens.shape[0], "page_table has fewer rows than seq_lens"
    fp8 = is_fp8(k_cache.dtype)
    if fp8:
        assert k_scale is not None and v_scale is not None, "fp8 KV needs k_scale and v_scale"
        for s in (k_scale, v_scale):
            assert (
                s.dtype == torch.float32 and s.is_contiguous() and s.shape == k_cache.shape[:2]
            ), "k_scale/v_scale: [num_slots, kv_heads] fp32 contiguous"
    return fp8


def on_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


LOG2E = 1.4426950408889634
# how fp8 K/V meet q in the dots (attend_tile, prepare_q):
#   "bf16": K/V cast to bf16 (Triton's conversion, two steps per pair through fp16 and fp32);
#   "f16": cast to fp16 (one conversion per pair), q scaled into fp16 range per row, V scales
#     normalized by the tile's largest;
#   "fp8": q quantized to e4m3 for the K dot (q's own error ~5e-2 relative: too coarse), V as f16;
#   "bits": the e4m3 bits moved into bf16 bits with integer operations (`fp8_bits`, exact: the
#     value times 2^-120), q times 2^64 and p times v_scale * 2^112, the powers of two undone on
#     the scores and on the output; numerically the "bf16" cast, with no conversion at all (on
#     H200 it beat K-only bits with V cast, benchmarks/results/tune_fp8_decode.log's "kbits").
# Measured and dropped (benchmarks/results/tune_decode.log, H200): the key tile as the first
# dot operand ("keys-major", 0.77-0.80x this at 64 x 4K) and fp8 dots with q and p split into
# two e4m3 terms (0.73x): both slower than "bits" with the query rows leading.
KV_MODES = {"bf16": 0, "f16": 1, "fp8": 2, "bits": 3}


def kv_mode_id(kv_mode: str | None, q: torch.Tensor) -> int:
    """The KV_MODES value for fp8 K/V: `kv_mode`, by default "bits" for a bf16 q and, for an
    fp16 q, mode 0 (K/V cast to fp16: "bits" would round q to bf16)."""
    if kv_mode is None:
        kv_mode = "bits" if q.dtype == torch.bfloat16 else "bf16"
    if kv_mode not in KV_MODES:
        raise ValueError(f"kv_mode {kv_mode!r} is not one of {sorted(KV_MODES)}")
    if kv_mode == "bits" and q.dtype != torch.bfloat16:
        raise ValueError(f"kv_mode 'bits' needs a bf16 q, got {q.dtype}; use 'bf16' (q's dtype)")
    return KV_MODES[kv_mode]


Q_BITS_SCALE = tl.constexpr(2.0**64)  # "bits": q times this ...
QK_BITS_SCALE = tl.constexpr(2.0**56)  # ... and K's 2^-120: the scores come out times 2^-56
P_BITS_SCALE = tl.constexpr(2.0**112)  # "bits": p * v_scale / tile max, times this; out 2^-8
OUT_BITS_SCALE = tl.constexpr(256.0)


@triton.jit
def fp8_bits(x, DOT_F32: tl.constexpr):
    """float8_e4m3fn elements -> bf16 elements equal to their values times 2^-120, exactly,
    subnormals included.

    The sign goes to bit 15 and the 7 exponent and mantissa bits to bits 10..4: the exponent's
    low 4 bits and the mantissa's top 3 (bias 127 over e4m3's 7). e4m3's NaN is never stored.
    On a GPU this is two byte permutes and three integer operations per four elements instead
    of Triton's conversions through fp16 and fp32; Triton's interpreter (CPU) runs the same bit
    moves as integer operations."""
    u = x.to(tl.uint8, bitcast=True)
    if DOT_F32:
        w = u.to(tl.uint16)
        out = (((w & 0x80) << 8) | ((w & 0x7F) << 4)).to(tl.bfloat16, bitcast=True)
    else:
        out = _bits_to_bf16_asm(u)
    return out


# four bytes in, two 32-bit words of bf16 lanes out: each lane first holds its byte << 8
# (prmt), then keeps its sign bit (bit 15) and takes the other 7 bits 4 places down
@triton.jit
def _bits_to_bf16_asm(u):
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 lo, hi, s, t;
        prmt.b32 lo, $2, 0, 0x1404;
        prmt.b32 hi, $2, 0, 0x3424;
        shr.b32 s, lo, 4;
        and.b32 t, lo, 0x80008000;
        lop3.b32 $0, s, 0x07F007F0, t, 0xEA;
        shr.b32 s, hi, 4;
        and.b32 t, hi, 0x80008000;
        lop3.b32 $1, s, 0x07F007F0, t, 0xEA;
        }
        """,
        constraints="=r,=r,r",
        args=[u],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def attend_tile(
    acc,
    m_i,
    l_i,
    q,
    k_base,
    v_base,
    ks_base,
    vs_base,
    pt_row,
    start_n,
    bound,
    row_limit,
    qk_scale,
    stride_kt,
    stride_vt,
    stride_st,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    FP8: tl.constexpr,
    MASKED: tl.constexpr,
    KV_MODE: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """One online-softmax step over keys [start_n, start_n + BLOCK_N) of one sequence.

    Rows are query rows (q [BLOCK_M, HEAD_DIM]); keys are gathered through the page table row.
    With MASKED, a key counts only when key < bound and key <= row_limit[row]; scores are in the
    log2 domain (qk_scale includes log2(e)). fp8 K/V become dot operands per KV_MODE and their
    per-token scales are applied to the scores (K) and to the probabilities (V), never to
    elements.

    fp8 KV_MODE: a `KV_MODES` value (q as `prepare_q` made it). In modes 1 and 2 qk_scale is a
    [BLOCK_M] vector (q's row scale folded in). In every mode the probabilities are scaled by
    v_scale over the tile's largest v_scale, which multiplies the tile's p @ V once. Mode 3
    leaves acc times 2^-8 (the kernel's epilogue multiplies by OUT_BITS_SCALE).
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if MASKED:
        n_ok = offs_n < bound
        page = tl.load(pt_row + offs_n // PAGE, mask=n_ok, other=0)
    else:
        page = tl.load(pt_row + offs_n // PAGE)
    slot = page.to(tl.int64) * PAGE + offs_n % PAGE
    if MASKED:
        k = tl.load(
            k_base + slot[:, None] * stride_kt + offs_d[None, :], mask=n_ok[:, None], other=0.0
        )
    else:
        k = tl.load(k_base + slot[:, None] * stride_kt + offs_d[None, :])
    if FP8 and KV_MODE == 3:
        k = fp8_bits(k, DOT_F32)
    s = tl.dot(q, tl.trans(k.to(q.dtype)))
    if FP8:
        # masked: a key past the sequence maps to page 0, whose scale may be anything
        if MASKED:
            ksc = tl.load(ks_base + slot * stride_st, mask=n_ok, other=1.0)
        else:
            ksc = tl.load(ks_base + slot * stride_st)
        if KV_MODE == 1 or KV_MODE == 2:
            s = s * qk_scale[:, None] * ksc[None, :]
        else:
            s = s * (ksc * qk_scale)[None, :]
    else:
        s = s * qk_scale
    if MASKED:
        ok = n_ok[None, :] & (offs_n[None, :] <= row_limit[:, None])
        s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet stay at zero
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(
            v_base + slot[:, None] * stride_vt + offs_d[None, :], mask=n_ok[:, None], other=0.0
        )
    else:
        v = tl.load(v_base + slot[:, None] * stride_vt + offs_d[None, :])
    if FP8:
        # p times v_scale over the tile's largest v_scale, which multiplies p @ V once: the dot
        # operand stays in (0, 1] (x 2^112 in mode 3), so a small V scale cannot underflow an
        # fp16 operand and a large one cannot overflow mode 3's power of two
        if MASKED:
            vsc = tl.load(vs_base + slot * stride_st, mask=n_ok, other=0.0)
        else:
            vsc = tl.load(vs_base + slot * stride_st)
        vmax = tl.maximum(tl.max(vsc, 0), 1e-30)
        p = p * (vsc * (1.0 / vmax))[None, :]
        if KV_MODE == 3:
            v = fp8_bits(v, DOT_F32)
            pv = tl.dot((p * P_BITS_SCALE).to(q.dtype), v.to(q.dtype))
        elif DOT_F32:
            pv = tl.dot(p, v.to(tl.float32))
        elif KV_MODE == 0:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        else:
            pv = tl.dot(p.to(tl.float16), v.to(tl.float16))
        acc = acc * alpha[:, None] + pv * vmax
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
    return acc, m_new, l_i


@triton.jit
def prepare_q(q, qk_scale, FP8: tl.constexpr, KV_MODE: tl.constexpr, DOT_F32: tl.constexpr):
    """(dot operand, score scale) for q [BLOCK_M, HEAD_DIM] as loaded, per `attend_tile` mode.

    Mode 1: q times a power of two per row, so its largest element lies in [256, 512): exact in
    fp16 (bf16's 8-bit significand fits in fp16's 11). Mode 2: e4m3 with scale amax / 448.
    Mode 3: q times 2^64, exact in bf16, against K's 2^-120."""
    qd = q
    qsc = qk_scale
    if FP8 and (KV_MODE == 1 or KV_MODE == 2):
        qf = q.to(tl.float32)
        qmax = tl.maximum(tl.max(tl.abs(qf), 1), 1e-30)
        if KV_MODE == 1:
            qs = tl.math.exp2(tl.floor(tl.math.log2(qmax)) - 8.0)
            qd = (qf * (1.0 / qs)[:, None]).to(tl.float16)
        else:
            qs = qmax / 448.0
            qd = (qf / qs[:, None]).to(tl.float8e4nv)
        qsc = qs * qk_scale
    elif FP8 and KV_MODE == 3:
        qd = (q.to(tl.float32) * Q_BITS_SCALE).to(tl.bfloat16)
        qsc = qk_scale * QK_BITS_SCALE
    if DOT_F32:  # Triton's CPU interpreter multiplies 16-bit dot operands as raw bits
        qd = qd.to(tl.float32)
    return qd, qsc
