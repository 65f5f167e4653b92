"""KV pool budgets SGLang gets wrong for sgl_atom's features.

One AFTER hook on ``create_memory_pool_configurator`` calls the features that own the bytes, in
this order, each leaving the configurator alone when it does not apply:

1. the atom backend's fp8 KV scales (one fp32 per token, KV head and layer, for K and V) are
   priced into the target's bytes per token, so the pool still fits the memory budget
   (:func:`sgl_atom.attention.kv_scales.add_atom_fp8_scales`);
2. an EAGLE/STANDALONE draft's KV pool is priced at the draft's own dtype, not the target's
   (:func:`sgl_atom.speculative.draft_kv_pricing.reprice_draft`);
3. the ATOM_DSPARK draft's own pool (which SGLang does not know about) is priced at the settled
   draft dtype (:func:`sgl_atom.speculative.draft_kv_pricing.price_atom_dspark_draft`);
4. an M3 model served on the atom backend: its index cache in place of SGLang's index-key
   pools, which are not allocated
   (:func:`sgl_atom.attention.m3_index_pool.price_atom_index_cache`).

Ledger: ``sgl_atom.patches.LEDGER``.
"""

from __future__ import annotations

from typing import Any

from . import register_once

TARGET = "sglang.srt.model_executor.pool_configurator.create_memory_pool_configurator"


def price_sgl_atom_pools(configurator: Any, kvc: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook: each pricing adjusts the configurator in place (the result is unchanged)."""
    from ..attention.kv_scales import add_atom_fp8_scales
    from ..attention.m3_index_pool import price_atom_index_cache
    from ..speculative.draft_kv_pricing import price_atom_dspark_draft, reprice_draft

    prices = (add_atom_fp8_scales, reprice_draft, price_atom_dspark_draft, price_atom_index_cache)
    for price in prices:
        price(configurator, kvc, *args, **kwargs)


def install() -> None:
    register_once(TARGET, price_sgl_atom_pools, "after")
