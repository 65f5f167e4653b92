"""The DSpark draft's own KV pool: per draft layer K and V rows at the target's slot ids.

The pool has as many slots as the target's token pool and is indexed by the same slot ids
(``req_to_token``), so a request's draft context lives where its target KV lives: prefix-cache
hits, chunked prefill and slot reuse need no bookkeeping of their own. Rows are stored at the
settled draft KV dtype: bf16, the target's own dtype when nothing was requested, or fp8
e4m3 with one fp32 scale per (slot, KV head) for K and for V, written in one pass by the
``kv_quant`` store kernel (its torch reference on CPU).
"""

from __future__ import annotations

import torch

from ...kernels.kv_quant import reference_store_kv, store_kv

_STORAGE = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def storage_dtype(settled: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for a settled draft KV dtype (bf16, fp8, or the target's own
    dtype name such as fp16, which is stored at the compute dtype)."""
    return _STORAGE.get(settled, compute_dtype)


class DraftKVPool:
    """K/V rows ``[slots, kv_heads, head_dim]`` per draft layer at the settled ``dtype``."""

    def __init__(
        self,
        *,
        slots: int,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: str,
        device: torch.device | str,
        compute_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.dtype, self.compute_dtype = dtype, compute_dtype
        self.slots, self.layers = slots, layers
        self.device = torch.device(device)
        shape = (slots, kv_heads, head_dim)
        storage = storage_dtype(dtype, compute_dtype)
        self.k = [torch.zeros(shape, dtype=storage, device=self.device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=storage, device=self.device) for _ in range(layers)]
        fp8 = dtype == "fp8"
        scales = (slots, kv_heads)
        n_scales = layers if fp8 else 0
        self.k_scale = [torch.ones(scales, device=self.device) for _ in range(n_scales)]
        self.v_scale = [torch.ones(scales, device=self.device) for _ in range(n_scales)]
        self._store = store_kv if self.device.type == "cuda" else reference_store_kv

    @property
    def nbytes(self) -> int:
        tensors = self.k + self.v + self.k_scale + self.v_scale
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def bytes_per_token(self) -> int:
        return self.nbytes // self.slots

    def _scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.dtype != "fp8":
            return None, None
        return self.k_scale[layer], self.v_scale[layer]

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows k, v ``[tokens, kv_heads, head_dim]`` at slots ``loc`` ``[tokens]``."""
        if loc.numel() == 0:
            return
        ks, vs = self._scales(layer)
        self._store(k, v, self.k[layer], self.v[layer], loc, ks, vs)

    def read(self, layer: int, loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows at slots ``loc`` in the compute dtype (fp8 rows dequantized with their scales)."""
        loc = loc.long()
        k, v = self.k[layer][loc], self.v[layer][loc]
        if self.dtype == "fp8":
            k = k.float() * self.k_scale[layer][loc][..., None]
            v = v.float() * self.v_scale[layer][loc][..., None]
        return k.to(self.compute_dtype), v.to(self.compute_dtype)
