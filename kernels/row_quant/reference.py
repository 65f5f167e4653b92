"""Pure-torch reference for `quant_rows_fp8`."""

from __future__ import annotations

import torch

from ..common import FP8_DTYPE, FP8_MAX, FP8_SCALE_MIN


def reference_quant_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] -> (e4m3fn values [rows, cols], fp32 scales [rows, 1]), value * scale
    approximating x: scale = max(amax / 448, FP8_SCALE_MIN), values rounded to nearest even."""
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True)
    # tensor / tensor is IEEE division on every device (CUDA turns `/ scalar` into `* (1/scalar)`)
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(FP8_SCALE_MIN)
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
