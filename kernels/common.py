"""Constants and checks shared by the kernel families (torch only)."""

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
FP8_SCALE_MIN = 1e-12  # floor on a per-row scale, so all-zero rows dequantize to zero


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
