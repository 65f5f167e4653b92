"""How a page of a transferred region splits into head runs.

A region is a buffer whose rows are token slots: `[num_slots, heads, *unit]` (a KV buffer
`[num_slots, kv_heads, head_dim]`, its fp32 scales `[num_slots, kv_heads]` with a 4-byte unit).
A replicated unit (the index cache `[num_slots, index_dim]`) is copied whole page by page.
`unit_bytes` is one (slot, head) entry in bytes.
Page `p` owns slots `[p * page_size, (p + 1) * page_size)`, i.e. `page_size * heads * unit_bytes`
consecutive bytes starting at `p * page_bytes`.

Inside a page the bytes are `runs_per_page` runs, each laid out head-major
`[heads, run_tokens, unit_bytes]` with `run_tokens = page_size // runs_per_page`:

| layout                                   | runs_per_page | run_tokens |
|------------------------------------------|---------------|------------|
| SGLang token-major `[slots, heads, dim]` | page_size     | 1          |
| head-major page (one run per page)       | 1             | page_size  |
| "page-16" sub-pages of a 128-token page  | 8             | 16         |

So head `h` of page `p` is `runs_per_page` chunks of `chunk_bytes = run_tokens * unit_bytes`, chunk
`j` at byte `p * page_bytes + (j * heads + h) * chunk_bytes`. The heads `[h0, h0 + n)` of one
run are one contiguous span of `n * chunk_bytes`, which is what the pack/unpack kernels copy.

A staging buffer for `n_pages` pages and `head_count` heads is
`[n_pages, runs_per_page, head_count, chunk_bytes]` bytes: exactly a page of the same layout
with `head_count` heads, so it can land in a consumer rank holding `head_count` heads unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RunLayout:
    """Geometry of one region: tokens per page, heads, bytes per (slot, head), runs per page."""

    page_size: int
    heads: int
    unit_bytes: int
    runs_per_page: int

    def __post_init__(self) -> None:
        if min(self.page_size, self.heads, self.unit_bytes, self.runs_per_page) < 1:
            raise ValueError(f"RunLayout fields must be positive, got {self}")
        if self.page_size % self.runs_per_page:
            raise ValueError(
                f"runs_per_page {self.runs_per_page} must divide page_size {self.page_size}"
            )

    @classmethod
    def of(
        cls, region: torch.Tensor, page_size: int, runs_per_page: int | None = None
    ) -> RunLayout:
        """Layout of `region` `[num_slots, heads, *unit]` (a 2-D `[num_slots, heads]` region, e.g.
        fp32 scales, has one element per unit); None runs: SGLang's token-major layout."""
        assert region.dim() >= 2, "a head-cut region is [num_slots, heads, *unit]"
        heads = region.shape[1]
        unit = region[0, 0].numel() * region.element_size()
        return cls(page_size, heads, unit, page_size if runs_per_page is None else runs_per_page)

    @property
    def run_tokens(self) -> int:
        return self.page_size // self.runs_per_page

    @property
    def chunk_bytes(self) -> int:
        return self.run_tokens * self.unit_bytes

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.heads * self.unit_bytes

    def staging_bytes(self, num_pages: int, head_count: int) -> int:
        """Bytes `pack_heads` writes for `num_pages` pages and `head_count` heads."""
        return num_pages * self.runs_per_page * head_count * self.chunk_bytes
