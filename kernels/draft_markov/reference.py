"""float64 reference of one Markov head step (the test oracle of ``markov_argmax``)."""

from __future__ import annotations

import torch


def reference_markov_argmax(
    base: torch.Tensor,
    prev: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """base [batch, vocab], prev [batch] int, w1/w2 [vocab, rank] -> (tokens [batch] int64, the
    step's float64 logits [batch, vocab]): logits = base + w1[prev] @ w2^T, tokens their
    argmax, the lowest id among equal maxima. ``w2_scale`` [vocab]: w2 is e4m3fn rows standing
    for ``w2 * w2_scale[:, None]``."""
    w2 = w2.double() if w2_scale is None else w2.double() * w2_scale.double()[:, None]
    logits = base.double() + w1[prev.long()].double() @ w2.T
    return logits.argmax(dim=-1), logits
