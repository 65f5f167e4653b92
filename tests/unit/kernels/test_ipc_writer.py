"""The atom P/D backend's CUDA IPC writer on CPU buffers (the copy kernel under Triton's
interpreter): whole-page regions copied run by run from one page list, head-cut spans beside
them, every span checked before anything is copied."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import poisoned

from sgl_atom.disagg.engine import TransferError, page_runs
from sgl_atom.disagg.ipc import IpcWriter

PAGE_BYTES = (256, 512, 96)  # three whole-page regions
NUM_PAGES = 40


def _random_bytes(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


def test_page_runs_merge_pages_that_follow_on_both_sides():
    runs = page_runs(np.array([4, 5, 6, 9, 10, 2]), np.array([0, 1, 2, 3, 7, 8]))
    assert runs.tolist() == [[4, 0, 3], [9, 3, 1], [10, 7, 1], [2, 8, 1]]


def test_writer_copies_page_runs_and_cut_spans_byte_exact():
    gen = torch.Generator().manual_seed(11)
    sources = [_random_bytes(NUM_PAGES * pb, gen) for pb in PAGE_BYTES] + [_random_bytes(4000, gen)]
    mapped = [poisoned((NUM_PAGES * pb,), torch.uint8) for pb in PAGE_BYTES] + [
        poisoned((3000,), torch.uint8)
    ]
    writer = IpcWriter(sources)
    writer.add("d0", mapped)
    src_pages = np.array([7, 8, 9, 20, 3, 4, 31], dtype=np.int64)
    dst_pages = np.array([0, 1, 2, 5, 11, 12, 39], dtype=np.int64)
    runs = page_runs(src_pages, dst_pages)
    assert len(runs) == 4  # 7-9 -> 0-2, 20 -> 5, 3-4 -> 11-12, 31 -> 39
    whole = [(i, i, pb) for i, pb in enumerate(PAGE_BYTES)]
    cut = np.array([[0, 100, 64], [64, 164, 64], [1000, 0, 33]], dtype=np.int64)  # 2 coalesce
    expect = [m.clone() for m in mapped]
    for i, pb in enumerate(PAGE_BYTES):
        for s, d in zip(src_pages.tolist(), dst_pages.tolist(), strict=True):
            expect[i][d * pb : (d + 1) * pb] = sources[i][s * pb : (s + 1) * pb]
    for a, b, n in cut.tolist():
        expect[3][b : b + n] = sources[3][a : a + n]
    handle = writer.write("d0", [(cut, 3, 3)], (runs, whole))
    writer.wait(handle)
    assert handle.state == "DONE"
    assert handle.nbytes == len(src_pages) * sum(PAGE_BYTES) + 64 * 2 + 33
    assert handle.spans == len(runs) * len(PAGE_BYTES) + 2
    for got, want in zip(mapped, expect, strict=True):
        assert torch.equal(got, want)


def test_writer_refuses_spans_past_either_buffer_before_copying():
    gen = torch.Generator().manual_seed(12)
    sources = [_random_bytes(NUM_PAGES * 256, gen), _random_bytes(512, gen)]
    mapped = [poisoned((8 * 256,), torch.uint8), poisoned((512,), torch.uint8)]  # 8 pages only
    writer = IpcWriter(sources)
    writer.add("d0", mapped)
    before = [m.clone() for m in mapped]
    ok = (np.array([[0, 0, 1]]), [(0, 0, 256)])
    with pytest.raises(TransferError, match="pages write up to byte 2304 of the peer's region 0"):
        writer.write("d0", [], (np.array([[0, 7, 2]]), [(0, 0, 256)]))
    with pytest.raises(TransferError, match="spans read up to byte 520 of region r1"):
        writer.write("d0", [(np.array([[500, 0, 20]]), 1, 1)], ok)
    with pytest.raises(TransferError, match="pages read up to byte 10496 of region r0"):
        writer.write("d0", [], (np.array([[40, 0, 1]]), [(0, 0, 256)]))
    assert all(torch.equal(a, b) for a, b in zip(mapped, before, strict=True))
    assert writer.close("d0") and not writer.close("d0")
    with pytest.raises(TransferError, match="no mapping of peer 'd0'"):
        writer.write("d0", [], ok)
