"""sgl_atom's state that lives with one of SGLang's KV pools, owned here and nowhere else.

Features keep buffers beside an SGLang token pool, indexed by the pool's own slot ids: the atom
backend's fp8 scales (:class:`sgl_atom.attention.kv_scales.KVScales`), the M3 index cache
(:class:`sgl_atom.attention.sparse.IndexCache`), and the own KV pool of a speculative draft that
the P/D transfer backend moves with the target's
(:class:`sgl_atom.speculative.dspark.pool.DraftKVPool`).
They hang off the pool object in one :class:`PoolState` (the only attribute sgl_atom sets on a
pool, set and read only in this module), so every backend reading one pool shares them and they
go with the pool. The P/D backend, which SGLang hands raw buffer addresses rather than the pool,
finds a pool through :func:`pool_with_transfer_buffer`. Pure Python: no SGLang, no torch.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

_ATTR = "_sgl_atom_state"


@dataclass
class PoolState:
    kv_scales: Any | None = None  # attention.kv_scales.KVScales (fp8 KV on the atom backend)
    index_cache: Any | None = None  # attention.sparse.IndexCache (M3 sparse layers)
    draft_pool: Any | None = None  # a speculative draft's own pool, moved with this one by P/D
    transfer_ptr: int | None = None  # the first transfer buffer address SGLang gave P/D


def state_of(pool: Any) -> PoolState:
    """The pool's state, created empty on first use."""
    state = pool.__dict__.get(_ATTR)
    if state is None:
        state = PoolState()
        setattr(pool, _ATTR, state)
    return state


def peek(pool: Any) -> PoolState:
    """The pool's state without creating it on the pool (an empty one when there is none)."""
    return pool.__dict__.get(_ATTR) or PoolState()


# pools whose transfer buffers SGLang described for P/D in this process (weak: a freed pool
# drops out)
_TRANSFER_POOLS: list[weakref.ref] = []


def record_transfer_pool(pool: Any, first_ptr: int) -> None:
    """Remember that ``pool``'s P/D transfer buffers start at ``first_ptr``."""
    state_of(pool).transfer_ptr = int(first_ptr)
    if not any(ref() is pool for ref in _TRANSFER_POOLS):
        _TRANSFER_POOLS.append(weakref.ref(pool))


def pool_with_transfer_buffer(first_ptr: int) -> Any | None:
    """The live pool whose transfer buffers start at ``first_ptr``, if one was recorded."""
    _TRANSFER_POOLS[:] = [ref for ref in _TRANSFER_POOLS if ref() is not None]
    for ref in _TRANSFER_POOLS:
        pool = ref()
        if pool is not None and peek(pool).transfer_ptr == int(first_ptr):
            return pool
    return None
