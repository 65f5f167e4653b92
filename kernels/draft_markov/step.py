"""One step of the DSpark Markov head, fused: ``argmax(base + w1[prev] @ w2^T)`` per row.

The unfused step writes a float32 [batch, vocab] bias (a GEMM), adds the base logits into it
and reduces it with an argmax: three passes over a Llama-3-sized vocabulary per block position.
Here each program computes a [BLOCK_B, BLOCK_V] tile of the bias with tensor-core dots
(float32 accumulation; bf16/fp16 products are exact), adds the base logits and keeps the
tile's per-row maximum and its index; a second kernel picks each row's best tile. Only w2, the
base logits and [batch, vocab / BLOCK_V] partials are read or written. w2 may be e4m3fn rows
with one float32 scale per vocabulary row (a draft served with fp8 weights): its values widen
exactly to w1's dtype for the dot, the tile's sums are scaled per column, and a step reads half
the bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import FP8_DTYPE, f32_dot, next_pow2

BLOCK_V = 128  # vocabulary columns per program
BLOCK_R = 64  # rank slice per dot


@triton.jit
def markov_tile_kernel(
    base_ptr, prev_ptr, w1_ptr, w2_ptr, w2_scale_ptr, part_val_ptr, part_idx_ptr,
    batch, vocab, rank,
    stride_base, stride_w1, stride_w2, stride_part,
    BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, F32_DOT: tl.constexpr,
    W2_SCALED: tl.constexpr,
):  # fmt: skip
    pid_v = tl.program_id(0)
    pid_b = tl.program_id(1)
    rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < batch
    col_ok = cols < vocab
    prev = tl.load(prev_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    acc = tl.zeros((BLOCK_B, BLOCK_V), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < rank
        a = tl.load(
            w1_ptr + prev[:, None] * stride_w1 + r[None, :],
            mask=row_ok[:, None] & r_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            w2_ptr + cols[None, :].to(tl.int64) * stride_w2 + r[:, None],
            mask=r_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        if F32_DOT:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        elif W2_SCALED:  # e4m3 values are exact in bf16 / fp16
            acc += tl.dot(a, b.to(tl.float32).to(a.dtype))
        else:
            acc += tl.dot(a, b)
    if W2_SCALED:
        acc *= tl.load(w2_scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    base = tl.load(
        base_ptr + rows[:, None].to(tl.int64) * stride_base + cols[None, :],
        mask=row_ok[:, None] & col_ok[None, :],
        other=0.0,
    )
    logits = tl.where(col_ok[None, :], acc + base.to(tl.float32), float("-inf"))
    best = tl.max(logits, axis=1)
    at = tl.argmax(logits, axis=1, tie_break_left=True)
    out = rows.to(tl.int64) * stride_part + pid_v
    tl.store(part_val_ptr + out, best, mask=row_ok)
    tl.store(part_idx_ptr + out, pid_v * BLOCK_V + at, mask=row_ok)


@triton.jit
def markov_pick_kernel(
    part_val_ptr, part_idx_ptr, out_ptr, tiles, stride_part, stride_out, BLOCK_T: tl.constexpr
):
    row = tl.program_id(0)
    t = tl.arange(0, BLOCK_T)
    vals = tl.load(part_val_ptr + row * stride_part + t, mask=t < tiles, other=float("-inf"))
    best = tl.argmax(vals, axis=0, tie_break_left=True)  # the lowest tile: the lowest id
    idx = tl.load(part_idx_ptr + row * stride_part + best)
    tl.store(out_ptr + row * stride_out, idx.to(tl.int64))


def markov_argmax(
    base: torch.Tensor,
    prev: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One Markov head step: ``out[b] = argmax_v(base[b, v] + w1[prev[b]] . w2[v])``.

    base: [batch, vocab] float (bf16/fp16/fp32), rows may be strided (a column slice of
    [batch, k, vocab]), unit stride along the vocabulary; prev: [batch] int32/int64 token ids;
    w1, w2: [vocab, rank] bf16/fp16 (same dtype), unit stride along the rank; out: [batch]
    int64, may be strided (a column of the block's [batch, k] tokens), written whole. With
    ``w2_scale`` ([vocab] float32), w2 is float8_e4m3fn and stands for ``w2 * w2_scale[:, None]``.
    Sums are float32; among equal maxima the lowest id wins (as torch.argmax). Returns ``out``.
    """
    batch, vocab = base.shape
    assert prev.shape == (batch,) and prev.dtype in (torch.int32, torch.int64), prev.shape
    assert w1.shape == w2.shape and w1.shape[0] == vocab, (w1.shape, w2.shape, vocab)
    assert w1.dtype in (torch.bfloat16, torch.float16), w1.dtype
    if w2_scale is None:
        assert w2.dtype == w1.dtype, (w1.dtype, w2.dtype)
    else:
        assert w2.dtype == FP8_DTYPE, w2.dtype
        assert w2_scale.shape == (vocab,) and w2_scale.dtype == torch.float32, w2_scale.shape
        w2_scale = w2_scale.contiguous()
    assert base.stride(1) == 1 and w1.stride(1) == 1 and w2.stride(1) == 1
    assert out.shape == (batch,) and out.dtype == torch.int64, (out.shape, out.dtype)
    rank = w1.shape[1]
    if batch == 0:
        return out
    prev = prev.contiguous()
    block_b = min(64, max(16, next_pow2(batch)))
    tiles = triton.cdiv(vocab, BLOCK_V)
    part_val = torch.empty(batch, tiles, dtype=torch.float32, device=base.device)
    part_idx = torch.empty(batch, tiles, dtype=torch.int32, device=base.device)
    markov_tile_kernel[(tiles, triton.cdiv(batch, block_b))](
        base, prev, w1, w2, w2 if w2_scale is None else w2_scale, part_val, part_idx,
        batch, vocab, rank,
        base.stride(0), w1.stride(0), w2.stride(0), part_val.stride(0),
        BLOCK_B=block_b, BLOCK_V=BLOCK_V, BLOCK_R=BLOCK_R, F32_DOT=f32_dot(w1),
        W2_SCALED=w2_scale is not None,
        num_warps=4, num_stages=3,
    )  # fmt: skip
    markov_pick_kernel[(batch,)](
        part_val, part_idx, out, tiles, part_val.stride(0), out.stride(0),
        BLOCK_T=next_pow2(tiles), num_warps=4,
    )  # fmt: skip
    return out
