"""quant_rows_fp8 against its torch reference (same bytes and scales) and against float64 (every
value the nearest e4m3 of x / scale), outputs poisoned before the call."""

import pytest
import torch
from helpers import device, poisoned
from sgl_atom.kernels.common import FP8_MAX
from sgl_atom.kernels.row_quant import quant_rows_fp8, reference_quant_rows_fp8
from sgl_atom.kernels.row_quant.quant import MAX_ROW

DEV = device()
FP8 = torch.float8_e4m3fn
# rows x cols: a decode row, a block of rows, a draft layer's widest row (one pass, not a power
# of two), a row wider than one pass takes (chunks of MAX_BLOCK, a ragged tail)
CASES = [(1, 64), (37, 256), (4, 14336), (3, MAX_ROW + 96)]


def _x(rows, cols, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 2, rows)[:, None]
    x[0, :3] = torch.tensor([0.0, -0.0, 1e-30])  # zeros and a value far below the row's scale
    return x.to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows,cols", CASES, ids=[f"{r}x{c}" for r, c in CASES])
def test_quant_rows_matches_reference_and_float64(rows, cols, dtype):
    x = _x(rows, cols, seed=rows * 7 + cols, dtype=dtype)
    q, s = poisoned((rows, cols), FP8, DEV), poisoned((rows, 1), torch.float32, DEV)
    quant_rows_fp8(x, q, s)
    wq, ws = reference_quant_rows_fp8(x)
    assert torch.equal(s.cpu(), ws.cpu())
    assert torch.equal(q.view(torch.uint8).cpu(), wq.view(torch.uint8).cpu())
    x64, s64 = x.double().cpu(), s.double().cpu()
    amax = x64.abs().amax(dim=-1, keepdim=True)
    assert torch.allclose(s64, amax / FP8_MAX, rtol=1e-6, atol=0)  # the row's amax maps to 448
    exact = x64 / s64
    err = (q.double().cpu() - exact).abs()
    # nearest e4m3: half a step of 2^(e-3) for normals (|v| >= 2^-6), of 2^-9 below; plus the
    # float32 rounding of the quotient (a tie in float32 may be just off one in float64)
    step = torch.where(exact.abs() >= 2**-6, 2.0 ** (exact.abs().log2().floor() - 3), 2.0**-9)
    assert (err <= step / 2 + exact.abs() * 2.0**-23).all()


def test_quant_rows_strided_rows_and_empty():
    base = _x(9, 320, seed=1, dtype=torch.bfloat16)
    x = base[:, 64:]  # rows of a wider tensor: row stride 320
    q, s = quant_rows_fp8(x)
    wq, ws = reference_quant_rows_fp8(x)
    assert torch.equal(q.view(torch.uint8).cpu(), wq.view(torch.uint8).cpu())
    assert torch.equal(s.cpu(), ws.cpu())
    q0, s0 = quant_rows_fp8(torch.empty(0, 64, dtype=torch.bfloat16, device=DEV))
    assert q0.shape == (0, 64) and s0.shape == (0, 1)
    with pytest.raises(ValueError, match="unit column stride"):
        quant_rows_fp8(base.t())
