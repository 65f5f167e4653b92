"""Shared helpers for kernel tests: relative error against a reference, NaN-poisoned outputs."""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ computed in float64; NaN anywhere in `out` gives NaN (never passes)."""
    out64 = out.detach().to(torch.float64).cpu()
    ref64 = ref.detach().to(torch.float64).cpu()
    assert out64.shape == ref64.shape, f"shape {tuple(out64.shape)} != {tuple(ref64.shape)}"
    denom = ref64.norm().item()
    return (out64 - ref64).norm().item() / max(denom, 1e-30)


def assert_close_rel(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "out") -> None:
    """Fail with the measured error when rel_err exceeds `tol` or `out` holds a NaN."""
    assert not torch.isnan(out).any(), f"{what} has NaN: unwritten or invalid elements"
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def poisoned(shape, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """A fresh tensor filled with NaN (or the dtype's max for integer/fp8 types that lack NaN)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if dtype.is_floating_point and dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.fill_(float("nan"))
    if dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).fill_(0x7F).view(dtype)  # 0x7F is e4m3fn NaN
    if dtype == torch.float8_e5m2:
        return t.view(torch.uint8).fill_(0x7F).view(dtype)  # 0x7F is e5m2 NaN
    return t.fill_(torch.iinfo(dtype).max)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Overwrite an existing tensor in place with the poison value of `poisoned`."""
    t.copy_(poisoned(t.shape, t.dtype, t.device))
    return t


def device() -> str:
    """Where kernels run in these tests: CUDA when present, else CPU under TRITON_INTERPRET=1."""
    return "cuda" if torch.cuda.is_available() else "cpu"
