"""float64 reference of one Markov head step (the test oracle of ``markov_argmax``)."""

from __future__ import annotations

import torch


def reference_markov_argmax(
    base: torch.Tensor, prev: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """base [batch, vocab], prev [batch] int, w1/w2 [vocab, rank] -> (tokens [batch] int64, the
    step's float64 logits [batch, vocab]): logits = base + w1[prev] @ w2^T, tokens their
    argmax, the lowest id among equal maxima."""
    logits = base.double() + w1[prev.long()].double() @ w2.double().T
    return logits.argmax(dim=-1), logits
