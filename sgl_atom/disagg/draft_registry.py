"""Where a speculative worker's own draft KV pool is found by the atom transfer backend.

SGLang hands a P/D backend only the pools it manages itself; a draft that keeps its K/V in a
pool of its own (the ``ATOM_DSPARK`` worker's ``DraftKVPool``) registers it here when it
allocates it, and the backend's KV manager, created later in the same scheduler process, picks
it up and exports its regions after the target's. Pure Python: no SGLang, no torch.
"""

from __future__ import annotations

from typing import Any

_POOL: Any | None = None


def register_draft_pool(pool: Any) -> None:
    """Record this process's draft KV pool (lists ``k``, ``v``, ``k_scale``, ``v_scale``)."""
    global _POOL
    _POOL = pool


def draft_pool() -> Any | None:
    """The draft KV pool this process registered, or None when it serves no such draft."""
    return _POOL


def clear_draft_pool() -> None:
    global _POOL
    _POOL = None
