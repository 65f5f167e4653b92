"""sgl_atom's per-pool state: one place, shared by every reader of a pool, gone with the pool."""

from __future__ import annotations

import gc

from sgl_atom import pool_state


class _Pool:  # SGLang's pools are plain objects with a __dict__
    pass


def test_state_is_created_once_and_shared():
    pool = _Pool()
    assert pool_state.peek(pool).kv_scales is None and not pool.__dict__  # peek creates nothing
    pool_state.state_of(pool).kv_scales = "scales"
    pool_state.state_of(pool).index_cache = "index"
    assert pool_state.peek(pool).kv_scales == "scales"
    assert pool_state.peek(pool).index_cache == "index"
    assert pool_state.peek(_Pool()).kv_scales is None  # another pool has its own


def test_transfer_lookup_finds_live_pools_only():
    a, b = _Pool(), _Pool()
    pool_state.record_transfer_pool(a, 1000)
    pool_state.record_transfer_pool(b, 2000)
    pool_state.record_transfer_pool(a, 1000)  # again: no second entry
    assert pool_state.pool_with_transfer_buffer(1000) is a
    assert pool_state.pool_with_transfer_buffer(2000) is b
    assert pool_state.pool_with_transfer_buffer(3000) is None
    del b
    gc.collect()
    assert pool_state.pool_with_transfer_buffer(2000) is None
    assert sum(ref() is a for ref in pool_state._TRANSFER_POOLS) == 1
