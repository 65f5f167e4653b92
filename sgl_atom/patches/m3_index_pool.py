"""No second M3 index pool: SGLang's index-key pools are not allocated when atom serves.

``MiniMaxSparseKVPool`` builds index-key pools (``index_k_pool``/``index_kv_pool``) that only
SGLang's own MiniMax sparse backend reads. Inside a build that
:mod:`sgl_atom.patches.m3_index_pool_build` marked (sgl_atom's M3 model on the atom backend,
which keeps its own index cache), an AROUND hook on ``MiniMaxSparseKVPool.__init__`` passes index
pool classes that allocate nothing; the pool then holds None there, which SGLang's code already
handles (no index-K state for P/D, sizes of the present sub-pools only). The budget side, the
atom index cache priced in their place, is
:func:`sgl_atom.attention.m3_index_pool.price_atom_index_cache`. Every other build is upstream's.
Ledger: ``sgl_atom.patches.LEDGER``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import register_once

TARGET = "sglang.srt.mem_cache.memory_pool.MiniMaxSparseKVPool.__init__"


def pool_without_index_pools(original: Callable[..., Any], pool: Any, *a: Any, **kw: Any) -> Any:
    """AROUND hook: inside a marked build, the pool gets no index-key pools."""
    from ..attention.m3_index_pool import SKIP_SGLANG_INDEX_POOLS, no_index_pool

    if SKIP_SGLANG_INDEX_POOLS.get():
        kw["index_kv_pool_cls"] = no_index_pool
        kw["index_k_pool_cls"] = no_index_pool
    return original(pool, *a, **kw)


def install() -> None:
    register_once(TARGET, pool_without_index_pools, "around")
