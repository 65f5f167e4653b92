"""fp8 KV scales that live with SGLang's token pool.

One fp32 scale per (token slot, KV head) for K and for V, per layer: ``[slots, kv_heads]``,
indexed by the same slot ids as the pool's K/V rows, so freed and reused slots (radix cache,
chunked prefill) carry their scale with them: a slot's scale is rewritten by the same kernel
that writes its bytes. The buffers live in the pool's :mod:`sgl_atom.pool_state`, so every
backend reading one pool (prefill and decode backends, a draft's own pool) shares them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..log import get_logger
from ..pool_state import state_of

logger = get_logger("sgl_atom.attention")


@dataclass
class KVScales:
    k: list[torch.Tensor]  # per pool layer: [slots, kv_heads] fp32
    v: list[torch.Tensor]
    start_layer: int

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = layer_id - self.start_layer
        return self.k[i], self.v[i]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


def scales_for_pool(pool) -> KVScales:
    """The scale buffers of ``pool`` (an MHA token pool), created once on first use."""
    state = state_of(pool)
    if state.kv_scales is not None:
        return state.kv_scales
    start = getattr(pool, "start_layer", 0) or 0
    shapes = [pool.get_key_buffer(start + i).shape[:2] for i in range(pool.layer_num)]
    device = pool.get_key_buffer(start).device
    # ones, not zeros: a never-written slot dequantizes to its fp8 bytes (zeros) either way
    k = [torch.ones(s, dtype=torch.float32, device=device) for s in shapes]
    v = [torch.ones(s, dtype=torch.float32, device=device) for s in shapes]
    scales = state.kv_scales = KVScales(k, v, start)
    logger.info(
        "fp8 KV scales: %d layers x [%d slots, %d kv heads] x (K, V) fp32 = %.2f MB",
        pool.layer_num,
        shapes[0][0],
        shapes[0][1],
        scales.nbytes() / 2**20,
    )
    return scales


# ---------------------------------------------------------------- the pool budget


def target_layers(kvc) -> int:
    """Full-attention layers of the target's pool on this rank (SGLang's ``KVCacheConfig``)."""
    m = kvc.mambaish_config
    if m:
        lo, hi = kvc.layer_info.start_layer, kvc.layer_info.end_layer
        return sum(lo <= i < hi for i in m.full_attention_layer_ids)
    return kvc.layer_info.num_effective_layers


def atom_fp8_scale_bytes(kvc, num_layers: int) -> int:
    """Bytes per token of the atom backend's fp8 scales: K and V, fp32, per KV head and layer."""
    from sglang.srt.runtime_context import get_parallel

    kv_heads = kvc.model_config.get_num_kv_heads(get_parallel().attn_tp_size)
    return 2 * 4 * kv_heads * num_layers


def add_atom_fp8_scales(configurator, kvc, *args, **kwargs):
    """With fp8 KV and the atom backend serving every mode, add the scales' bytes to the
    target's per-token cell size of SGLang's pool configurator, so the pool still fits the
    memory budget (called by ``sgl_atom.patches.pool_budget``). Returns the configurator when
    it changed it, else None."""
    from sglang.srt.runtime_context import attention_backends

    backends = {b for b in attention_backends() if b is not None}
    if kvc.kv_cache_dtype != torch.float8_e4m3fn or not backends or backends - {"atom"}:
        return None
    if kvc.use_mla_backend or not getattr(configurator, "_cell_size", 0):
        return None
    extra = atom_fp8_scale_bytes(kvc, target_layers(kvc))
    before = configurator._cell_size
    configurator._cell_size = before + extra
    logger.info(
        "atom fp8 KV: per-token budget %d -> %d bytes (+%d for per-token, per-head scales)",
        before,
        before + extra,
        extra,
    )
    return configurator
