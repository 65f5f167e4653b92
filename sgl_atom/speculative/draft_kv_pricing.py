"""SGLang glue: a speculative draft's KV pool priced at the draft's own dtype.

Two pricings, called by the AFTER hook on ``create_memory_pool_configurator``
(``sgl_atom.patches.pool_budget``), both reading the settled dtype
(``server_args._sgl_atom_draft_kv``, :mod:`sgl_atom.speculative.draft_kv_resolution`):

* :func:`reprice_draft`: SGLang 0.5.23's ``DefaultPoolConfigurator`` reserves an
  EAGLE/STANDALONE draft's layers at the TARGET's bytes per token, whatever
  ``speculative_draft_kv_cache_dtype`` says, so an fp8 draft under a bf16 target is
  over-reserved (fewer KV tokens than fit) and a bf16 draft under an fp8 target is
  under-reserved. The draft term is re-priced at the settled dtype. DFLASH/DSPARK drafts are
  already priced at their dtype upstream.
* :func:`price_atom_dspark_draft`: the ATOM_DSPARK draft's own pool (which SGLang does not know
  about) is added at the settled dtype, so the target pool shrinks by exactly what it takes.

Both log the draft pool's bytes and the token capacity gained once the pool is sized. The
arithmetic is :mod:`sgl_atom.speculative.draft_kv_budget`.
"""

from __future__ import annotations

from ..attention.kv_scales import target_layers
from ..log import get_logger
from .draft_kv_budget import budget_line, draft_budget, kv_bytes_per_token

logger = get_logger("sgl_atom.speculative")


def _upstream_skips(kvc) -> str | None:
    """Why this pool keeps SGLang's budget (None when the hook re-prices it)."""
    from sglang.srt.configs.model_config import is_deepseek_dsa
    from sglang.srt.runtime_context import get_memory

    if not kvc.spec_aux_config.eagle_draft_num_layers:
        return "no draft layers reserved"
    if kvc.fused_entry_bytes("full") is not None:
        return "the draft is fused into the target's pool entries"
    if kvc.use_mla_backend or is_deepseek_dsa(kvc.model_config.hf_config):
        return "MLA/DSA target"
    if get_memory().enable_hisparse:
        return "HiSparse"
    return None


def _draft_bytes_per_token(kvc, dtype: str) -> int:
    mc = kvc.spec_aux_config.draft_model_config or kvc.model_config
    try:
        tp = kvc.draft_attn_tp_size
    except Exception:  # noqa: BLE001 - no draft layout published: the target's attention TP
        from sglang.srt.runtime_context import get_parallel

        tp = get_parallel().attn_tp_size
    return kv_bytes_per_token(
        dtype,
        kv_heads=mc.get_num_kv_heads(tp),
        head_dim=mc.head_dim,
        v_head_dim=mc.v_head_dim,
        layers=int(kvc.spec_aux_config.eagle_draft_num_layers),
    )


def reprice_draft(configurator, kvc, *args, **kwargs):
    """The draft term of the configurator's cell size at the draft's own dtype."""
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator

    dk = getattr(kvc.server_args, "_sgl_atom_draft_kv", None)
    algo = kvc.spec_algorithm
    if dk is None or not dk.differs or kvc.is_draft_worker:
        return None
    if not (algo.is_eagle() or algo.is_standalone()):
        return None
    why = _upstream_skips(kvc)
    if why is None and type(configurator) is not DefaultPoolConfigurator:
        why = f"{type(configurator).__name__} pools"
    if why is not None:
        logger.warning("draft KV pool budgeted at the target's dtype (%s): %s", dk.target, why)
        return None
    target_cell = configurator._compute_cell_size(kvc, target_layers(kvc))
    upstream_draft = configurator._cell_size - target_cell
    if upstream_draft <= 0:
        return None
    draft_cell = _draft_bytes_per_token(kvc, dk.settled)
    configurator._cell_size = target_cell + draft_cell
    _log_when_sized(configurator, target_cell, draft_cell, upstream_draft, dk)
    return configurator


def _log_when_sized(configurator, target_cell, draft_cell, upstream_draft, dk) -> None:
    sizes = configurator.calculate_pool_sizes

    def calculate_pool_sizes(available_bytes: int, page_size: int):
        config = sizes(available_bytes, page_size)
        budget = draft_budget(
            available_bytes - configurator._fixed_overhead_bytes,
            target_cell=target_cell,
            draft_cell=draft_cell,
            upstream_draft_cell=upstream_draft,
            page_size=page_size,
        )
        logger.info(budget_line(budget, dk.settled, dk.target, _token_cap()))
        return config

    configurator.calculate_pool_sizes = calculate_pool_sizes


def _token_cap() -> int | None:
    """``--max-total-tokens`` when set (the pool is capped there after the budget)."""
    try:
        from sglang.srt.runtime_context import get_schedule

        return get_schedule().max_total_tokens or None
    except Exception:  # noqa: BLE001 - no schedule context (unit tests): no cap to report
        return None


def _atom_dspark_cell(kvc, dtype: str) -> int:
    import json
    import os

    from .dspark.config import DSparkDraftConfig

    with open(os.path.join(kvc.server_args.speculative_draft_model_path, "config.json")) as f:
        cfg = DSparkDraftConfig.from_hf_dict(json.load(f))
    return kv_bytes_per_token(
        "fp8" if dtype == "fp8" else "bf16",
        kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        layers=cfg.num_hidden_layers,
    )


def price_atom_dspark_draft(configurator, kvc, *args, **kwargs):
    """Add the ATOM_DSPARK draft pool's bytes per token, at its settled dtype, to
    the cell size (the draft pool has one row per target slot)."""
    from .dspark.algorithm import NAME

    algo = kvc.spec_algorithm
    if getattr(algo, "name", None) != NAME or kvc.is_draft_worker:
        return None
    if not getattr(configurator, "_cell_size", 0):
        return None
    dk = getattr(kvc.server_args, "_sgl_atom_draft_kv", None)
    if dk is None:  # settled by the resolution hook whenever speculation is on
        return None
    target_cell = configurator._cell_size
    draft_cell = _atom_dspark_cell(kvc, dk.settled)
    configurator._cell_size = target_cell + draft_cell
    _log_when_sized(configurator, target_cell, draft_cell, _atom_dspark_cell(kvc, dk.target), dk)
    return configurator
