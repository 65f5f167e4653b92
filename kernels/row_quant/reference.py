"""Pure-torch reference for `quant_rows_fp8`."""

from __future__ import annotations

import torch

from ..kv_quant.reference import quantize_rows


def reference_quant_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] -> (e4m3fn values [rows, cols], fp32 scales [rows, 1]), value * scale
    approximating x: the KV store's per-row rule (scale = max(amax / 448, FP8_SCALE_MIN),
    values rounded to nearest even), one row per activation row."""
    q, scale = quantize_rows(x)
    return q, scale[:, None]
