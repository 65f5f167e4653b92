"""Greedy verification of a drafted block and the speculative-decoding counters.

The target reads [anchor, d_0 .. d_{k-1}] and predicts one token at each of those k + 1
positions: t_j is its greedy choice after d_{j-1} (after the anchor for j = 0). A draft token is
accepted while it equals the target's choice; the first mismatch stops the block, and the
target's own token there is committed too. So a step commits accepted + 1 tokens, all of them
the target's greedy choices: output with speculation equals output without.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch


class Acceptance(NamedTuple):
    """accepted: [batch] int64 draft tokens accepted (0..k);
    num_committed: [batch] int64 = accepted + 1;
    committed: [batch, k + 1] int64 target tokens, ``pad_id`` past num_committed;
    bonus: [batch] int64 the last committed token (the next anchor)."""

    accepted: torch.Tensor
    num_committed: torch.Tensor
    committed: torch.Tensor
    bonus: torch.Tensor


def greedy_accept(draft: torch.Tensor, target: torch.Tensor, *, pad_id: int = -1) -> Acceptance:
    """Accept the longest prefix of ``draft`` [batch, k] matching ``target`` [batch, k + 1]."""
    if draft.dim() != 2 or target.dim() != 2:
        raise ValueError(
            f"draft must be [batch, k] and target [batch, k + 1], got "
            f"{tuple(draft.shape)} and {tuple(target.shape)}"
        )
    batch, k = draft.shape
    if target.shape != (batch, k + 1):
        raise ValueError(
            f"target must be [batch={batch}, k + 1={k + 1}] (one greedy token per verify "
            f"position), got {tuple(target.shape)}"
        )
    target = target.long()
    match = draft.long() == target[:, :k]
    accepted = match.long().cumprod(dim=1).sum(dim=1)
    num_committed = accepted + 1
    cols = torch.arange(k + 1, device=target.device).unsqueeze(0)
    committed = torch.where(cols < num_committed.unsqueeze(1), target, pad_id)
    bonus = target.gather(1, accepted.unsqueeze(1)).squeeze(1)
    return Acceptance(accepted, num_committed, committed, bonus)


@dataclass
class SpecStats:
    """Running counters of one drafter. A step is one request verified once.

    acceptance rate = accepted / proposed (proposed = steps x k);
    tokens per forward = 1 + accepted / steps (what one target forward yields per request).
    """

    block_size: int
    steps: int = 0
    accepted: int = 0
    proposed: int = 0

    def update(self, accepted: torch.Tensor | Sequence[int]) -> None:
        """Count one verify of ``len(accepted)`` requests with these accepted draft counts."""
        counts = accepted.tolist() if isinstance(accepted, torch.Tensor) else list(accepted)
        if counts and (min(counts) < 0 or max(counts) > self.block_size):
            raise ValueError(f"accepted counts must lie in [0, k={self.block_size}], got {counts}")
        self.steps += len(counts)
        self.accepted += int(sum(counts))
        self.proposed += len(counts) * self.block_size

    def merge(self, other: SpecStats) -> None:
        if other.block_size != self.block_size:
            raise ValueError(f"cannot merge stats of k={other.block_size} into k={self.block_size}")
        self.steps += other.steps
        self.accepted += other.accepted
        self.proposed += other.proposed

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return 1.0 + self.accepted / self.steps if self.steps else 0.0

    def as_log_line(self) -> str:
        return (
            f"DSpark k={self.block_size}: steps {self.steps}, accepted "
            f"{self.accepted}/{self.proposed} ({100 * self.acceptance_rate:.1f}%), "
            f"tokens/forward {self.tokens_per_forward:.2f}"
        )

    def as_metrics(self) -> dict[str, float]:
        """Counters and ratios; ``spec_accept_length`` and ``spec_accept_rate`` carry SGLang's
        metric meanings (committed tokens per verify, accepted over proposed)."""
        return {
            "spec_steps": float(self.steps),
            "spec_accepted_tokens": float(self.accepted),
            "spec_proposed_tokens": float(self.proposed),
            "spec_accept_rate": self.acceptance_rate,
            "spec_accept_length": self.tokens_per_forward,
        }
