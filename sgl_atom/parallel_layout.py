"""How SGLang lays heads out over tensor-parallel ranks (pure Python: no SGLang, no torch).

Shared by the attention backend (which KV heads of a replicated M3 selection a rank keeps) and
the P/D transfer backend (which heads each side of a head cut holds).
"""

from __future__ import annotations


class LayoutError(ValueError):
    """Heads that do not divide over a TP size, or a rank outside its TP group."""


def heads_of_rank(total_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first global head, head count) a TP rank holds, as SGLang shards KV heads.

    total % tp == 0: a contiguous block of total/tp heads. tp % total == 0: one head replicated
    over tp/total consecutive ranks. Anything else has no even cut and is refused.
    """
    if not (0 <= tp_rank < tp_size):
        raise LayoutError(f"tp_rank {tp_rank} outside TP{tp_size}")
    if total_heads % tp_size == 0:
        per = total_heads // tp_size
        return tp_rank * per, per
    if tp_size % total_heads == 0:
        return tp_rank // (tp_size // total_heads), 1
    raise LayoutError(
        f"{total_heads} heads do not divide over TP{tp_size}: each rank must hold the same "
        f"number of whole heads (heads a multiple of TP, or TP a multiple of heads)"
    )
