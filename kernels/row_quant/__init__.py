"""Per-row fp8 quantization of activations for fp8 GEMMs: e4m3fn values and one fp32 scale per
row (``amax / 448``), in one pass per row."""

from .quant import quant_rows_fp8
from .reference import reference_quant_rows_fp8

__all__ = ["quant_rows_fp8", "reference_quant_rows_fp8"]
