"""Per-row fp8 quantization: one program per row. A row of up to ``MAX_ROW`` columns (a draft
layer's widest, 14336, included) is read once and held in registers across as many warps as its
width needs (its amax, then its values, from the same registers); a wider row is read twice in
``MAX_BLOCK`` chunks (its amax, then its values), staying in L1/L2 between the passes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import FP8_DTYPE, FP8_MAX, FP8_SCALE_MIN, next_pow2
from ..fp8 import round_e4m3

_FP8_MAX = tl.constexpr(FP8_MAX)
_SCALE_MIN = tl.constexpr(FP8_SCALE_MIN)
MAX_ROW = 16384  # widest row read in one pass, held in registers
MAX_BLOCK = 4096  # columns per chunk of a wider row
COLS_PER_WARP = 1024  # a one-pass row's columns per warp: 32 fp32 registers per thread


@triton.jit
def _quantized(x, scale, HW_ROUND: tl.constexpr, DTYPE: tl.constexpr):
    xq = tl.clamp(tl.math.div_rn(x, scale), -_FP8_MAX, _FP8_MAX)
    if HW_ROUND:  # the GPU's conversion rounds to nearest even, as torch's cast
        return xq.to(DTYPE, fp_downcast_rounding="rtne")
    return round_e4m3(xq).to(DTYPE)


@triton.jit
def quant_rows_kernel(
    X, Q, S, cols, stride_x, stride_q,
    BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, HW_ROUND: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    q_row = Q + row * stride_q
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:  # the whole row in registers (BLOCK >= cols)
        ok = offs < cols
        x = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
        # IEEE division (div_rn), as torch computes it: the scales and bytes match the reference
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), _FP8_MAX), _SCALE_MIN)
        tl.store(S + row, scale)
        tl.store(q_row + offs, _quantized(x, scale, HW_ROUND, Q.dtype.element_ty), mask=ok)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for c0 in range(0, cols, BLOCK):
            x = tl.load(x_row + c0 + offs, mask=c0 + offs < cols, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), _FP8_MAX), _SCALE_MIN)
        tl.store(S + row, scale)
        for c0 in range(0, cols, BLOCK):
            ok = c0 + offs < cols
            x = tl.load(x_row + c0 + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(q_row + c0 + offs, _quantized(x, scale, HW_ROUND, Q.dtype.element_ty),
                     mask=ok)  # fmt: skip


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
    one_pass = cols <= MAX_ROW
    block = next_pow2(cols) if one_pass else MAX_BLOCK
    quant_rows_kernel[(rows,)](
        x, out, scale, cols, x.stride(0), out.stride(0),
        BLOCK=block, ONE_PASS=one_pass, HW_ROUND=x.device.type == "cuda",
        num_warps=max(1, min(16, block // COLS_PER_WARP)),
    )  # fmt: skip
    return out, scale
