"""Byte spans copied between buffers of one device in one kernel launch.

A job is ``(src, dst, rows)``: two flat uint8 buffers and ``[N, 3]`` rows ``(src_offset,
dst_offset, length)`` in bytes. Every job's spans go into one launch: each span is addressed from
the lowest source and the lowest destination buffer of the call (one address space per device;
for the P/D backend the destination is the consumer's pool mapped through CUDA IPC), cut into
pieces of at most ``_PIECE`` elements, one program per piece. The copy element is the widest of
8/4/2/1 bytes dividing every address and length.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

_PIECE = 1 << 16  # elements per program at most
_BLOCK = 1024
_WIDTHS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))

Job = tuple[torch.Tensor, torch.Tensor, np.ndarray]


@triton.jit(do_not_specialize=["num_pieces"])  # one compiled variant per element width
def copy_pieces_kernel(src_ptr, dst_ptr, table_ptr, num_pieces, BLOCK: tl.constexpr):
    """Program p copies piece p: table rows (src element, dst element, elements) at
    table_ptr + p, + num_pieces + p, + 2 * num_pieces + p."""
    p = tl.program_id(0).to(tl.int64)
    s = tl.load(table_ptr + p)
    d = tl.load(table_ptr + num_pieces + p)
    n = tl.load(table_ptr + 2 * num_pieces + p)
    o = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        m = start + o < n
        x = tl.load(src_ptr + s + start + o, mask=m)
        tl.store(dst_ptr + d + start + o, x, mask=m)


def _width(values: np.ndarray) -> tuple[int, torch.dtype]:
    bits = int(np.bitwise_or.reduce(values)) if len(values) else 0
    for width, dtype in _WIDTHS:
        if bits % width == 0:
            return width, dtype
    raise AssertionError("unreachable: width 1 always fits")


def _check(src: torch.Tensor, dst: torch.Tensor, rows: np.ndarray) -> np.ndarray:
    for name, t in (("src", src), ("dst", dst)):
        assert t.dtype == torch.uint8 and t.dim() == 1 and t.is_contiguous(), (
            f"{name} must be a flat contiguous uint8 buffer"
        )
    assert src.device == dst.device, "src and dst on one device"
    r = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    if len(r):
        assert (r[:, :2] >= 0).all() and (r[:, 2] > 0).all(), "offsets >= 0, lengths > 0"
        assert int((r[:, 0] + r[:, 2]).max()) <= src.numel(), "a span reads past src"
        assert int((r[:, 1] + r[:, 2]).max()) <= dst.numel(), "a span writes past dst"
    return r


def plan_pieces(
    src_off: np.ndarray, dst_off: np.ndarray, lens: np.ndarray, src_ptr: int, dst_ptr: int
) -> tuple[np.ndarray, int]:
    """([3, P] int64 table of pieces in elements, element width) for spans at byte offsets from
    two base addresses."""
    bases = np.array([src_ptr, dst_ptr], dtype=np.int64)
    width, _ = _width(np.concatenate([src_off, dst_off, lens, bases]))
    src_el, dst_el, n_el = src_off // width, dst_off // width, lens // width
    pieces = (n_el + _PIECE - 1) // _PIECE
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    k = np.arange(int(pieces.sum()), dtype=np.int64) - first  # piece number within its span
    span = np.repeat(np.arange(len(lens)), pieces)
    start = k * _PIECE
    table = np.stack(
        [src_el[span] + start, dst_el[span] + start, np.minimum(n_el[span] - start, _PIECE)]
    )
    return table, width


def piece_table(jobs: Sequence[Job]) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, int]:
    """(source base buffer, destination base buffer, [3, P] int64 table of pieces in elements,
    element width) for ``jobs`` (at least one span in all)."""
    checked = [(s, d, _check(s, d, r)) for s, d, r in jobs]
    checked = [(s, d, r) for s, d, r in checked if len(r)]
    assert checked, "no span to copy"
    src_base = min((s for s, _, _ in checked), key=lambda t: t.data_ptr())
    dst_base = min((d for _, d, _ in checked), key=lambda t: t.data_ptr())
    s0, d0 = src_base.data_ptr(), dst_base.data_ptr()
    src_off = np.concatenate([r[:, 0] + (s.data_ptr() - s0) for s, _, r in checked])
    dst_off = np.concatenate([r[:, 1] + (d.data_ptr() - d0) for _, d, r in checked])
    lens = np.concatenate([r[:, 2] for _, _, r in checked])
    table, width = plan_pieces(src_off, dst_off, lens, s0, d0)
    return src_base, dst_base, table, width


def _typed(base: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    return base[: base.numel() // width * width].view(dtype)


def _launch(src_base: torch.Tensor, dst_base: torch.Tensor, table: np.ndarray, width: int) -> int:
    dtype = dict(_WIDTHS)[width]
    t = torch.from_numpy(np.ascontiguousarray(table)).to(src_base.device)
    n = table.shape[1]
    copy_pieces_kernel[(n,)](
        _typed(src_base, width, dtype), _typed(dst_base, width, dtype), t, n, BLOCK=_BLOCK
    )
    return int(table[2].sum()) * width


def copy_addressed(
    src_base: torch.Tensor,
    dst_base: torch.Tensor,
    src_off: np.ndarray,
    dst_off: np.ndarray,
    lens: np.ndarray,
) -> int:
    """Copy spans at byte offsets ``src_off`` from ``src_base``'s address to ``dst_off`` from
    ``dst_base``'s, on the current stream, in one launch; returns the bytes copied. The offsets
    may reach past the base buffers into other buffers of the same device (one address space):
    the caller has checked every span against the buffer it lies in."""
    if len(lens) == 0:
        return 0
    table, width = plan_pieces(src_off, dst_off, lens, src_base.data_ptr(), dst_base.data_ptr())
    return _launch(src_base, dst_base, table, width)


def copy_spans(jobs: Sequence[Job]) -> int:
    """Copy every job's spans on the current stream, in one launch; returns the bytes copied.
    Nothing is read or written outside each job's own buffers (checked before the launch)."""
    if not any(len(np.asarray(r).reshape(-1, 3)) for _, _, r in jobs):
        return 0
    return _launch(*piece_table(jobs))
