"""Visible vs attended 128-token blocks of one sparse layer step, summed on the device in one
launch (the atom backend's sparse-attention counters, read only to log).

A query at position p sees ``p // 128 + 1`` blocks per KV head; the new tokens of a sequence
of length L with q new tokens sit at L - q .. L - 1, so their visible blocks sum in closed form:
``F(L) - F(L - q)`` with ``F(n) = 128 * a * (a + 1) / 2 + r * (a + 1)``, ``n = 128 a + r``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import SPARSE_BLOCK


@triton.jit
def _blocks_before(n, SBLOCK: tl.constexpr):
    """Visible blocks summed over positions 0 .. n - 1 (int64)."""
    a = n // SBLOCK
    return SBLOCK * (a * (a + 1) // 2) + (n - a * SBLOCK) * (a + 1)


@triton.jit
def block_counts_kernel(
    SL,
    QO,
    CNT,
    OUT,
    batch,
    count_numel,
    KV_HEADS: tl.constexpr,
    SBLOCK: tl.constexpr,
    DECODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: OUT[0] += 1, OUT[1] += visible (token, head) blocks, OUT[2] += attended."""
    i = tl.arange(0, BLOCK)
    visible = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, batch, BLOCK):
        b = start + i
        ok = b < batch
        seq_len = tl.load(SL + b, mask=ok, other=0).to(tl.int64)
        if DECODE:
            qo_len = ok.to(tl.int64)
        else:
            qo_len = (tl.load(QO + b + 1, mask=ok, other=0) - tl.load(QO + b, mask=ok, other=0)).to(
                tl.int64
            )
        visible += _blocks_before(seq_len, SBLOCK) - _blocks_before(seq_len - qo_len, SBLOCK)
    attended = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, count_numel, BLOCK):
        j = start + i
        attended += tl.load(CNT + j, mask=j < count_numel, other=0).to(tl.int64)
    tl.store(OUT, tl.load(OUT) + 1)
    tl.store(OUT + 1, tl.load(OUT + 1) + tl.sum(visible, axis=0) * KV_HEADS)
    tl.store(OUT + 2, tl.load(OUT + 2) + tl.sum(attended, axis=0))


def block_counts(
    seq_lens: torch.Tensor,
    count: torch.Tensor,
    counters: torch.Tensor,
    qo_indptr: torch.Tensor | None = None,
) -> None:
    """Add one layer step to ``counters`` [3] int64: steps, visible and attended (token, KV head)
    blocks. seq_lens [batch] int32 (new tokens included); count [tokens, kv_heads] int32 (the
    selection's block counts, `select_blocks`); qo_indptr [batch + 1] int32, None for decode.
    No host sync: graph-capturable (padded graph rows count like the others)."""
    assert counters.dtype == torch.int64 and counters.numel() == 3 and counters.is_contiguous()
    assert count.is_contiguous() and count.dim() == 2
    batch = seq_lens.shape[0]
    block_counts_kernel[(1,)](
        seq_lens,
        seq_lens if qo_indptr is None else qo_indptr,
        count,
        counters,
        batch,
        count.numel(),
        KV_HEADS=count.shape[1],
        SBLOCK=SPARSE_BLOCK,
        DECODE=qo_indptr is None,
        BLOCK=max(16, min(1024, triton.next_power_of_2(max(batch, count.numel())))),
        num_warps=4,
    )


def reference_block_counts(
    seq_lens: torch.Tensor,
    count: torch.Tensor,
    counters: torch.Tensor,
    qo_indptr: torch.Tensor | None = None,
) -> None:
    """`block_counts` by enumerating every new token's position."""
    lens = seq_lens.to(torch.int64)
    if qo_indptr is None:
        pos = lens - 1
    else:
        qo = qo_indptr.to(torch.int64)
        per_seq = qo[1:] - qo[:-1]
        tokens = count.shape[0]  # qo_indptr[-1], known on the host
        starts = torch.repeat_interleave(lens - per_seq, per_seq, output_size=tokens)
        offs = torch.arange(tokens, device=lens.device) - torch.repeat_interleave(
            qo[:-1], per_seq, output_size=tokens
        )
        pos = starts + offs
    counters[0] += 1
    counters[1] += ((pos // SPARSE_BLOCK + 1) * count.shape[1]).sum()
    counters[2] += count.sum()
