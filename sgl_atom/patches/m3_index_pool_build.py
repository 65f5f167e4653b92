"""Mark SGLang's M3 pool build when the atom backend serves the model's sparse layers.

An AROUND hook on ``KVCacheConfigurator._build_minimax_sparse_kv_pool`` sets
:data:`sgl_atom.attention.m3_index_pool.SKIP_SGLANG_INDEX_POOLS` for the build when sgl_atom's
M3 model serves its sparse layers on the atom backend (every sparse layer index-key-only,
HiSparse off: :func:`~sgl_atom.attention.m3_index_pool.skips_sglang_index_pools`), so that
:mod:`sgl_atom.patches.m3_index_pool` builds the pool without SGLang's index-key pools, which
only SGLang's own MiniMax sparse backend reads. Any other build runs as upstream.
Ledger: ``sgl_atom.patches.LEDGER``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..log import get_logger
from . import register_once

TARGET = (
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_minimax_sparse_kv_pool"
)
logger = get_logger("sgl_atom.patches")


def build_without_index_pools(original: Callable[..., Any], kvc: Any, *a: Any, **kw: Any) -> Any:
    """AROUND hook: mark the build when atom serves the model's sparse layers."""
    from ..attention.m3_index_pool import SKIP_SGLANG_INDEX_POOLS, skips_sglang_index_pools

    if skips_sglang_index_pools(kvc) is not None:
        return original(kvc, *a, **kw)
    token = SKIP_SGLANG_INDEX_POOLS.set(True)
    try:
        pool = original(kvc, *a, **kw)
    finally:
        SKIP_SGLANG_INDEX_POOLS.reset(token)
    logger.info(
        "M3 pool: SGLang's index-key pools are not allocated (the atom backend's index cache "
        "serves the sparse layers)"
    )
    return pool


def install() -> None:
    register_once(TARGET, build_without_index_pools, "around")
