"""Per-row fp8 quantization: one program per row, two passes over it (its amax, then its
values), the row staying in L1/L2 between them (a draft layer's widest row is 14336 bf16s)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import FP8_DTYPE, FP8_MAX, FP8_SCALE_MIN, next_pow2
from ..fp8 import round_e4m3

_FP8_MAX = tl.constexpr(FP8_MAX)
_SCALE_MIN = tl.constexpr(FP8_SCALE_MIN)
MAX_BLOCK = 4096  # columns per chunk of a row


@triton.jit
def quant_rows_kernel(
    X, Q, S, cols, stride_x, stride_q,
    BLOCK: tl.constexpr, HW_ROUND: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, cols, BLOCK):
        x = tl.load(x_row + c0 + offs, mask=c0 + offs < cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # IEEE division (div_rn), as torch computes it: the scales and bytes match the reference
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), _FP8_MAX), _SCALE_MIN)
    tl.store(S + row, scale)
    for c0 in range(0, cols, BLOCK):
        ok = c0 + offs < cols
        x = tl.load(x_row + c0 + offs, mask=ok, other=0.0).to(tl.float32)
        xq = tl.clamp(tl.math.div_rn(x, scale), -_FP8_MAX, _FP8_MAX)
        if HW_ROUND:  # the GPU's conversion rounds to nearest even, as torch's cast
            xq = xq.to(Q.dtype.element_ty, fp_downcast_rounding="rtne")
        else:
            xq = round_e4m3(xq).to(Q.dtype.element_ty)
        tl.store(Q + row * stride_q + c0 + offs, xq, mask=ok)


def quant_rows_fp8(
    x: torch.Tensor, out: torch.Tensor | None = None, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] (unit stride along cols) -> (e4m3fn [rows, cols], fp32 scales [rows, 1]);
    ``out`` and ``scale`` are written when given. Same bytes as
    :func:`reference_quant_rows_fp8`."""
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"x must be [rows, cols] with unit column stride, got {tuple(x.shape)}")
    rows, cols = x.shape
    if out is None:
        out = torch.empty(rows, cols, dtype=FP8_DTYPE, device=x.device)
    if scale is None:
        scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows == 0:
        return out, scale
    block = min(MAX_BLOCK, next_pow2(cols))
    quant_rows_kernel[(rows,)](
        x, out, scale, cols, x.stride(0), out.stride(0),
        BLOCK=block, HW_ROUND=x.device.type == "cuda", num_warps=4 if block >= 1024 else 1,
    )  # fmt: skip
    return out, scale
