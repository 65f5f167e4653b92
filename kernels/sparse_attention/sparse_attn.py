"""Sparse attention over the selected 128-token blocks (decode, extend/prefill, target-verify).

One program per (token, KV head, split) attends the GQA group's query heads to its share of the
selected blocks; with several splits a reduce kernel merges the partials by log-sum-exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import f32_dot, is_fp8, next_pow2, num_sms
from ..paged_attention.common import (
    KV_MODES,
    OUT_BITS_SCALE,
    P_BITS_SCALE,
    Q_BITS_SCALE,
    QK_BITS_SCALE,
    fp8_bits,
    kv_mode_id,
)
from .reference import SPARSE_BLOCK

LOG2E = 1.4426950408889634


@triton.jit
def sparse_attn_fwd_kernel(
    Q,
    K,
    V,
    KS,
    VS,
    PT,
    SL,
    QO,
    SEL,
    CNT,
    OUT,
    OP,
    LSE,
    qk_scale,
    blocks_per_split,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_vt,
    stride_st,
    stride_pt,
    stride_selt,
    stride_ot,
    stride_oh,
    stride_opt,
    stride_oph,
    stride_lt,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    TOPK: tl.constexpr,
    PAGE: tl.constexpr,
    SBLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    FP8: tl.constexpr,
    BITS: tl.constexpr,
    DECODE: tl.constexpr,
    SPLIT: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    row = tl.program_id(0)
    b = tl.program_id(1)
    seq_len = tl.load(SL + b)
    if DECODE:
        q_start = b
        qo_len = 1
    else:
        q_start = tl.load(QO + b)
        qo_len = tl.load(QO + b + 1) - q_start
    tok = row // KV_HEADS
    kvh = row % KV_HEADS
    if tok < qo_len:
        t = (q_start + tok).to(tl.int64)
        pos = seq_len - qo_len + tok
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, HEAD_DIM)
        head = kvh * GROUP + h
        q = tl.load(
            Q + t * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=(h < GROUP)[:, None],
            other=0.0,
        )
        score_scale = qk_scale
        if FP8 and BITS:  # paged_attention.common KV_MODES "bits": K/V as bf16 bits, no cast
            q = (q.to(tl.float32) * Q_BITS_SCALE).to(tl.bfloat16)
            score_scale = qk_scale * QK_BITS_SCALE
        acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        sel_row = SEL + t * stride_selt + kvh * TOPK
        first = tl.program_id(2) * blocks_per_split
        last = tl.minimum(first + blocks_per_split, tl.load(CNT + t * KV_HEADS + kvh))
        TILES: tl.constexpr = SBLOCK // BLOCK_N
        for it in range(first * TILES, last * TILES):
            blk = tl.load(sel_row + it // TILES)
            p = blk * SBLOCK + (it % TILES) * BLOCK_N + tl.arange(0, BLOCK_N)
            p_ok = p <= pos
            page = tl.load(PT + b.to(tl.int64) * stride_pt + p // PAGE, mask=p_ok, other=0)
            slot = page.to(tl.int64) * PAGE + p % PAGE
            k = tl.load(
                K + slot[:, None] * stride_kt + kvh * HEAD_DIM + d[None, :],
                mask=p_ok[:, None],
                other=0.0,
            )
            if FP8 and BITS:
                k = fp8_bits(k, F32_DOT)
            if F32_DOT:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k.to(q.dtype)))
            if FP8:
                s = (
                    s
                    * (tl.load(KS + slot * stride_st + kvh, mask=p_ok, other=0.0) * score_scale)[
                        None, :
                    ]
                )
            else:
                s = s * qk_scale
            s = tl.where(p_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            pr = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            v = tl.load(
                V + slot[:, None] * stride_vt + kvh * HEAD_DIM + d[None, :],
                mask=p_ok[:, None],
                other=0.0,
            )
            vmax = 1.0
            if FP8:
                # v_scale over the tile's largest (paged_attention.common.attend_tile): the dot
                # operand cannot underflow fp16 nor overflow the bits mode's power of two
                vsc = tl.load(VS + slot * stride_st + kvh, mask=p_ok, other=0.0)
                vmax = tl.maximum(tl.max(vsc, 0), 1e-30)
                pr = pr * (vsc * (1.0 / vmax))[None, :]
                if BITS:
                    v = fp8_bits(v, F32_DOT)
                    pr = pr * P_BITS_SCALE
            if F32_DOT:
                pv = tl.dot(pr, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(pr.to(q.dtype), v.to(q.dtype))
            acc = acc * alpha[:, None] + pv * vmax
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        if FP8 and BITS:
            out = out * OUT_BITS_SCALE
        h_ok = (h < GROUP)[:, None]
        if SPLIT:
            split = tl.program_id(2)
            tl.store(
                OP + t * stride_opt + head[:, None] * stride_oph + split * HEAD_DIM + d[None, :],
                out,
                mask=h_ok,
            )
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
            tl.store(LSE + t * stride_lt + head * tl.num_programs(2) + split, lse, mask=h < GROUP)
        else:
            tl.store(
                OUT + t * stride_ot + head[:, None] * stride_oh + d[None, :],
                out.to(OUT.dtype.element_ty),
                mask=h_ok,
            )


@triton.jit
def sparse_attn_reduce_kernel(
    OP,
    LSE,
    OUT,
    num_splits,
    stride_opt,
    stride_oph,
    stride_lt,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HEAD_DIM)
    lse = tl.load(
        LSE + t * stride_lt + h * num_splits + s, mask=s < num_splits, other=float("-inf")
    )
    w = tl.exp2(lse - tl.max(lse, axis=0))
    part = tl.load(
        OP + t * stride_opt + h * stride_oph + s[:, None] * HEAD_DIM + d[None, :],
        mask=(s < num_splits)[:, None],
        other=0.0,
    )
    out = tl.sum(w[:, None] * part, axis=0) / tl.sum(w, axis=0)
    tl.store(OUT + t * stride_ot + h * stride_oh + d, out.to(OUT.dtype.element_ty))


def num_splits_for(rows: int, topk: int, sms: int) -> int:
    """Splits of the top-k list so rows × splits programs fill about two waves (1 when full)."""
    want = triton.cdiv(2 * sms, max(rows, 1))
    per = triton.cdiv(topk, max(1, min(topk, want)))
    return triton.cdiv(topk, per)


def _check(q, k_cache, v_cache, page_table, seq_lens, selected, count, k_scale, v_scale) -> bool:
    fp8 = is_fp8(k_cache.dtype)
    assert q.dim() == 3 and q.stride(2) == 1, (
        "q must be [tokens, q_heads, head_dim], head_dim contiguous"
    )
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape, (
        "k_cache, v_cache: [num_slots, kv_heads, head_dim] contiguous"
    )
    assert k_cache.shape[2] == q.shape[2] and q.shape[1] % k_cache.shape[1] == 0, (
        "head_dim / GQA mismatch"
    )
    assert fp8 or k_cache.dtype == q.dtype, "bf16 cache must match q's dtype"
    assert not fp8 or (
        k_scale is not None
        and v_scale is not None
        and k_scale.shape == k_cache.shape[:2]
        and k_scale.is_contiguous()
        and v_scale.is_contiguous()
    ), "fp8 needs k/v_scale [num_slots, kv_heads]"
    assert page_table.dtype == torch.int32 and page_table.stride(1) == 1, (
        "page_table: [batch, max_pages] int32"
    )
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == page_table.shape[:1], (
        "seq_lens: [batch] int32"
    )
    assert (
        selected.dtype == torch.int32
        and selected.is_contiguous()
        and selected.shape[:2] == (q.shape[0], k_cache.shape[1])
    )
    assert (
        count.dtype == torch.int32 and count.is_contiguous() and count.shape == selected.shape[:2]
    )
    return fp8


def sparse_attention_fwd(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    selected: torch.Tensor,
    count: torch.Tensor,
    page_size: int,
    sm_scale: float,
    qo_indptr: torch.Tensor | None = None,
    max_qo_len: int = 1,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    kv_mode: str | None = None,
) -> torch.Tensor:
    """Attention of each query token over its KV head's selected blocks only.

    q: [total_q, q_heads, head_dim] bf16/fp16/fp32 (decode: total_q = batch), head_dim a power of 2.
    k_cache, v_cache: [num_slots, kv_heads, head_dim] contiguous, q's dtype or float8_e4m3fn with
      k_scale, v_scale [num_slots, kv_heads] fp32. GQA: q head h reads KV head
      h // (q_heads / kv_heads).
    page_table: [batch, max_pages] int32; seq_lens: [batch] int32; page_size: tokens per page.
    selected, count: from `select_blocks` ([total_q, kv_heads, topk] ascending block ids then -1;
      [total_q, kv_heads]); only the first count[t, h] entries are read.
    qo_indptr, max_qo_len: as `select_blocks` (None/1 = decode; target-verify is extend with
      qo_len = draft tokens). Positions after the token's own are masked (causal in its block).
    out: [total_q, q_heads, head_dim] in q's dtype (allocated when None), written whole.
    num_splits: splits of the top-k list per (token, KV head) (default: fill the GPU);
    workspace: (partials [total_q, q_heads, num_splits, head_dim] fp32,
      lse [total_q, q_heads, num_splits] fp32), contiguous, for graph capture.
    block_n (divides 128), num_warps, num_stages: tuning. kv_mode (fp8): "bits" (the default for
      a bf16 q: K/V moved into bf16 bits, no conversion) or "bf16" (cast to q's dtype), as in
      `paged_attention.decode_fwd`.
    Returns out.
    """
    fp8 = _check(q, k_cache, v_cache, page_table, seq_lens, selected, count, k_scale, v_scale)
    mode = kv_mode_id(kv_mode, q) if fp8 else KV_MODES["bf16"]
    if mode not in (KV_MODES["bits"], KV_MODES["bf16"]):
        raise ValueError(f"sparse attention takes kv_mode 'bits' or 'bf16', got {kv_mode!r}")
    total_q, q_heads, head_dim = q.shape
    kv_heads, topk = k_cache.shape[1], selected.shape[2]
    group = q_heads // kv_heads
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.stride(2) == 1 and out.dtype == q.dtype
    if num_splits is None:
        num_splits = num_splits_for(total_q * kv_heads, topk, num_sms(q.device, cpu=4))
    per = triton.cdiv(topk, num_splits)
    block_n = block_n or (SPARSE_BLOCK if q.device.type == "cpu" else 64)
    split = num_splits > 1
    if split and workspace is None:
        workspace = (
            torch.empty(
                (total_q, q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
            ),
            torch.empty((total_q, q_heads, num_splits), dtype=torch.float32, device=q.device),
        )
    op, lse = workspace if split else (out, out)
    assert not split or (
        op.shape[2] == num_splits
        and lse.shape[2] == num_splits
        and op.is_contiguous()
        and lse.is_contiguous()
    )
    grid = (max_qo_len * kv_heads, seq_lens.shape[0], num_splits)
    sparse_attn_fwd_kernel[grid](
        q,
        k_cache,
        v_cache,
        k_scale if fp8 else k_cache,
        v_scale if fp8 else v_cache,
        page_table,
        seq_lens,
        seq_lens if qo_indptr is None else qo_indptr,
        selected,
        count,
        out,
        op,
        lse,
        sm_scale * LOG2E,
        per,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        v_cache.stride(0),
        kv_heads,
        page_table.stride(0),
        selected.stride(0),
        out.stride(0),
        out.stride(1),
        op.stride(0),
        op.stride(1),
        lse.stride(0),
        KV_HEADS=kv_heads,
        GROUP=group,
        TOPK=topk,
        PAGE=page_size,
        SBLOCK=SPARSE_BLOCK,
        BLOCK_H=max(16, next_pow2(group)),
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        FP8=fp8,
        BITS=mode == KV_MODES["bits"],
        DECODE=qo_indptr is None,
        SPLIT=split,
        F32_DOT=f32_dot(q),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split:
        sparse_attn_reduce_kernel[(total_q, q_heads)](
            op,
            lse,
            out,
            num_splits,
            op.stride(0),
            op.stride(1),
            lse.stride(0),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_S=next_pow2(num_splits),
            num_warps=4,
        )
    return out
