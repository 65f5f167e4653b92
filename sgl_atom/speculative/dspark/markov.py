"""The DSpark low-rank Markov head: left-to-right greedy refinement of a drafted block.

One draft pass gives base logits U_j for every block position j at once. The Markov head then
walks the block left to right, biasing each position by the token chosen just before it:

    logits_j = U_j + W1[x_{j-1}] @ W2^T,    x_j = argmax(logits_j),    x_{-1} = anchor

W1 and W2 are both [vocab, rank] (checkpoint names ``markov_head.markov_w1.weight``, an
embedding, and ``markov_head.markov_w2.weight``, a rank -> vocab linear). A draft served with
fp8 weights keeps W2 as e4m3fn rows with one float32 scale per vocabulary row (``w2_scale``):
each position of the walk reads W2 whole, so at a small batch it is much of what a step reads.
The walk is sequential over the k block positions and batched over requests. Sums run in
float32; ties go to the lowest token id (torch.argmax returns the first maximum).
"""

from __future__ import annotations

import torch

from sgl_atom import envs
from sgl_atom.kernels.draft_markov import markov_argmax


def markov_step_logits(
    base_logits: torch.Tensor,
    prev_tokens: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One position's refined logits.

    base_logits: [batch, vocab] any float dtype; prev_tokens: [batch] int;
    w1, w2: [vocab, rank]; w2_scale: [vocab] float32 when w2 is e4m3fn rows (or those rows
    widened to float32). Returns float32 [batch, vocab].
    """
    rows = w1[prev_tokens.long()]
    if w2_scale is not None:  # e4m3 values are exact in float32; the row scales after the sum
        bias = (rows.float() @ w2.float().T).mul_(w2_scale)
    elif _tensor_core_bias(rows, w2):
        # bf16/fp16 products are exact in float32: one GEMM that accumulates and writes float32
        # reads w2 as stored, where `w2.float()` would write a float32 copy of the whole
        # [vocab, rank] head at every block position (131 MB for Llama-3's vocab at rank 256)
        bias = torch.mm(rows, w2.T, out_dtype=torch.float32)
    else:
        bias = rows.float() @ w2.float().T
    return bias.add_(base_logits)


# torch's mm takes out_dtype (float32 output of a bf16/fp16 GEMM) where this overload exists
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


def _tensor_core_bias(rows: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the bias GEMM can run in the weights' own half precision with float32 output
    (CUDA, matching bf16/fp16 dtypes, a torch with ``mm``'s ``out_dtype``)."""
    return (
        rows.is_cuda
        and rows.dtype in (torch.bfloat16, torch.float16)
        and w2.dtype == rows.dtype
        and _MM_OUT_DTYPE
    )


def fused_step(
    base_logits: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None = None,
) -> bool:
    """Whether a step runs as one fused kernel (``kernels/draft_markov``): CUDA, bf16/fp16
    heads of one dtype (or w2 as scaled e4m3fn rows), a vocabulary-contiguous base, and
    SGL_ATOM_DSPARK_FUSED_MARKOV on."""
    return (
        base_logits.is_cuda
        and w1.dtype in (torch.bfloat16, torch.float16)
        and (w2.dtype == w1.dtype if w2_scale is None else w2.dtype == torch.float8_e4m3fn)
        and base_logits.stride(-1) == 1
        and w1.stride(-1) == 1
        and w2.stride(-1) == 1
        and envs.SGL_ATOM_DSPARK_FUSED_MARKOV.get()
    )


def markov_refine(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    w2_scale: torch.Tensor | None = None,
    return_logits: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Greedy left-to-right refinement of a drafted block.

    base_logits: [batch, k, vocab] (float); anchor: [batch] int, the last committed token;
    w1, w2: [vocab, rank] with the same vocab as base_logits; w2_scale: [vocab] float32 when
    w2 is e4m3fn rows (``w2 * w2_scale[:, None]``).
    Returns the drafted tokens [batch, k] int64, and with ``return_logits`` also the refined
    float32 logits [batch, k, vocab].
    """
    _check(base_logits, anchor, w1, w2, w2_scale)
    batch, k, vocab = base_logits.shape
    tokens = torch.empty(batch, k, dtype=torch.int64, device=base_logits.device)
    if not return_logits and fused_step(base_logits, w1, w2, w2_scale):
        prev = anchor
        for j in range(k):
            prev = markov_argmax(base_logits[:, j], prev, w1, w2, tokens[:, j], w2_scale)
        return tokens
    logits = (
        torch.empty(batch, k, vocab, dtype=torch.float32, device=base_logits.device)
        if return_logits
        else None
    )
    if w2_scale is not None:  # e4m3 rows widened once for the walk, not at every position
        w2 = w2.float()
    prev = anchor.long()
    for j in range(k):
        step = markov_step_logits(base_logits[:, j], prev, w1, w2, w2_scale)
        prev = step.argmax(dim=-1)
        tokens[:, j] = prev
        if logits is not None:
            logits[:, j] = step
    return (tokens, logits) if return_logits else tokens


def _check(base_logits, anchor, w1, w2, w2_scale) -> None:
    if base_logits.dim() != 3:
        raise ValueError(f"base_logits must be [batch, k, vocab], got {tuple(base_logits.shape)}")
    batch, _, vocab = base_logits.shape
    if anchor.shape != (batch,):
        raise ValueError(f"anchor must be [batch={batch}], got {tuple(anchor.shape)}")
    if w1.dim() != 2 or w2.shape != w1.shape or w1.shape[0] != vocab:
        raise ValueError(
            f"markov_w1 and markov_w2 must both be [vocab={vocab}, rank], "
            f"got {tuple(w1.shape)} and {tuple(w2.shape)}"
        )
    if w2_scale is not None and (w2.dtype != torch.float8_e4m3fn or w2_scale.shape != (vocab,)):
        raise ValueError(
            f"a scaled markov_w2 must be float8_e4m3fn with one scale per row [vocab={vocab}], "
            f"got {w2.dtype} and scales {tuple(w2_scale.shape)}"
        )
