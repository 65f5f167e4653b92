"""Pure-torch reference for `store_kv`."""

from __future__ import annotations

import torch

from ..common import FP8_MAX, FP8_SCALE_MIN, is_fp8


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, kv_heads, head_dim] → (e4m3fn values, fp32 scales [tokens, kv_heads]): one
    scale per row of the last dimension, for any leading shape."""
    x32 = x.float()
    amax = x32.abs().amax(dim=-1)
    # tensor / tensor is IEEE division on every device (CUDA turns `/ scalar` into `* (1/scalar)`)
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(FP8_SCALE_MIN)
    q = (x32 / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def reference_store_kv(k, v, k_cache, v_cache, loc, k_scale=None, v_scale=None) -> None:
    """Same contract as `store_kv`, written with torch indexing."""
    loc = loc.long()
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if is_fp8(cache.dtype):
            q, s = quantize_rows(x)
            cache[loc] = q
            scale[loc] = s
        else:
            cache[loc] = x.to(cache.dtype)
