"""Gather/scatter of a request's head runs between a paged region and a staging buffer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import RunLayout

_TILE = 4096  # elements per program


@triton.jit
def copy_runs_kernel(
    src_ptr,
    dst_ptr,
    pages_ptr,
    num_rows,
    runs,
    span,
    page_stride,
    run_stride,
    head_offset,
    PACK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One program copies BLOCK_R rows x BLOCK_S elements; row = (page index i, run r) holds the
    span of the cut heads in run r of page pages[i]. PACK: region -> staging, else the reverse.
    All offsets are in elements of one width (bytes, or 2/4/8-byte words)."""
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    o = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    row_ok = row < num_rows
    page = tl.load(pages_ptr + row // runs, mask=row_ok, other=0).to(tl.int64)
    region = page * page_stride + (row % runs).to(tl.int64) * run_stride + head_offset
    staged = row.to(tl.int64) * span
    mask = row_ok[:, None] & (o < span)[None, :]
    if PACK:
        x = tl.load(src_ptr + region[:, None] + o[None, :], mask=mask)
        tl.store(dst_ptr + staged[:, None] + o[None, :], x, mask=mask)
    else:
        x = tl.load(src_ptr + staged[:, None] + o[None, :], mask=mask)
        tl.store(dst_ptr + region[:, None] + o[None, :], x, mask=mask)


_WIDTHS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _element(chunk_bytes: int, *tensors: torch.Tensor) -> tuple[int, torch.dtype]:
    """Widest copy element dividing the chunk size and every base address."""
    for width, dtype in _WIDTHS:
        if chunk_bytes % width == 0 and all(t.data_ptr() % width == 0 for t in tensors):
            return width, dtype
    raise AssertionError("unreachable: width 1 always fits")


def _flat(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.view(-1).view(torch.uint8).view(dtype)


def _check(
    region: torch.Tensor,
    pages: torch.Tensor,
    staging: torch.Tensor,
    layout: RunLayout,
    head_start: int,
    head_count: int,
) -> int:
    assert region.is_contiguous() and staging.is_contiguous(), (
        "region and staging must be contiguous"
    )
    assert pages.dim() == 1 and pages.dtype in (torch.int32, torch.int64), (
        "pages: [n_pages] int32/int64"
    )
    assert region.device == pages.device == staging.device, "region, pages, staging on one device"
    assert region.shape[0] % layout.page_size == 0, (
        f"num_slots {region.shape[0]} not a multiple of page_size"
    )
    assert 0 <= head_start and head_count >= 1 and head_start + head_count <= layout.heads, (
        f"heads [{head_start}, {head_start + head_count}) outside [0, {layout.heads})"
    )
    need = layout.staging_bytes(pages.numel(), head_count)
    assert staging.numel() * staging.element_size() >= need, (
        f"staging holds fewer than {need} bytes"
    )
    return need


def _launch(
    region: torch.Tensor,
    pages: torch.Tensor,
    staging: torch.Tensor,
    layout: RunLayout,
    head_start: int,
    head_count: int,
    pack: bool,
) -> torch.Tensor:
    need = _check(region, pages, staging, layout, head_start, head_count)
    width, dtype = _element(layout.chunk_bytes, region, staging)
    chunk = layout.chunk_bytes // width
    runs, span = layout.runs_per_page, head_count * chunk
    rows = pages.numel() * runs
    block_s = min(triton.next_power_of_2(span), _TILE)
    block_r = min(triton.next_power_of_2(rows), max(1, _TILE // block_s))
    grid = (triton.cdiv(rows, block_r), triton.cdiv(span, block_s))
    reg, stg = _flat(region, dtype), _flat(staging, torch.uint8)[:need].view(dtype)
    src, dst = (reg, stg) if pack else (stg, reg)
    if pages.numel():
        copy_runs_kernel[grid](
            src,
            dst,
            pages,
            rows,
            runs,
            span,
            runs * layout.heads * chunk,
            layout.heads * chunk,
            head_start * chunk,
            PACK=pack,
            BLOCK_R=block_r,
            BLOCK_S=block_s,
            num_warps=4,
        )
    return _flat(staging, torch.uint8)[:need]


def pack_heads(
    src: torch.Tensor,
    pages: torch.Tensor,
    head_start: int,
    head_count: int,
    staging: torch.Tensor,
    *,
    page_size: int,
    runs_per_page: int | None = None,
) -> torch.Tensor:
    """Gather heads `[head_start, head_start + head_count)` of every run of `pages` into `staging`.

    src: region `[num_slots, heads, *unit]` (KV `[num_slots, kv_heads, head_dim]`; fp32 scales
        `[num_slots, kv_heads]`), any dtype (fp8 as uint8 or float8), contiguous;
        `num_slots % page_size == 0`.
    pages: `[n_pages]` int32/int64 page ids of the request (page `p` = slots
        `[p * page_size, (p + 1) * page_size)`).
    staging: contiguous, any dtype, at least `RunLayout.staging_bytes(n_pages, head_count)` bytes.
    runs_per_page: None = SGLang token-major (one run per token); 1 = head-major page; 8 = page-16.
    Writes staging bytes `[n_pages, runs_per_page, head_count, chunk_bytes]` (layout.py); returns
    them as a uint8 view.
    """
    layout = RunLayout.of(src, page_size, runs_per_page)
    return _launch(src, pages, staging, layout, head_start, head_count, pack=True)


def unpack_heads(
    staging: torch.Tensor,
    dst: torch.Tensor,
    pages: torch.Tensor,
    head_start: int,
    head_count: int,
    *,
    page_size: int,
    runs_per_page: int | None = None,
) -> None:
    """Scatter staging `[n_pages, runs_per_page, head_count, chunk_bytes]` into heads
    `[head_start, head_start + head_count)` of every run of `dst`'s `pages` (same shapes as
    `pack_heads`; `dst` is the consumer's region). Other heads of those pages are left as they
    are."""
    layout = RunLayout.of(dst, page_size, runs_per_page)
    _launch(dst, pages, staging, layout, head_start, head_count, pack=False)


def _whole(region: torch.Tensor, page_size: int) -> RunLayout:
    return RunLayout(page_size, 1, region[0].numel() * region.element_size(), 1)


def pack_pages(
    src: torch.Tensor, pages: torch.Tensor, staging: torch.Tensor, *, page_size: int
) -> torch.Tensor:
    """Whole-page gather for replicated units (the index key `[num_slots, index_dim]`, or any
    `[num_slots, ...]` region): staging gets `[n_pages, page_bytes]`; returns it as a uint8 view."""
    return _launch(src, pages, staging, _whole(src, page_size), 0, 1, pack=True)


def unpack_pages(
    staging: torch.Tensor, dst: torch.Tensor, pages: torch.Tensor, *, page_size: int
) -> None:
    """Whole-page scatter of `pack_pages` output into `dst`'s `pages`."""
    _launch(dst, pages, staging, _whole(dst, page_size), 0, 1, pack=False)
