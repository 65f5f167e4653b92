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
#     H200 it beat K-only bits with V cast, benchmarks/results/tune_fp8_decode.log's "kbits");
#   "pairs" and "f16pairs" (`attend_tile_pairs`; extend reads its cached prefix so): the cache
#     read as 16-bit words of two e4m3 bytes, the even dims' and the odd dims' tiles made from them
#     ("bits"' moves, or the hardware's e4m3x2 -> f16x2 with q and p as in "f16"), q and the
#     output split the same way. The 8-bit tiles of the modes above are read out of shared
#     memory byte by byte to be laid out for the MMA, which left the "bits" kernel issue-bound
#     at 0.55 of the copy rate; 16-bit tiles take ldmatrix. On H200 "f16pairs" reads 0.80-0.85
#     of the copy rate at batch >= 16 (benchmarks/results/tune_decode_pairs.log), the tuned
#     default there (sgl_atom/attention/tuned/NVIDIA_H200.json).
# Measured and dropped (benchmarks/results/tune_decode.log, H200): the key tile as the first
# dot operand ("keys-major", 0.77-0.80x this at 64 x 4K) and fp8 dots with q and p split into
# two e4m3 terms (0.73x): both slower than "bits" with the query rows leading.
KV_MODES = {"bf16": 0, "f16": 1, "fp8": 2, "bits": 3, "pairs": 4, "f16pairs": 5}


def kv_mode_id(kv_mode: str | None, q: torch.Tensor) -> int:
    """The KV_MODES value for fp8 K/V: `kv_mode`, by default "bits" for a bf16 q and, for an
    fp16 q, mode 0 (K/V cast to fp16: "bits" would round q to bf16)."""
    if kv_mode is None:
        kv_mode = "bits" if q.dtype == torch.bfloat16 else "bf16"
    if kv_mode not in KV_MODES:
        raise ValueError(f"kv_mode {kv_mode!r} is not one of {sorted(KV_MODES)}")
    if kv_mode in ("bits", "pairs") and q.dtype != torch.bfloat16:
        raise ValueError(
            f"kv_mode {kv_mode!r} needs a bf16 q, got {q.dtype}; use 'bf16' (q's dtype)"
        )
    return KV_MODES[kv_mode]


PAIRS_MODES = (KV_MODES["pairs"], KV_MODES["f16pairs"])


def kernel_caches(
    k_cache: torch.Tensor, v_cache: torch.Tensor, kv_mode: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V caches as the kernel takes them: in the pairs modes 16-bit views (each word the
    e4m3 bytes of dims 2j and 2j + 1; strides then count words), else as they are."""
    if kv_mode in PAIRS_MODES:
        return k_cache.view(torch.int16), v_cache.view(torch.int16)
    return k_cache, v_cache


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
def fp8_pair_bits(x, F16: tl.constexpr, DOT_F32: tl.constexpr):
    """16-bit words of two float8_e4m3fn bytes -> (low bytes, high bytes) as 16-bit elements:
    bf16 equal to their values times 2^-120 (`fp8_bits`' moves), or with F16 fp16 equal to
    their values (the hardware's e4m3x2 -> f16x2 conversion); both exact."""
    w = x.to(tl.uint16, bitcast=True)
    if DOT_F32:
        lo = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
        hi = (w >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
        if F16:
            lo = lo.to(tl.float32)
            hi = hi.to(tl.float32)
        else:
            lo = fp8_bits(lo, DOT_F32)
            hi = fp8_bits(hi, DOT_F32)
    elif F16:
        lo = _pair_to_f16_asm(w, "lo")
        hi = _pair_to_f16_asm(w, "hi")
    else:
        lo = _pair_bits_to_bf16_asm(w, "0x2404")
        hi = _pair_bits_to_bf16_asm(w, "0x3414")
    return lo, hi


# two 16-bit words in, one fp16x2 out: the words' low bytes (HALF "lo") or high bytes ("hi")
# gathered into one 16-bit half (prmt 0x3120: bytes 0, 2, 1, 3) and converted by the
# hardware's e4m3x2 -> f16x2
@triton.jit
def _pair_to_f16_asm(w, HALF: tl.constexpr):
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 x;
        .reg .b16 lo, hi;
        prmt.b32 x, $1, 0, 0x3120;
        mov.b32 {lo, hi}, x;
        cvt.rn.f16x2.e4m3x2 $0, """
        + HALF
        + """;
        }
        """,
        constraints="=r,r",
        args=[w],
        dtype=tl.float16,
        is_pure=True,
        pack=2,
    )


# two 16-bit words in, one 32-bit word of bf16 lanes out: byte 0 or 1 of each word (the prmt
# selector puts bytes 0 and 2, or 1 and 3, at the top of each lane), then `fp8_bits`' moves.
# One output per call: Triton then moves each half's conversion past its shared-memory load
# into the dot operand's layout on its own (with two outputs it converted one half twice)
@triton.jit
def _pair_bits_to_bf16_asm(w, SELECT: tl.constexpr):
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 x, s, t;
        prmt.b32 x, $1, 0, """
        + SELECT
        + """;
        shr.b32 s, x, 4;
        and.b32 t, x, 0x80008000;
        lop3.b32 $0, s, 0x07F007F0, t, 0xEA;
        }
        """,
        constraints="=r,r",
        args=[w],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=2,
    )


@triton.jit
def _tile_slots(
    pt_row, start_n, bound, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr
):
    """(key positions, in-bounds mask, cache slots) of keys [start_n, start_n + BLOCK_N)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < bound
    if MASKED:
        page = tl.load(pt_row + offs_n // PAGE, mask=n_ok, other=0)
    else:
        page = tl.load(pt_row + offs_n // PAGE)
    return offs_n, n_ok, page.to(tl.int64) * PAGE + offs_n % PAGE


@triton.jit
def _tile_rows(base, slot, n_ok, stride, WIDTH: tl.constexpr, MASKED: tl.constexpr):
    """The [BLOCK_N, WIDTH] rows of one head at `slot` (zeros past the bound when MASKED)."""
    offs = tl.arange(0, WIDTH)
    if MASKED:
        return tl.load(base + slot[:, None] * stride + offs[None, :], mask=n_ok[:, None], other=0.0)
    return tl.load(base + slot[:, None] * stride + offs[None, :])


@triton.jit
def _tile_scale(base, slot, n_ok, stride, other, MASKED: tl.constexpr):
    # masked: a key past the sequence maps to page 0, whose scale may be anything
    if MASKED:
        return tl.load(base + slot * stride, mask=n_ok, other=other)
    return tl.load(base + slot * stride)


@triton.jit
def _softmax_step(s, m_i, l_i, offs_n, n_ok, row_limit, MASKED: tl.constexpr):
    """Scores s (log2 domain) -> (p, alpha, m_new, l_i) of the online softmax."""
    if MASKED:
        ok = n_ok[None, :] & (offs_n[None, :] <= row_limit[:, None])
        s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet stay at zero
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def _p_times_v_scale(p, vs_base, slot, n_ok, stride_st, MASKED: tl.constexpr):
    """(p times v_scale over the tile's largest v_scale, that largest): the largest multiplies
    the tile's p @ V once, so the dot operand stays in (0, 1] (x 2^112 in the bits modes): a
    small V scale cannot underflow an fp16 operand, a large one cannot overflow the bits
    modes' power of two."""
    vsc = _tile_scale(vs_base, slot, n_ok, stride_st, 0.0, MASKED)
    vmax = tl.maximum(tl.max(vsc, 0), 1e-30)
    return p * (vsc * (1.0 / vmax))[None, :], vmax


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

    fp8 KV_MODE: a `KV_MODES` value other than "pairs" (`attend_tile_pairs`; q as `prepare_q`
    made it). In modes 1 and 2 qk_scale is a [BLOCK_M] vector (q's row scale folded in). In
    every mode the probabilities are scaled by v_scale over the tile's largest v_scale, which
    multiplies the tile's p @ V once. Mode 3 leaves acc times 2^-8 (the kernel's epilogue
    multiplies by OUT_BITS_SCALE).
    """
    offs_n, n_ok, slot = _tile_slots(pt_row, start_n, bound, PAGE, BLOCK_N, MASKED)
    k = _tile_rows(k_base, slot, n_ok, stride_kt, HEAD_DIM, MASKED)
    if FP8 and KV_MODE == 3:
        k = fp8_bits(k, DOT_F32)
    s = tl.dot(q, tl.trans(k.to(q.dtype)))
    if FP8:
        ksc = _tile_scale(ks_base, slot, n_ok, stride_st, 1.0, MASKED)
        if KV_MODE == 1 or KV_MODE == 2:
            s = s * qk_scale[:, None] * ksc[None, :]
        else:
            s = s * (ksc * qk_scale)[None, :]
    else:
        s = s * qk_scale
    p, alpha, m_new, l_i = _softmax_step(s, m_i, l_i, offs_n, n_ok, row_limit, MASKED)
    v = _tile_rows(v_base, slot, n_ok, stride_vt, HEAD_DIM, MASKED)
    if FP8:
        p, vmax = _p_times_v_scale(p, vs_base, slot, n_ok, stride_st, MASKED)
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
def attend_tile_pairs(
    acc_lo,
    acc_hi,
    m_i,
    l_i,
    q_lo,
    q_hi,
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
    MASKED: tl.constexpr,
    F16: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """`attend_tile` for fp8 K/V in the "pairs" modes: the cache is read as 16-bit words, each
    holding the e4m3 bytes of dims 2j (low byte) and 2j + 1 (high byte), so the tiles are 16-bit
    end to end (no byte-wise shared-memory loads to lay an 8-bit tile out for the MMA). Each
    word becomes two bf16 bit patterns (`fp8_pair_bits`, the "bits" mode's exact moves): the
    even dims' tile and the odd dims'. q comes split the same way (q_lo: even dims, q_hi: odd
    dims, both as `prepare_q` made them in mode 3), the scores are the sum of the two dots, and
    the output accumulates in two halves (acc_lo: even dims, acc_hi: odd dims), each times 2^-8
    as in mode 3. k_base/v_base point at the 16-bit view; strides count 16-bit words."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_n, n_ok, slot = _tile_slots(pt_row, start_n, bound, PAGE, BLOCK_N, MASKED)
    k_rows = _tile_rows(k_base, slot, n_ok, stride_kt, HALF, MASKED)
    k_lo, k_hi = fp8_pair_bits(k_rows, F16, DOT_F32)
    if DOT_F32:
        k_lo = k_lo.to(tl.float32)
        k_hi = k_hi.to(tl.float32)
    s = tl.dot(q_lo, tl.trans(k_lo))
    s = tl.dot(q_hi, tl.trans(k_hi), s)
    ksc = _tile_scale(ks_base, slot, n_ok, stride_st, 1.0, MASKED)
    if F16:
        s = s * qk_scale[:, None] * ksc[None, :]
    else:
        s = s * (ksc * qk_scale)[None, :]
    p, alpha, m_new, l_i = _softmax_step(s, m_i, l_i, offs_n, n_ok, row_limit, MASKED)
    v_rows = _tile_rows(v_base, slot, n_ok, stride_vt, HALF, MASKED)
    v_lo, v_hi = fp8_pair_bits(v_rows, F16, DOT_F32)
    p, vmax = _p_times_v_scale(p, vs_base, slot, n_ok, stride_st, MASKED)
    if F16:
        pb = p.to(q_lo.dtype)  # fp16 (fp32 on CPU)
    else:
        pb = (p * P_BITS_SCALE).to(q_lo.dtype)  # bf16 (fp32 on CPU, as in mode 3)
    if DOT_F32:
        v_lo = v_lo.to(tl.float32)
        v_hi = v_hi.to(tl.float32)
    acc_lo = acc_lo * alpha[:, None] + tl.dot(pb, v_lo) * vmax
    acc_hi = acc_hi * alpha[:, None] + tl.dot(pb, v_hi) * vmax
    return acc_lo, acc_hi, m_new, l_i


@triton.jit
def attend_range(
    acc,
    m_i,
    l_i,
    q,
    K,
    V,
    ks_base,
    vs_base,
    pt_row,
    kvh,
    start,
    full_end,
    end,
    row_limit,
    qk_scale,
    stride_kt,
    stride_vt,
    stride_st,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    FP8: tl.constexpr,
    KV_MODE: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Keys [start, end) of KV head kvh: whole tiles up to full_end unmasked, the rest masked
    (`attend_tile`). In the pairs modes (4, 5) K/V are the 16-bit views (`kernel_caches`) and
    q and acc are split into their even and odd dims for the range (`attend_tile_pairs`),
    acc joined back after it."""
    if FP8 and (KV_MODE == 4 or KV_MODE == 5):
        HALF: tl.constexpr = HEAD_DIM // 2
        k_base = K + kvh * HALF
        v_base = V + kvh * HALF
        q_lo, q_hi = tl.split(tl.reshape(q, [q.shape[0], HALF, 2]))
        acc_lo, acc_hi = tl.split(tl.reshape(acc, [q.shape[0], HALF, 2]))
        for start_n in range(start, full_end, BLOCK_N):
            acc_lo, acc_hi, m_i, l_i = attend_tile_pairs(
                acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, k_base, v_base, ks_base, vs_base, pt_row,
                start_n, end, row_limit, qk_scale, stride_kt, stride_vt, stride_st,
                PAGE, BLOCK_N, HEAD_DIM, False, KV_MODE == 5, DOT_F32,
            )  # fmt: skip
        for start_n in range(full_end, end, BLOCK_N):
            acc_lo, acc_hi, m_i, l_i = attend_tile_pairs(
                acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, k_base, v_base, ks_base, vs_base, pt_row,
                start_n, end, row_limit, qk_scale, stride_kt, stride_vt, stride_st,
                PAGE, BLOCK_N, HEAD_DIM, True, KV_MODE == 5, DOT_F32,
            )  # fmt: skip
        acc = tl.reshape(tl.join(acc_lo, acc_hi), [q.shape[0], HEAD_DIM])
    else:
        k_base = K + kvh * HEAD_DIM
        v_base = V + kvh * HEAD_DIM
        for start_n in range(start, full_end, BLOCK_N):
            acc, m_i, l_i = attend_tile(
                acc, m_i, l_i, q, k_base, v_base, ks_base, vs_base, pt_row, start_n, end,
                row_limit, qk_scale, stride_kt, stride_vt, stride_st,
                PAGE, BLOCK_N, HEAD_DIM, FP8, False, KV_MODE, DOT_F32,
            )  # fmt: skip
        for start_n in range(full_end, end, BLOCK_N):
            acc, m_i, l_i = attend_tile(
                acc, m_i, l_i, q, k_base, v_base, ks_base, vs_base, pt_row, start_n, end,
                row_limit, qk_scale, stride_kt, stride_vt, stride_st,
                PAGE, BLOCK_N, HEAD_DIM, FP8, True, KV_MODE, DOT_F32,
            )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def prepare_q(q, qk_scale, FP8: tl.constexpr, KV_MODE: tl.constexpr, DOT_F32: tl.constexpr):
    """(dot operand, score scale) for q [BLOCK_M, HEAD_DIM] as loaded, per `attend_tile` mode.

    Modes 1 and 5: q times a power of two per row, so its largest element lies in [256, 512):
    exact in fp16 (bf16's 8-bit significand fits in fp16's 11). Mode 2: e4m3 with scale
    amax / 448.
    Modes 3 and 4: q times 2^64, exact in bf16, against K's 2^-120."""
    qd = q
    qsc = qk_scale
    if FP8 and (KV_MODE == 1 or KV_MODE == 2 or KV_MODE == 5):
        qf = q.to(tl.float32)
        qmax = tl.maximum(tl.max(tl.abs(qf), 1), 1e-30)
        if KV_MODE == 1 or KV_MODE == 5:
            qs = tl.math.exp2(tl.floor(tl.math.log2(qmax)) - 8.0)
            qd = (qf * (1.0 / qs)[:, None]).to(tl.float16)
        else:
            qs = qmax / 448.0
            qd = (qf / qs[:, None]).to(tl.float8e4nv)
        qsc = qs * qk_scale
    elif FP8 and (KV_MODE == 3 or KV_MODE == 4):
        qd = (q.to(tl.float32) * Q_BITS_SCALE).to(tl.bfloat16)
        qsc = qk_scale * QK_BITS_SCALE
    if DOT_F32:  # Triton's CPU interpreter multiplies 16-bit dot operands as raw bits
        qd = qd.to(tl.float32)
    return qd, qsc
