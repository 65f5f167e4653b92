"""One M3 index cache in memory, priced once.

SGLang 0.5.23 gives a MiniMax-M3 pool (``MiniMaxSparseKVPool``) index-key pools of its own beside
the main K/V pool (``index_k_pool`` for sparse layers without an index value, ``index_kv_pool``
for those with one) and prices them into the per-token budget. When sgl_atom's M3 model serves
its sparse layers on the atom backend, nothing reads or writes those pools: the atom backend
keeps its own index cache (:class:`sgl_atom.attention.sparse.IndexCache`: keys for the layers
that score only, fp8 with a per-token scale under fp8 KV). So SGLang's index pools are not
allocated (:mod:`sgl_atom.patches.m3_index_pool` passes them no class) and the pool budget
prices the atom index cache in their place (:func:`price_atom_index_cache`).

Only when every sparse layer is index-key-only (SGLang's ``index_kv_pool`` would be empty: an
index value is not something the atom backend serves) and HiSparse is off; otherwise SGLang's
pools and budget stay as they are.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import torch

from .. import envs
from ..kernels.common import INT4_DTYPE, scaled_index
from ..log import get_logger
from .sparse import SparseConfig, index_row_width

logger = get_logger("sgl_atom.attention")
MODEL_FLAG = "SERVES_SPARSE_ON_ATOM"  # set by sgl_atom's M3 model class
# True while SGLang builds the M3 pool of a model the atom backend serves (the patches set it)
SKIP_SGLANG_INDEX_POOLS: ContextVar[bool] = ContextVar(
    "sgl_atom_skip_m3_index_pools", default=False
)


def no_index_pool(**kwargs: Any) -> None:
    """Stands in for SGLang's index pool classes in a skipped build: allocates nothing."""
    return None


def atom_serves_m3_sparse(model: Any) -> bool:
    """True when ``model`` runs its sparse layers on the atom backend itself and every attention
    mode is served by atom."""
    from sglang.srt.runtime_context import attention_backends

    backends = {b for b in attention_backends() if b is not None}
    return bool(getattr(model, MODEL_FLAG, False)) and backends == {"atom"}


def _layer_split(hf_config: Any, start: int, end: int) -> tuple[list[int], list[int]]:
    """This rank's sparse layers: (all of them, those without an index value)."""
    from sglang.srt.configs.model_config import (
        get_minimax_sparse_attention_config,
        get_minimax_sparse_disable_value_layer_ids,
        get_minimax_sparse_layer_ids,
    )

    sparse_cfg = get_minimax_sparse_attention_config(hf_config)
    _, sparse = get_minimax_sparse_layer_ids(sparse_cfg)
    k_only = set(get_minimax_sparse_disable_value_layer_ids(sparse_cfg))
    local = [lid for lid in sparse if start <= lid < end]
    return local, [lid for lid in local if lid in k_only]


def skips_sglang_index_pools(kvc: Any) -> str | None:
    """Why SGLang's own M3 index pools are kept for this configurator (None: they are skipped)."""
    from sglang.srt.configs.model_config import is_minimax_sparse
    from sglang.srt.runtime_context import get_memory

    if not atom_serves_m3_sparse(getattr(kvc, "model", None)):
        return "the model's sparse layers are not served by the atom backend"
    if not is_minimax_sparse(kvc.model_config.hf_config):
        return "not a MiniMax-M3 sparse model"
    if get_memory().enable_hisparse:
        return "HiSparse"
    lo, hi = kvc.layer_info.start_layer, kvc.layer_info.end_layer
    local, k_only = _layer_split(kvc.model_config.hf_config, lo, hi)
    if len(k_only) != len(local):
        return "sparse layers with an index value (SGLang's index_kv_pool)"
    return None


def index_cache_bytes_per_token(cfg: SparseConfig, layers: range, index_dtype: torch.dtype) -> int:
    """Bytes per token of the atom index cache on a pool holding ``layers``: one key row of
    ``index_dim`` per scoring sparse layer (packed 4-bit: half a byte per dim), plus its fp32
    scale when the keys are fp8 or 4-bit."""
    row = index_row_width(cfg.index_dim, index_dtype) * index_dtype.itemsize
    per_layer = row + (4 if scaled_index(index_dtype) else 0)
    return len(cfg.writers(layers)) * per_layer


def _sglang_index_bytes_per_token(kvc: Any) -> int:
    """SGLang's index-pool term of the M3 cell size (``DefaultPoolConfigurator``'s formula for
    index-key-only sparse layers, HiSparse off)."""
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.configs.model_config import get_minimax_sparse_attention_config
    from sglang.srt.mem_cache.memory_pool import get_minimax_sparse_index_dtype
    from sglang.srt.server_args import m3_fp8_attn_gemm_enabled

    hf = kvc.model_config.hf_config
    lo, hi = kvc.layer_info.start_layer, kvc.layer_info.end_layer
    _, k_only = _layer_split(hf, lo, hi)
    dtype = get_minimax_sparse_index_dtype(
        fp8_attn_gemm=m3_fp8_attn_gemm_enabled(resolving_view(kvc.server_args)),
        kv_cache_dtype=kvc.kv_cache_dtype,
        model_dtype=kvc.model_dtype,
    )
    dim = get_minimax_sparse_attention_config(hf)["sparse_index_dim"]
    return len(k_only) * dim * torch._utils._element_size(dtype)


# "int4": packed 4-bit keys (kernels.common.INT4_DTYPE, two dims per byte)
INDEX_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int4": INT4_DTYPE}


def atom_index_dtype(fp8_kv: bool) -> torch.dtype:
    """The atom backend's index-key dtype: ``SGL_ATOM_M3_INDEX_DTYPE`` (``auto``: fp8 under fp8
    KV, else bf16)."""
    choice = envs.SGL_ATOM_M3_INDEX_DTYPE.get().strip().lower()
    if choice == "auto":
        return torch.float8_e4m3fn if fp8_kv else torch.bfloat16
    if choice not in INDEX_DTYPES:
        raise ValueError(
            f"SGL_ATOM_M3_INDEX_DTYPE={choice!r}: use auto, bf16, fp8 or int4 (the sparse "
            "index-key cache's dtype)"
        )
    return INDEX_DTYPES[choice]


def price_atom_index_cache(configurator: Any, kvc: Any, *args: Any, **kwargs: Any) -> Any:
    """The atom index cache in place of SGLang's M3 index pools in the per-token cell size of
    SGLang's pool configurator (called by ``sgl_atom.patches.pool_budget``). Returns the
    configurator when it changed it, else None."""
    if kvc.is_draft_worker or not getattr(configurator, "_cell_size", 0):
        return None
    if skips_sglang_index_pools(kvc) is not None:
        return None
    mc = kvc.model_config
    cfg = SparseConfig.from_hf(mc.hf_config, mc.get_total_num_kv_heads(), int(mc.head_dim))
    layers = range(kvc.layer_info.start_layer, kvc.layer_info.end_layer)
    theirs = _sglang_index_bytes_per_token(kvc)
    fp8 = kvc.kv_cache_dtype == torch.float8_e4m3fn
    ours = index_cache_bytes_per_token(cfg, layers, atom_index_dtype(fp8))
    before = configurator._cell_size
    configurator._cell_size = before - theirs + ours
    logger.info(
        "M3 index keys: per-token budget %d -> %d bytes (SGLang's index pools, %d B, are not "
        "allocated; the atom index cache takes %d B)",
        before,
        configurator._cell_size,
        theirs,
        ours,
    )
    return configurator
