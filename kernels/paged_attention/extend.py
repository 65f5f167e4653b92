"""Extend / prefill attention: each sequence's new tokens (the last qo_len of seq_len) attend
causally to the cached prefix and to themselves, through the page table.

A tile's rows are (token, head) pairs of one GQA group, token-major, so each K/V tile is read
once per group. The keys every row sees are visited without masks; only the diagonal band is
masked. Tiles are issued longest-first (reverse order) to balance the causal triangle.

With an fp8 cache and the new tokens' own K/V passed in (``k_new``, ``v_new``, q's dtype), the
new tokens attend to those exact rows and read only the cached prefix from fp8: a fresh prompt
runs the 16-bit path alone, and a prefix hit converts only the prefix.

Converting a cached fp8 prefix inside the kernel costs every query tile a conversion of every
prefix tile, in the same warps as the MMAs: 1.8-2x the bf16 time for a later chunk of a chunked
prefill, and as much for a short extend over a long prefix, whose few programs walk the prefix
latency-bound (`benchmarks/results/probe_extend_fp8.log`). So by default (`plan_prefix_dequant`)
the batch's cached prefixes are dequantized once, with the new tokens' rows, into a bf16
workspace (`dequant_prefix`: memory-bound, tens of microseconds at 16K), and the extend runs the
16-bit kernel over it; only a batch of prefixes too large for the workspace cap is converted in
the kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import (
    LOG2E,
    OUT_BITS_SCALE,
    attend_range,
    check_inputs,
    kernel_caches,
    kv_mode_id,
    on_cpu,
    prepare_q,
)


@triton.jit
def extend_fwd_kernel(
    Q,
    K,
    V,
    KS,
    VS,
    PT,
    SL,
    QO,
    Out,
    KN,
    VN,
    IDX,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_vt,
    stride_st,
    stride_pt,
    stride_ot,
    stride_oh,
    stride_knt,
    stride_vnt,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    FP8: tl.constexpr,
    KV_MODE: tl.constexpr,
    DOT_F32: tl.constexpr,
    SPLIT: tl.constexpr,
):
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(QO + b)
    qo_len = tl.load(QO + b + 1) - q_start
    seq_len = tl.load(SL + b)
    prefix = seq_len - qo_len

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = tok < qo_len
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    row_limit = prefix + tok

    first_tok = m_block * BLOCK_M // GROUP
    last_tok = tl.minimum((m_block * BLOCK_M + BLOCK_M - 1) // GROUP, qo_len - 1)
    live = first_tok < qo_len  # tiles past this sequence's rows do nothing
    full_end = tl.where(live, (prefix + first_tok) // BLOCK_N * BLOCK_N, 0)
    diag_end = tl.where(live, prefix + last_tok + 1, 0)

    pt_row = PT + b * stride_pt
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SPLIT:
        # keys prefix.. are the new tokens' own rows KN/VN[q_start + key - prefix] (q's dtype),
        # reached through the identity table IDX as a page-size-1 table; prefix keys stay fp8
        qn = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
        qn, qk_n = prepare_q(qn, qk_scale, False, 0, DOT_F32)
        idx_row = IDX + (q_start - prefix)
        new_full = tl.where(live, prefix + first_tok // BLOCK_N * BLOCK_N, prefix)
        acc, m_i, l_i = attend_range(
            acc, m_i, l_i, qn, KN, VN, KS, VS, idx_row, kvh, prefix, new_full, diag_end,
            row_limit, qk_n, stride_knt, stride_vnt, stride_st, 1, BLOCK_N, HEAD_DIM, False, 0,
            DOT_F32,
        )  # fmt: skip
        if FP8 and (KV_MODE == 3 or KV_MODE == 4):  # the fp8 tiles add acc x 2^-8 (attend_tile)
            acc = acc * (1.0 / OUT_BITS_SCALE)
        # the cached prefix: whole tiles, then the one the prefix ends in
        full_end = tl.where(live, prefix // BLOCK_N * BLOCK_N, 0)
        diag_end = tl.where(live, prefix, 0)
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    # on CPU (DOT_F32) dot operands are fp32: Triton's interpreter multiplies bf16 as raw bits
    q, qk_scale = prepare_q(q, qk_scale, FP8, KV_MODE, DOT_F32)
    acc, m_i, l_i = attend_range(
        acc, m_i, l_i, q, K, V, KS + kvh, VS + kvh, pt_row, kvh, 0, full_end, diag_end,
        row_limit, qk_scale, stride_kt, stride_vt, stride_st, PAGE, BLOCK_N, HEAD_DIM, FP8,
        KV_MODE, DOT_F32,
    )  # fmt: skip
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if FP8 and (KV_MODE == 3 or KV_MODE == 4):
        o = o * OUT_BITS_SCALE
    tl.store(
        Out + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        o.to(Out.dtype.element_ty),
        mask=row_ok[:, None],
    )


@triton.jit
def dequant_prefix_kernel(
    K,
    V,
    KS,
    VS,
    KN,
    VN,
    PT,
    SL,
    QO,
    OFF,
    KD,
    VD,
    kv_heads,
    stride_kt,
    stride_st,
    stride_knt,
    stride_vnt,
    stride_pt,
    stride_dt,
    PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    b = tl.program_id(1)
    q_start = tl.load(QO + b)
    seq_len = tl.load(SL + b)
    prefix = seq_len - (tl.load(QO + b + 1) - q_start)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cached = t < prefix
    fresh = (t >= prefix) & (t < seq_len)
    page = tl.load(PT + b * stride_pt + t // PAGE, mask=cached, other=0)
    slot = page.to(tl.int64) * PAGE + t % PAGE
    row = (q_start + t - prefix).to(tl.int64)
    dst = (tl.load(OFF + b) + t).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)[None, :]
    for h in range(kv_heads):
        col = h * HEAD_DIM + offs_d
        _workspace_rows(K, KS, KN, KD, slot, row, dst, h, col, cached, fresh, stride_kt,
                        stride_st, stride_knt, stride_dt)  # fmt: skip
        _workspace_rows(V, VS, VN, VD, slot, row, dst, h, col, cached, fresh, stride_kt,
                        stride_st, stride_vnt, stride_dt)  # fmt: skip


@triton.jit
def _workspace_rows(
    C, S, N, D, slot, row, dst, h, col, cached, fresh, stride_ct, stride_st, stride_nt, stride_dt
):
    """One head's workspace rows: cached keys dequantized (e4m3 x scale), new ones copied."""
    sc = tl.load(S + slot * stride_st + h, mask=cached, other=0.0)
    x = tl.load(C + slot[:, None] * stride_ct + col, mask=cached[:, None], other=0.0)
    x = x.to(tl.float32) * sc[:, None]
    n = tl.load(N + row[:, None] * stride_nt + col, mask=fresh[:, None], other=0.0)
    x = tl.where(cached[:, None], x, n.to(tl.float32))
    tl.store(D + dst[:, None] * stride_dt + col, x.to(D.dtype.element_ty),
             mask=(cached | fresh)[:, None])  # fmt: skip


DEQUANT_MAX_BYTES = 256 << 20  # default workspace cap (bf16 K and V rows of the batch)
# The workspace is read as pages of this many rows, each sequence's rows starting on a page:
# the 16-bit kernel then walks it as it walks a page-16 cache (a page-size-1 table, one index
# load per key, costs it 1.4-1.7x at 128-row tiles on the H200: probe_extend_fp8.log).
WORKSPACE_PAGE = 16


@dataclass(frozen=True)
class PrefixDequant:
    """The bf16 workspace of an fp8 extend (`plan_prefix_dequant`): sequence b's keys 0 ..
    seq_len - 1 (cached prefix, then its new tokens) are rows offsets[b] onward, offsets[b] a
    multiple of WORKSPACE_PAGE."""

    table: torch.Tensor  # [batch, pages of the longest sequence] int32: workspace page ids
    offsets: torch.Tensor  # [batch] int32
    tokens: int  # workspace rows
    max_seq_len: int


def plan_prefix_dequant(
    seq_lens: torch.Tensor,
    kv_heads: int,
    head_dim: int,
    seq_lens_cpu: Sequence[int] | None = None,
    max_bytes: int = DEQUANT_MAX_BYTES,
) -> PrefixDequant | None:
    """The workspace of `extend_fwd` over an fp8 cache with the new tokens' K/V passed, or None
    where the batch's rows (K and V, ``tokens x kv_heads x head_dim x 4`` bytes) exceed
    ``max_bytes`` and the prefix is converted in the kernel. ``seq_lens_cpu``: the host's copy
    of seq_lens; read from the device (a sync) when None."""
    lens = [int(n) for n in (seq_lens.tolist() if seq_lens_cpu is None else seq_lens_cpu)]
    page = WORKSPACE_PAGE
    pages = [-(-n // page) for n in lens]
    tokens = sum(pages) * page
    if not lens or tokens * kv_heads * head_dim * 4 > max_bytes:
        return None
    starts = [0]
    for n in pages[:-1]:
        starts.append(starts[-1] + n)
    dev = seq_lens.device
    first = torch.tensor(starts, dtype=torch.int32).to(dev, non_blocking=True)
    width = max(max(pages), 1)
    table = first[:, None] + torch.arange(width, dtype=torch.int32, device=dev)[None, :]
    return PrefixDequant(table, first * page, tokens, max(max(lens), 1))


def dequant_prefix(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    page_size: int,
    plan: PrefixDequant,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The workspace of ``plan``: K and V rows [plan.tokens, kv_heads, head_dim] in k_new's
    dtype; sequence b's cached prefix (its first seq_len - qo_len keys) from the fp8 cache, each
    row e4m3 x its (token, head) scale rounded once, then its new tokens' rows of k_new/v_new
    (rows as q's) as they are."""
    kv_heads, head_dim = k_cache.shape[1:]
    kd = torch.empty(plan.tokens, kv_heads, head_dim, dtype=k_new.dtype, device=k_new.device)
    vd = torch.empty_like(kd)
    block_t = 16 if on_cpu(kd) else 8  # sm_90: 183 registers, no spill (32 spills 1.7 KB)
    grid = (triton.cdiv(plan.max_seq_len, block_t), seq_lens.shape[0])
    dequant_prefix_kernel[grid](
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        k_new,
        v_new,
        page_table,
        seq_lens,
        qo_indptr,
        plan.offsets,
        kd,
        vd,
        kv_heads,
        k_cache.stride(0),
        k_scale.stride(0),
        k_new.stride(0),
        v_new.stride(0),
        page_table.stride(0),
        kd.stride(0),
        PAGE=page_size,
        BLOCK_T=block_t,
        HEAD_DIM=head_dim,
        num_warps=4,
    )
    return kd, vd


# The 16-bit path takes 256-row tiles for an extend of at least WIDE_ROWS query rows (tokens x
# GQA group) over keys up to at least WIDE_KEYS: on the H200 1.16-1.2x faster than 128 rows at
# 8K-16K causal and 16K + 2K, even at 4K, slower for 2K alone and for a few hundred tokens over a
# long prefix (half the programs, each tile twice the work; probe_extend_fp8.log)
WIDE_ROWS = 8192
WIDE_KEYS = 4096


def _config(head_dim: int, fp8: bool, cpu: bool, rows: int = 0, keys: int = 0) -> dict:
    if cpu:  # interpreter: small tiles so small test shapes still take several steps
        return dict(block_m=32, block_n=16, num_warps=4, num_stages=1)
    if head_dim == 256:
        return dict(block_m=64, block_n=32, num_warps=4, num_stages=2)
    # best on H200 at head_dim 128, GQA 8, 8K causal (benchmarks/results/paged_attention.log)
    if fp8:
        return dict(block_m=64, block_n=128, num_warps=4, num_stages=2)
    if rows >= WIDE_ROWS and keys >= WIDE_KEYS:
        return dict(block_m=256, block_n=128, num_warps=8, num_stages=2)
    return dict(block_m=128, block_n=128, num_warps=8, num_stages=2)


def extend_fwd(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    page_size: int,
    sm_scale: float,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    max_qo_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    kv_mode: str | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    prefix_dequant: str = "auto",
    prefix_plan: PrefixDequant | None = None,
) -> torch.Tensor:
    """Causal extend/prefill attention over the paged KV.

    q: [total_q, q_heads, head_dim] bf16/fp16, head_dim contiguous; rows qo_indptr[b] ..
      qo_indptr[b + 1] are sequence b's new tokens, in order.
    k_cache, v_cache: [num_slots, kv_heads, head_dim] contiguous, q's dtype or float8_e4m3fn;
      k_scale, v_scale: [num_slots, kv_heads] fp32 (fp8 only). The new tokens' K/V are stored.
    page_table: [batch, max_pages] int32; seq_lens: [batch] int32 = prefix + new tokens;
      qo_indptr: [batch + 1] int32. New token i of b sits at position seq_len - qo_len + i and
      sees keys 0 ..= that position.
    page_size, sm_scale: as `decode_fwd`.
    out: like q, rows of all sequences written (allocated when None).
    max_qo_len: longest qo_len (read from qo_indptr, a device sync, when None).
    block_m (rows = tokens × GQA group), block_n, num_warps, num_stages, kv_mode (fp8: a
      `KV_MODES` name; the pairs modes read the cached prefix as 16-bit words): tuning
      overrides.
    k_new, v_new: [total_q, kv_heads, head_dim] in q's dtype, the new tokens' K/V as computed
      (rows as q's). With an fp8 cache the new tokens attend to these rows instead of their
      quantized copies in the cache, which is then read for the prefix only; ignored with a
      16-bit cache (its rows are these values).
    prefix_dequant, prefix_plan (fp8 cache with k_new only): "auto" runs the 16-bit kernel over
      the bf16 workspace of ``prefix_plan`` (`dequant_prefix`; planned here with
      `plan_prefix_dequant`, a device sync, when None) unless the plan is None (over its cap);
      "off" converts the cached prefix in the kernel, in ``kv_mode``.
    Returns out.
    """
    fp8 = check_inputs(q, k_cache, v_cache, page_table, seq_lens, page_size, k_scale, v_scale)
    mode = kv_mode_id(kv_mode, q) if fp8 else 0
    k_in, v_in = kernel_caches(k_cache, v_cache, mode)
    batch = seq_lens.shape[0]
    q_heads, head_dim = q.shape[1:]
    kv_heads = k_cache.shape[1]
    group = q_heads // kv_heads
    assert qo_indptr.shape == (batch + 1,) and qo_indptr.dtype == torch.int32, (
        "qo_indptr: [batch+1] int32"
    )
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "out: like q"
    if max_qo_len is None:
        max_qo_len = int((qo_indptr[1:] - qo_indptr[:-1]).max()) if batch else 0
    if batch == 0 or max_qo_len == 0:
        return out
    split = fp8 and k_new is not None
    if split:
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            assert t is not None and t.shape == (q.shape[0], kv_heads, head_dim), (
                f"{name}: [total_q, kv_heads, head_dim]"
            )
            assert t.dtype == q.dtype and t.stride(2) == 1 and t.stride(1) == head_dim, (
                f"{name}: q's dtype, heads and head_dim contiguous"
            )
        if prefix_dequant not in ("auto", "off"):
            raise ValueError(f"prefix_dequant={prefix_dequant!r}: use 'auto' or 'off'")
        if prefix_dequant == "auto" and prefix_plan is None:
            prefix_plan = plan_prefix_dequant(seq_lens, kv_heads, head_dim)
        if prefix_dequant == "auto" and prefix_plan is not None:
            kd, vd = dequant_prefix(
                k_cache, v_cache, k_scale, v_scale, k_new, v_new, page_table, seq_lens,
                qo_indptr, page_size, prefix_plan,
            )  # fmt: skip
            return extend_fwd(
                q, kd, vd, prefix_plan.table, seq_lens, qo_indptr, WORKSPACE_PAGE, sm_scale,
                out=out, max_qo_len=max_qo_len, block_m=block_m, block_n=block_n,
                num_warps=num_warps, num_stages=num_stages,
            )  # fmt: skip
    # fp8 with k_new here (no workspace): most keys are the new tokens' own 16-bit rows, so the
    # 16-bit tiling (fp8's is 1.5x slower there), at 128 rows: the two passes over new and
    # cached keys are not sized for 256
    rows = 0 if fp8 else max_qo_len * group
    keys = page_table.shape[1] * page_size  # a bound on seq_lens without reading them
    cfg = _config(head_dim, fp8 and k_new is None, on_cpu(q), rows, keys)
    block_m, block_n = block_m or cfg["block_m"], block_n or cfg["block_n"]
    ks, vs = (k_scale, v_scale) if fp8 else (k_cache, v_cache)  # unread placeholders
    if split:
        idx = torch.arange(q.shape[0] + block_n, dtype=torch.int32, device=q.device)
    else:
        k_new, v_new, idx = k_cache, v_cache, page_table  # unread placeholders
    grid = (triton.cdiv(max_qo_len * group, block_m), kv_heads, batch)
    extend_fwd_kernel[grid](
        q,
        k_in,
        v_in,
        ks,
        vs,
        page_table,
        seq_lens,
        qo_indptr,
        out,
        k_new,
        v_new,
        idx,
        sm_scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_in.stride(0),
        v_in.stride(0),
        kv_heads,
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        k_new.stride(0),
        v_new.stride(0),
        GROUP=group,
        PAGE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        FP8=fp8,
        KV_MODE=mode,
        DOT_F32=on_cpu(q),
        SPLIT=split,
        num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"],
    )
    return out
