"""Remember which KV pool a P/D transfer manager's buffers belong to.

SGLang 0.5.23 hands a transfer backend's KV manager raw pointers (``KVArgs.kv_data_ptrs``), not
the pool; the atom backend describes each region from the live pool (dtype, heads, head dim,
page size, the fp8 scales and index cache in its :mod:`sgl_atom.pool_state`). Prefill and decode
both collect those pointers through ``disaggregation/utils.get_kv_transfer_buf_infos(pool)``; an
AFTER hook records the pool with its first pointer
(:func:`sgl_atom.pool_state.record_transfer_pool`), where the manager finds it
(:func:`sgl_atom.pool_state.pool_with_transfer_buffer`). Nothing else changes: the result is
returned as is. Ledger: ``sgl_atom.patches.LEDGER``.
"""

from __future__ import annotations

from typing import Any

from ..pool_state import record_transfer_pool
from . import register_once

TARGET = "sglang.srt.disaggregation.utils.get_kv_transfer_buf_infos"


def record_pool(result: Any, pool: Any, *a: Any, **kw: Any) -> None:
    """AFTER hook: ``result`` is (ptrs, lens, item_lens); the pool is found by ptrs[0]."""
    ptrs = result[0] if isinstance(result, tuple | list) and result else None
    if ptrs:
        record_transfer_pool(pool, int(ptrs[0]))


def install() -> None:
    register_once(TARGET, record_pool, "after")
