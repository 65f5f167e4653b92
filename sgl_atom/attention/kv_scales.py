"""fp8 KV scales that live with SGLang's token pool.

One fp32 scale per (token slot, KV head) for K and for V, per layer: ``[slots, kv_heads]``,
indexed by the same slot ids as the pool's K/V rows, so freed and reused slots (radix cache,
chunked prefill) carry their scale with them: a slot's scale is rewritten by the same kernel
that writes its bytes. The buffers hang off the pool object, so every backend reading one pool
(prefill and decode backends, a draft's own pool) shares them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..log import get_logger

logger = get_logger("sgl_atom.attention")
_ATTR = "_sgl_atom_kv_scales"


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
    scales = getattr(pool, _ATTR, None)
    if scales is not None:
        return scales
    start = getattr(pool, "start_layer", 0) or 0
    shapes = [pool.get_key_buffer(start + i).shape[:2] for i in range(pool.layer_num)]
    device = pool.get_key_buffer(start).device
    # ones, not zeros: a never-written slot dequantizes to its fp8 bytes (zeros) either way
    k = [torch.ones(s, dtype=torch.float32, device=device) for s in shapes]
    v = [torch.ones(s, dtype=torch.float32, device=device) for s in shapes]
    scales = KVScales(k, v, start)
    setattr(pool, _ATTR, scales)
    logger.info(
        "fp8 KV scales: %d layers x [%d slots, %d kv heads] x (K, V) fp32 = %.2f MB",
        pool.layer_num,
        shapes[0][0],
        shapes[0][1],
        scales.nbytes() / 2**20,
    )
    return scales
