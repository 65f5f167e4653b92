"""Head cuts packed through a staging buffer on the producer.

Where a decode rank holds fewer KV heads than the prefill rank (a "split": TP1 prefill into TP2
decode ranks, PP2 into TP2), its heads of one run are a short span in the producer's page: one
token of SGLang's token-major layout is ``heads x head_dim`` bytes (512 B for 2 heads of 128 in
bf16). Written span by span that is one NIXL descriptor per token, layer and K/V, which no
transport moves at device speed. The decode rank's page, though, holds exactly those heads:
gathered into a staging buffer in the decode rank's page layout (``kernels/kv_transfer``:
``pack_heads`` on CUDA, one ``index_select`` on CPU), a request's pages become a few large
contiguous writes, coalesced across pages that follow each other on the decode side.

Packed: split pairs whose decode rank takes all its heads from this producer rank at the same
page geometry (:func:`packs`). Everything else (whole pages, merges, regrouping, replicated
regions, different page sizes) is written span by span as before. The staging buffer
(``SGL_ATOM_PD_STAGING_MB``, 0: off) is allocated and registered with NIXL at the first packed
write, on the pool's device, and reused: a chunk larger than the buffer is written in rounds,
each waited for before the buffer is packed again. Only the producer's writer thread uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from sgl_atom.disagg.engine import NixlEngine
from sgl_atom.disagg.plan import PairPlan
from sgl_atom.log import get_logger

logger = get_logger("sgl_atom.disagg")

STAGE_REGION = "stage"


def packs(pair: PairPlan) -> bool:
    """The consumer's page is exactly the moved heads of the producer's page, run by run: a
    packed page lands whole."""
    return (
        pair.mode == "split"
        and not pair.whole_pages
        and pair.src_runs == pair.dst_runs
        and pair.num_heads == pair.dst_heads
        and pair.dst_head_start == 0
    )


def pack_pages(
    region: torch.Tensor, pair: PairPlan, pages: Sequence[int], out: torch.Tensor
) -> None:
    """Gather heads ``[src_head_start, +num_heads)`` of every run of ``pages`` of ``region``
    (the producer's buffer) into ``out`` (uint8, ``len(pages) * pair.dst_page_bytes``), laid out
    as the consumer's pages."""
    idx = torch.tensor(pages, dtype=torch.int64, device=region.device)
    if region.is_cuda:
        from sgl_atom.kernels.kv_transfer import pack_heads

        pack_heads(
            region,
            idx,
            pair.src_head_start,
            pair.num_heads,
            out,
            page_size=pair.src_runs * pair.run_tokens,
            runs_per_page=pair.src_runs,
        )
        return
    raw = region.reshape(-1).view(torch.uint8)
    view = raw.view(-1, pair.src_runs, pair.src_heads, pair.chunk_bytes)
    cut = view[:, :, pair.src_head_start : pair.src_head_start + pair.num_heads]
    dst = out.view(len(pages), pair.src_runs, pair.num_heads, pair.chunk_bytes)
    torch.index_select(cut, 0, idx, out=dst)


class Stager:
    """The producer's staging buffer and the rounds of packed writes through it."""

    def __init__(self, engine: NixlEngine, tensors: Sequence[torch.Tensor], nbytes: int):
        self.engine = engine
        self.tensors = tensors
        self.capacity = nbytes
        self.buf: torch.Tensor | None = None

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def _buffer(self) -> torch.Tensor:
        if self.buf is None:
            device = self.tensors[0].device
            self.buf = torch.empty(self.capacity, dtype=torch.uint8, device=device)
            self.engine.register({STAGE_REGION: self.buf})
            logger.info(
                "atom P/D: head cuts are packed through a %d MiB staging buffer on %s",
                self.capacity >> 20,
                device,
            )
        return self.buf

    def write(
        self,
        peer: str,
        jobs: Sequence[tuple[PairPlan, int]],
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        wait: Callable[[Any], None],
    ) -> tuple[list[Any], list[Any]]:
        """Pack and write ``jobs`` ((pair, the consumer region's address)) for these pages:
        (handles already landed, handles in flight). A round that fills the buffer is posted
        and waited for (``wait``) before the buffer is packed again; the last round is left in
        flight for the caller to wait for."""
        buf, n = self._buffer(), min(len(src_pages), len(dst_pages))
        landed: list[Any] = []
        staged: list[tuple[np.ndarray, int]] = []  # packed, not yet posted: (spans, address)
        used = 0
        for pair, addr in jobs:
            pb = pair.dst_page_bytes
            if pb > self.capacity:
                raise ValueError(
                    f"SGL_ATOM_PD_STAGING_MB: a page of {pair.name} is {pb} B, more than the "
                    f"staging buffer ({self.capacity} B); raise it, or set 0 to write span by span"
                )
            lo = 0
            while lo < n:
                if used + pb > self.capacity:  # full: land what it holds, then reuse it
                    for h in self._post(peer, staged):
                        wait(h)
                        landed.append(h)
                    staged, used = [], 0
                hi = min(n, lo + (self.capacity - used) // pb)
                pack_pages(
                    self.tensors[pair.producer_index],
                    pair,
                    src_pages[lo:hi],
                    buf[used : used + (hi - lo) * pb],
                )
                spans = [(used + (i - lo) * pb, dst_pages[i] * pb, pb) for i in range(lo, hi)]
                staged.append((np.array(spans, dtype=np.uint64), addr))
                used += (hi - lo) * pb
                lo = hi
        return landed, self._post(peer, staged)

    def _post(self, peer: str, staged: list[tuple[np.ndarray, int]]) -> list[Any]:
        """Post the packed writes once the packing has finished on the device."""
        if staged and self.buf is not None and self.buf.is_cuda:
            torch.cuda.current_stream(self.buf.device).synchronize()
        return self.engine.write_many(peer, [(spans, STAGE_REGION, addr) for spans, addr in staged])
