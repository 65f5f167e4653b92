"""Pure-torch references for the head-cut pack/unpack (byte views; see layout.py)."""

from __future__ import annotations

import torch

from .layout import RunLayout


def _runs(region: torch.Tensor, layout: RunLayout) -> torch.Tensor:
    """`region` as bytes `[num_pages, runs_per_page, heads, chunk_bytes]`."""
    flat = region.contiguous().view(-1).view(torch.uint8)
    return flat.view(-1, layout.runs_per_page, layout.heads, layout.chunk_bytes)


def reference_pack_heads(
    src: torch.Tensor, pages: torch.Tensor, head_start: int, head_count: int, layout: RunLayout
) -> torch.Tensor:
    """Staging bytes `[n_pages * runs_per_page * head_count * chunk_bytes]` uint8."""
    runs = _runs(src, layout)[pages.long()]
    return runs[:, :, head_start : head_start + head_count].reshape(-1).clone()


def reference_unpack_heads(
    staging: torch.Tensor,
    dst: torch.Tensor,
    pages: torch.Tensor,
    head_start: int,
    head_count: int,
    layout: RunLayout,
) -> torch.Tensor:
    """A copy of `dst` with the staged heads written into `pages` (dst itself is not modified)."""
    out = dst.clone()
    runs = _runs(out, layout)
    n = pages.numel()
    staged = staging.view(torch.uint8)[: layout.staging_bytes(n, head_count)]
    staged = staged.view(n, layout.runs_per_page, head_count, layout.chunk_bytes)
    for i, p in enumerate(pages.tolist()):
        runs[p, :, head_start : head_start + head_count] = staged[i]
    return out


def logical_view(region: torch.Tensor, layout: RunLayout) -> torch.Tensor:
    """Bytes of `region` as `[num_slots, heads, unit_bytes]` by logical (slot, head), any runs."""
    r = _runs(region, layout).view(
        -1, layout.runs_per_page, layout.heads, layout.run_tokens, layout.unit_bytes
    )
    return r.permute(0, 1, 3, 2, 4).reshape(-1, layout.heads, layout.unit_bytes)
