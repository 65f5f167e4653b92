"""KV pool budgets SGLang gets wrong for sgl_atom's features (AFTER hooks on
``create_memory_pool_configurator``):

1. the atom backend's fp8 KV scales (one fp32 per token, KV head and layer, for K and V) are
   priced into the target's bytes per token, so the pool still fits the memory budget;
2. an EAGLE/STANDALONE draft's KV pool is priced at the draft's own dtype (below);
3. the ATOM_DSPARK draft's own pool (which SGLang does not know about) is priced at the settled
   draft dtype, so the target pool shrinks by exactly what the draft pool takes.

Price an EAGLE/STANDALONE draft's KV pool at the draft's own dtype.

SGLang 0.5.23's ``DefaultPoolConfigurator`` reserves an EAGLE/STANDALONE draft's layers at the
TARGET's bytes per token, whatever ``speculative_draft_kv_cache_dtype`` says, so an fp8 draft
under a bf16 target is over-reserved (fewer KV tokens than fit) and a bf16 draft under an fp8
target is under-reserved. An AFTER hook on ``create_memory_pool_configurator`` re-prices the
draft term at the settled dtype (``server_args._sgl_atom_draft_kv``) and logs the draft pool's
bytes and the token capacity gained. DFLASH/DSPARK drafts are already priced at their dtype
upstream. Ledger: ``sgl_atom.patches.LEDGER``.
"""

from __future__ import annotations

from ..log import get_logger
from ..spec.draft_kv_budget import budget_line, draft_budget, kv_bytes_per_token

TARGET = "sglang.srt.model_executor.pool_configurator.create_memory_pool_configurator"
logger = get_logger("sgl_atom.spec")


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


def _target_layers(kvc) -> int:
    m = kvc.mambaish_config
    if m:
        lo, hi = kvc.layer_info.start_layer, kvc.layer_info.end_layer
        return sum(lo <= i < hi for i in m.full_attention_layer_ids)
    return kvc.layer_info.num_effective_layers


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
    """AFTER hook: the draft term of the configurator's cell size at the draft's own dtype."""
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
    target_cell = configurator._compute_cell_size(kvc, _target_layers(kvc))
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

    from ..spec.dspark.config import DSparkDraftConfig

    with open(os.path.join(kvc.server_args.speculative_draft_model_path, "config.json")) as f:
        cfg = DSparkDraftConfig.from_hf_dict(json.load(f))
    return kv_bytes_per_token(
        "fp8" if dtype == "fp8" else "bf16",
        kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        layers=cfg.num_hidden_layers,
    )


def price_atom_dspark_draft(configurator, kvc, *args, **kwargs):
    """AFTER hook: add the ATOM_DSPARK draft pool's bytes per token, at its settled dtype, to
    the cell size (the draft pool has one row per target slot)."""
    from ..spec.dspark.algorithm import NAME

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


def atom_fp8_scale_bytes(kvc, num_layers: int) -> int:
    """Bytes per token of the atom backend's fp8 scales: K and V, fp32, per KV head and layer."""
    from sglang.srt.runtime_context import get_parallel

    kv_heads = kvc.model_config.get_num_kv_heads(get_parallel().attn_tp_size)
    return 2 * 4 * kv_heads * num_layers


def add_atom_fp8_scales(configurator, kvc, *args, **kwargs):
    """AFTER hook: with fp8 KV and the atom backend serving every mode, add the scales' bytes
    to the target's per-token cell size (the pool then holds as many tokens as fit)."""
    import torch
    from sglang.srt.runtime_context import attention_backends

    backends = {b for b in attention_backends() if b is not None}
    if kvc.kv_cache_dtype != torch.float8_e4m3fn or not backends or backends - {"atom"}:
        return None
    if kvc.use_mla_backend or not getattr(configurator, "_cell_size", 0):
        return None
    extra = atom_fp8_scale_bytes(kvc, _target_layers(kvc))
    before = configurator._cell_size
    configurator._cell_size = before + extra
    logger.info(
        "atom fp8 KV: per-token budget %d -> %d bytes (+%d for per-token, per-head scales)",
        before,
        before + extra,
        extra,
    )
    return configurator


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hooks = [h for _, h, _ in HookRegistry._hooks.get(TARGET, [])]
    if add_atom_fp8_scales not in hooks:
        HookRegistry.register(TARGET, add_atom_fp8_scales, HookType.AFTER)
    if reprice_draft not in hooks:
        HookRegistry.register(TARGET, reprice_draft, HookType.AFTER)
    if price_atom_dspark_draft not in hooks:
        HookRegistry.register(TARGET, price_atom_dspark_draft, HookType.AFTER)
