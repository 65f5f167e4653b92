"""Block scoring and top-k block selection (MiniMax-M3 "max" score over 128-token blocks).

Two launches: `block_score_kernel` writes one score per (token, KV head, block) into a
[total_q, kv_heads, max_blocks] fp32 buffer; `topk_select_kernel` picks each row's blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import f32_dot, is_fp8, is_int4, next_pow2, num_sms, scaled_index
from .reference import SPARSE_BLOCK


@triton.jit
def block_score_kernel(
    IQ,
    IK,
    IKS,
    PT,
    SL,
    QO,
    S,
    scale,
    nb,
    stride_iqt,
    stride_pt,
    stride_st,
    stride_sh,
    KV_HEADS: tl.constexpr,
    INDEX_DIM: tl.constexpr,
    ROW_W: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    SBLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DECODE: tl.constexpr,
    SCALED: tl.constexpr,
    INT4: tl.constexpr,
    F32_DOT: tl.constexpr,
    F16_DOT: tl.constexpr,
    I8_DOT: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Program (run of `nb` blocks, row tile, sequence): rows are (token, KV head) pairs of one
    sequence; the blocks are a loop pipelined `STAGES` deep.

    SCALED: the keys carry a per-token fp32 scale (fp8, or INT4: packed 4-bit keys, ROW_W = half
    the index dim per row; the scores are the two halves' dots summed).
    INT4: q is rounded per row to 8-bit integers on the power-of-two step that puts its largest
    element in [64, 128) (the reference's `int4_query`), and the integers are dotted exactly, so
    every path gives the same scores: fp16 dots with the nibbles made fp16 (nibble - 8,
    `_nibbles_to_f16_asm`; products and sums are integers below 2^24); with I8_DOT integer MMAs
    over the nibbles as stored (q + 8, one shift and mask per four keys, `_nibbles_asm`) less
    8 * sum(q); under the interpreter (F32_DOT) fp32 dots.
    F16_DOT (fp8 cache, 16-bit q): the keys become fp16 (e4m3: one instruction per pair; bf16
    would take several) and q is multiplied by a power of two per row so that its largest
    element lies in [2^14, 2^15) before rounding to fp16, which is then exact for bf16 q (8-bit
    significand in fp16's 11) down to 2^-28 of the row's largest element; the dot's fp32 result
    is scaled back."""
    blk0 = tl.program_id(0) * nb
    b = tl.program_id(2)
    seq_len = tl.load(SL + b)
    if DECODE:
        q_start = b
        qo_len = 1
    else:
        q_start = tl.load(QO + b)
        qo_len = tl.load(QO + b + 1) - q_start
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // KV_HEADS
    row_ok = tok < qo_len
    pos = seq_len - qo_len + tok
    max_pos = (
        seq_len
        - qo_len
        + tl.minimum(tl.program_id(1) * BLOCK_M + BLOCK_M - 1, qo_len * KV_HEADS - 1) // KV_HEADS
    )
    if (tl.program_id(1) * BLOCK_M < qo_len * KV_HEADS) & (blk0 * SBLOCK <= max_pos):
        # a packed 4-bit cache: ROW_W is half the index dim; q is read as its two halves
        d = tl.arange(0, BLOCK_D)
        d_ok = d < ROW_W
        iq_rows = (q_start + tok).to(tl.int64) * stride_iqt + (rows % KV_HEADS) * INDEX_DIM
        q_ptr = IQ + iq_rows[:, None] + d[None, :]
        q_mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptr, mask=q_mask, other=0.0)
        q_max = tl.max(tl.abs(q.to(tl.float32)), axis=1)
        if INT4:
            q2 = tl.load(q_ptr + ROW_W, mask=q_mask, other=0.0)
            q_max = tl.maximum(q_max, tl.max(tl.abs(q2.to(tl.float32)), axis=1))
        ebits = (q_max.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent of the max
        if INT4:  # q as 8-bit integers on a power-of-two step: the row max in [64, 128)
            ebits = tl.minimum(tl.maximum(ebits, 7), 254)
            up = ((260 - ebits) << 23).to(tl.float32, bitcast=True)[:, None]
            q = tl.minimum(tl.floor(q.to(tl.float32) * up + 0.5), 127.0)
            q2 = tl.minimum(tl.floor(q2.to(tl.float32) * up + 0.5), 127.0)
            row_scale = ((ebits - 6) << 23).to(tl.float32, bitcast=True) * scale
            if I8_DOT:  # the nibbles enter the dot as q + 8: 8 * sum(q) comes off
                q = q.to(tl.int8)
                q2 = q2.to(tl.int8)
                corr = 8 * (tl.sum(q.to(tl.int32), axis=1) + tl.sum(q2.to(tl.int32), axis=1))
            elif not F32_DOT:
                q = q.to(tl.float16)
                q2 = q2.to(tl.float16)
        elif F16_DOT:
            ebits = tl.minimum(tl.maximum(ebits, 15), 254)
            up = ((268 - ebits) << 23).to(tl.float32, bitcast=True)[:, None]
            q = (q.to(tl.float32) * up).to(tl.float16)
            row_scale = ((ebits - 14) << 23).to(tl.float32, bitcast=True) * scale
        else:
            row_scale = tl.full([BLOCK_M], 1.0, tl.float32) * scale
        if F32_DOT:  # (4-bit: already fp32 integers)
            q = q.to(tl.float32)
        out = S + (q_start + tok).to(tl.int64) * stride_st + (rows % KV_HEADS) * stride_sh
        nblk = tl.minimum(nb, max_pos // SBLOCK + 1 - blk0)
        pt_row = PT + b.to(tl.int64) * stride_pt
        for i in tl.range(0, nblk, num_stages=STAGES):
            blk = blk0 + i
            p = blk * SBLOCK + tl.arange(0, SBLOCK)
            p_ok = p <= max_pos
            if PAGE % SBLOCK == 0:  # one page holds the whole block: one page-table read
                page = tl.load(pt_row + (blk * SBLOCK) // PAGE)
                slot = page.to(tl.int64) * PAGE + (blk * SBLOCK) % PAGE + tl.arange(0, SBLOCK)
            else:
                page = tl.load(pt_row + p // PAGE, mask=p_ok, other=0)
                slot = page.to(tl.int64) * PAGE + p % PAGE
            k = tl.load(
                IK + slot[:, None] * ROW_W + d[None, :],
                mask=p_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            if INT4:  # dims [0, half) from the low nibbles, [half, dim) from the high ones
                if F32_DOT:  # the interpreter: nibble - 8 as fp32, exact integer dots
                    b32 = k.to(tl.int32)
                    k_lo = ((b32 & 15) - 8).to(tl.float32)
                    k_hi = ((b32 >> 4) - 8).to(tl.float32)
                    s = tl.dot(q, tl.trans(k_lo), input_precision="ieee")
                    s += tl.dot(q2, tl.trans(k_hi), input_precision="ieee")
                elif I8_DOT:  # integer dots over the nibbles as they are (q + 8), exact in int32
                    acc = tl.dot(q, tl.trans(_nibbles_asm(k, "0")), out_dtype=tl.int32)
                    acc = tl.dot(q2, tl.trans(_nibbles_asm(k, "4")), acc, out_dtype=tl.int32)
                    s = (acc - corr[:, None]).to(tl.float32)
                else:  # fp16 dots of the same integers (nibble - 8), exact in fp32
                    s = tl.dot(q, tl.trans(_nibbles_to_f16_asm(k, "0")))
                    s += tl.dot(q2, tl.trans(_nibbles_to_f16_asm(k, "4")))
            else:
                k = k.to(q.dtype)  # fp32 (F32_DOT), fp16 (F16_DOT) or q's 16-bit type
                if F32_DOT:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
            if SCALED:
                s = s * tl.load(IKS + slot, mask=p_ok, other=0.0)[None, :]
            s = tl.where(p[None, :] <= pos[:, None], s, float("-inf"))
            m = tl.max(s, axis=1) * row_scale  # row_scale > 0: after the max, once per row
            tl.store(out + blk, m, mask=row_ok & (blk * SBLOCK <= pos))


# four key bytes in, four int8 out: each byte's low (SHIFT "0") or high ("4") nibble, as it is
# stored (q + 8, in [1, 15]); one 32-bit shift and mask per four keys, where Triton's own uint8
# operations would take each byte apart
@triton.jit
def _nibbles_asm(k, SHIFT: tl.constexpr):
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t;
        shr.b32 t, $1, """
        + SHIFT
        + """;
        and.b32 $0, t, 0x0F0F0F0F;
        }
        """,
        constraints="=r,r",
        args=[k],
        dtype=tl.int8,
        is_pure=True,
        pack=4,
    )


# four bytes in, two fp16x2 words out: each byte's nibble (SHIFT "0": low, "4": high) becomes the
# low byte of a half whose high byte is 0x64 (prmt), i.e. the fp16 1024 + nibble, and 1032 is
# taken off (sub.f16x2): nibble - 8, exactly. Five integer/half2 operations per four keys, where
# Triton's own uint8 -> fp16 conversion is one slow I2F per key.
@triton.jit
def _nibbles_to_f16_asm(k, SHIFT: tl.constexpr):
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t, c;
        shr.b32 t, $2, """
        + SHIFT
        + """;
        and.b32 t, t, 0x0F0F0F0F;
        mov.b32 c, 0x64086408;
        prmt.b32 $0, t, 0x64646464, 0x5140;
        prmt.b32 $1, t, 0x64646464, 0x7362;
        sub.rn.f16x2 $0, $0, c;
        sub.rn.f16x2 $1, $1, c;
        }
        """,
        constraints="=r,=r,r",
        args=[k],
        dtype=tl.float16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def topk_select_kernel(
    S,
    SEL,
    CNT,
    SL,
    QO,
    stride_st,
    stride_sh,
    stride_selt,
    stride_selh,
    KV_HEADS: tl.constexpr,
    TOPK: tl.constexpr,
    INIT: tl.constexpr,
    LOCAL: tl.constexpr,
    SBLOCK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DECODE: tl.constexpr,
):
    """Program (row = token * KV_HEADS + head, sequence): TOPK argmax rounds, ties to lower;
    none where the token sees at most TOPK blocks (BLOCK_B covers the captured context, so a
    short sequence in a long-context server would otherwise pay the full rounds)."""
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
    if tok < qo_len:
        t = (q_start + tok).to(tl.int64)
        nvis = (seq_len - qo_len + tok) // SBLOCK + 1
        j = tl.arange(0, BLOCK_B)
        vis = j < nvis
        x = tl.load(
            S + t * stride_st + (row % KV_HEADS) * stride_sh + j, mask=vis, other=float("-inf")
        )
        if nvis <= TOPK:  # every visible block is kept: no rounds (short contexts)
            sel = vis
        else:
            forced = vis & ((j < INIT) | (j >= nvis - LOCAL))
            x = tl.where(forced, float("inf"), tl.where(vis, x, float("-inf")))
            sel = j < 0
            for _ in range(TOPK):
                best = tl.argmax(x, axis=0, tie_break_left=True)
                hit = (j == best) & (x > float("-inf"))  # x[best] is the max: -inf once taken
                sel = sel | hit
                x = tl.where(j == best, float("-inf"), x)
        rank = tl.cumsum(sel.to(tl.int32), axis=0) - 1
        out = SEL + t * stride_selt + (row % KV_HEADS) * stride_selh
        tl.store(out + rank, j, mask=sel)
        cnt = tl.sum(sel.to(tl.int32), axis=0)
        k = tl.arange(0, BLOCK_K)
        tl.store(out + k, tl.full([BLOCK_K], -1, tl.int32), mask=(k >= cnt) & (k < TOPK))
        tl.store(CNT + t * KV_HEADS + row % KV_HEADS, cnt)


# Scoring kernel (pipeline stages, warps, fp16 dots for an fp8 cache): H200 sweep in
# benchmarks/results/tune_sparse_scoring.log.
SCORE_CONFIG = (2, 4, True)
# The dots of a 4-bit cache on a GPU: "i8" (integer MMAs over the nibbles as stored) or "f16"
# (the nibbles made fp16); the same scores. H200, batch 64 x 128K: scoring 0.164 ms against
# 0.233 (benchmarks/results/sparse_attention.md). Read at each launch.
INT4_DOT = "i8"


def blocks_per_program_for(
    max_blocks: int, rows: int, device: torch.device, int8_dots: bool = False
) -> int:
    """128-token blocks per scoring program: a pipelined run (4 blocks, 8 for a 4-bit cache
    scored by integer MMAs) once there are at least 256 (block, row tile) pairs per SM, else 1
    (smaller problems need every program they can get). H200, fp8 cache: 4 is 12% faster than 1
    at batch 64 x 128K; at batch 16 x 128K and 64 x 32K the choices lie within 3%; 1 is best at
    batch 1-4 (tune_sparse_scoring.log). 4-bit cache, integer MMAs, batch 64 x 128K: 8 blocks
    select in 0.175 ms against 0.188 for 4 and 0.215 for 2 (sparse_attention_int4.log)."""
    if max_blocks * rows < 256 * num_sms(device, cpu=4):
        return 1
    return 8 if int8_dots else 4


def _check(
    index_q,
    index_cache,
    page_table,
    seq_lens,
    qo_indptr,
    index_scale,
    topk,
    init_blocks,
    local_blocks,
):
    assert (
        index_q.dim() == 3 and index_q.stride(2) == 1 and index_q.stride(1) == index_q.shape[2]
    ), "index_q must be [tokens, kv_heads, index_dim] with contiguous (head, dim)"
    per_byte = 2 if is_int4(index_cache.dtype) else 1  # dims per cache element
    width = index_q.shape[2] // per_byte
    assert (
        index_cache.is_contiguous()
        and index_cache.dim() == 2
        and index_cache.shape[1] * per_byte == index_q.shape[2]
    ), f"index_cache must be [num_slots, {width}] contiguous"
    assert page_table.dtype == torch.int32 and page_table.stride(1) == 1, (
        "page_table: [batch, max_pages] int32"
    )
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == page_table.shape[:1], (
        "seq_lens: [batch] int32"
    )
    assert qo_indptr is None or (
        qo_indptr.dtype == torch.int32 and qo_indptr.numel() == seq_lens.numel() + 1
    )
    assert not scaled_index(index_cache.dtype) or (
        index_scale is not None and index_scale.dtype == torch.float32
    ), "fp8 and 4-bit index caches need index_scale [num_slots] fp32"
    if init_blocks + local_blocks > topk or min(init_blocks, local_blocks) < 0 or topk < 1:
        raise ValueError(
            f"sparse_init_block {init_blocks} + sparse_local_block {local_blocks} must be "
            f"non-negative and at most sparse_topk_blocks {topk}"
        )


def block_scores(
    index_q: torch.Tensor,
    index_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    qo_indptr: torch.Tensor | None = None,
    max_qo_len: int = 1,
    max_seq_len: int | None = None,
    index_scale: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
    blocks_per_program: int | None = None,
    config: tuple[int, int, bool] | None = None,
    block_m: int | None = None,
) -> torch.Tensor:
    """Scores [total_q, kv_heads, max_blocks] fp32 (max_blocks = cdiv(max_seq_len, 128)); entries
    of blocks a token cannot see are left unwritten. Arguments as `select_blocks`; `config`:
    (pipeline stages, num_warps, fp16 dots for an fp8 cache) of the scoring kernel, default
    `SCORE_CONFIG`; `block_m`: (token, KV head) rows per program, a power of two >= 16 (default:
    the batch's rows per sequence, 16 to 64)."""
    _check(index_q, index_cache, page_table, seq_lens, qo_indptr, index_scale, 1, 0, 0)
    if not scale > 0:  # the kernel scales each row's max, not each score
        raise ValueError(f"block_scores: scale must be positive, got {scale}")
    if INT4_DOT not in ("f16", "i8"):
        raise ValueError(f"block_select.INT4_DOT is {INT4_DOT!r}; give 'f16' or 'i8'")
    total_q, kv_heads, index_dim = index_q.shape
    max_seq_len = page_table.shape[1] * page_size if max_seq_len is None else max_seq_len
    max_blocks = triton.cdiv(max_seq_len, SPARSE_BLOCK)
    if scores is None:
        scores = torch.empty(
            (total_q, kv_heads, max_blocks), dtype=torch.float32, device=index_q.device
        )
    assert (
        scores.shape[:2] == (total_q, kv_heads)
        and scores.shape[2] >= max_blocks
        and scores.stride(2) == 1
    )
    block_m = block_m or max(16, min(64, next_pow2(max_qo_len * kv_heads)))
    fp8, int4 = is_fp8(index_cache.dtype), is_int4(index_cache.dtype)
    scaled = scaled_index(index_cache.dtype)
    row_w = index_cache.shape[1]
    row_tiles = triton.cdiv(max_qo_len * kv_heads, block_m)
    i8_dot = int4 and not f32_dot(index_q) and INT4_DOT == "i8"
    nb = blocks_per_program or blocks_per_program_for(
        max_blocks, row_tiles * seq_lens.shape[0], index_q.device, i8_dot
    )
    stages, warps, f16 = config or SCORE_CONFIG
    grid = (triton.cdiv(max_blocks, nb), row_tiles, seq_lens.shape[0])
    block_score_kernel[grid](
        index_q,
        index_cache,
        index_scale if scaled else index_cache,
        page_table,
        seq_lens,
        seq_lens if qo_indptr is None else qo_indptr,
        scores,
        scale,
        nb,
        index_q.stride(0),
        page_table.stride(0),
        scores.stride(0),
        scores.stride(1),
        KV_HEADS=kv_heads,
        INDEX_DIM=index_dim,
        ROW_W=row_w,
        BLOCK_D=max(32, next_pow2(row_w)) if int4 else next_pow2(row_w),  # int8 MMA: k >= 32
        PAGE=page_size,
        SBLOCK=SPARSE_BLOCK,
        BLOCK_M=block_m,
        DECODE=qo_indptr is None,
        SCALED=scaled,
        INT4=int4,
        F32_DOT=f32_dot(index_q),
        F16_DOT=index_q.dtype != torch.float32 and f16 and fp8,
        I8_DOT=i8_dot,
        STAGES=stages,
        num_warps=warps,
    )
    return scores


def select_blocks(
    index_q: torch.Tensor,
    index_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    topk: int,
    init_blocks: int,
    local_blocks: int,
    qo_indptr: torch.Tensor | None = None,
    max_qo_len: int = 1,
    max_seq_len: int | None = None,
    index_scale: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    blocks_per_program: int | None = None,
    config: tuple[int, int, bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score every visible 128-token block and keep the top `topk` per (token, KV head).

    index_q: [total_q, kv_heads, index_dim] bf16/fp16/fp32 (decode: total_q = batch).
    index_cache: [num_slots, index_dim] bf16/fp16/fp32 or float8_e4m3fn, or packed 4-bit keys
      [num_slots, index_dim / 2] uint8 (`index_write`'s layout); index_scale: [num_slots] fp32
      (fp8 and 4-bit only). Block b of a sequence = positions [128b, 128b + 128) through page_table.
    page_table: [batch, max_pages] int32; seq_lens: [batch] int32 (new tokens included).
    page_size: 1, 16, 64 or 128 (any positive size works). scale: multiplies q·k (positive).
    qo_indptr: [batch + 1] int32 for extend/prefill/verify (new token i of b at position
      seq_len - qo_len + i); None for decode (one token per sequence, at seq_len - 1).
    max_qo_len: longest qo_len (1 for decode); max_seq_len: bound on seq_lens (default page
      table width × page_size) - both host ints, so no device sync and graph-capturable.
    topk, init_blocks, local_blocks: sparse_topk_blocks, sparse_init_block, sparse_local_block;
      blocks [0, init) and the last `local` visible blocks are always kept (init + local <= topk).
    scores: optional [total_q, kv_heads, >= max_blocks] fp32 workspace; out: optional
      (selected, count); blocks_per_program, config: scoring tuning (128-token blocks per
      program; `block_scores`' config).
    Returns selected [total_q, kv_heads, topk] int32 (ascending block ids, then -1 padding) and
    count [total_q, kv_heads] int32 = min(topk, visible blocks).
    """
    _check(
        index_q,
        index_cache,
        page_table,
        seq_lens,
        qo_indptr,
        index_scale,
        topk,
        init_blocks,
        local_blocks,
    )
    scores = block_scores(
        index_q,
        index_cache,
        page_table,
        seq_lens,
        page_size,
        scale,
        qo_indptr,
        max_qo_len,
        max_seq_len,
        index_scale,
        scores,
        blocks_per_program,
        config,
    )
    total_q, kv_heads = index_q.shape[:2]
    if out is None:
        out = (
            torch.empty((total_q, kv_heads, topk), dtype=torch.int32, device=index_q.device),
            torch.empty((total_q, kv_heads), dtype=torch.int32, device=index_q.device),
        )
    selected, count = out
    assert (
        selected.shape == (total_q, kv_heads, topk)
        and selected.stride(2) == 1
        and count.is_contiguous()
    )
    max_blocks = scores.shape[2]
    topk_select_kernel[(max_qo_len * kv_heads, seq_lens.shape[0])](
        scores,
        selected,
        count,
        seq_lens,
        seq_lens if qo_indptr is None else qo_indptr,
        scores.stride(0),
        scores.stride(1),
        selected.stride(0),
        selected.stride(1),
        KV_HEADS=kv_heads,
        TOPK=topk,
        INIT=init_blocks,
        LOCAL=local_blocks,
        SBLOCK=SPARSE_BLOCK,
        BLOCK_B=next_pow2(max_blocks),
        BLOCK_K=next_pow2(topk),
        DECODE=qo_indptr is None,
        num_warps=4 if max_blocks <= 2048 else 8,
    )
    return selected, count
