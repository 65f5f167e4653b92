"""Remember which KV pool a P/D transfer manager's buffers belong to.

SGLang 0.5.23 hands a transfer backend's KV manager raw pointers (``KVArgs.kv_data_ptrs``), not
the pool; the atom backend describes each region from the live pool (dtype, heads, head dim,
page size, the fp8 scale buffers hung off it). Prefill and decode both collect those pointers
through ``disaggregation/utils.get_kv_transfer_buf_infos(pool)``; an AFTER hook records the pool
under its first pointer for :func:`pool_for`. Nothing else changes: the result is returned
as is. Ledger: ``sgl_atom.patches.LEDGER``.
"""

from __future__ import annotations

import weakref
from typing import Any

from . import register_once

TARGET = "sglang.srt.disaggregation.utils.get_kv_transfer_buf_infos"

_POOLS: dict[int, weakref.ref] = {}


def pool_for(first_ptr: int) -> Any | None:
    """The pool whose transfer buffers start at ``first_ptr``, if it is still alive."""
    ref = _POOLS.get(first_ptr)
    return ref() if ref is not None else None


def record_pool(result: Any, pool: Any, *a: Any, **kw: Any) -> None:
    """AFTER hook: ``result`` is (ptrs, lens, item_lens); key the pool by ptrs[0]."""
    ptrs = result[0] if isinstance(result, tuple | list) and result else None
    if ptrs:
        _POOLS[int(ptrs[0])] = weakref.ref(pool)


def install() -> None:
    register_once(TARGET, record_pool, "after")
