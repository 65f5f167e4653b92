"""kv_transfer pack/unpack: bit-exact against the torch reference and logical (slot, head) views."""

from __future__ import annotations

import pytest
import torch
from helpers import device, poisoned
from sgl_atom.kernels import kv_transfer as kt

# (name, page_size, runs_per_page): runs None = SGLang token-major
LAYOUTS = [
    ("tokmajor-p1", 1, None),
    ("tokmajor-p16", 16, None),
    ("headmajor-p16", 16, 1),
    ("page16-of-128", 128, 8),
]
# (name, dtype, unit shape)
UNITS = [
    ("bf16-d128", torch.bfloat16, (128,)),
    ("fp8-d128", torch.float8_e4m3fn, (128,)),
    ("fp32-scale", torch.float32, ()),
    ("u8-d5", torch.uint8, (5,)),
    ("fp16-d3", torch.float16, (3,)),
]


def random_region(
    num_pages: int, page_size: int, heads: int, unit: tuple, dtype: torch.dtype, dev: str
) -> torch.Tensor:
    """Random bytes (any bit pattern, fp8 NaN codes too) as a `[slots, heads, *unit]` region."""
    shape = (num_pages * page_size, heads, *unit)
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
    return raw.view(dtype).view(shape)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def random_pages(num_pages: int, n: int, dev: str, gen: torch.Generator) -> torch.Tensor:
    return torch.randperm(num_pages, generator=gen)[:n].to(torch.int32).to(dev)


def check_pack_unpack(
    layout_case, unit_case, heads, head_start, head_count, num_pages, n, dev, seed=0
):
    _, page_size, runs = layout_case
    _, dtype, unit = unit_case
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    src = random_region(num_pages, page_size, heads, unit, dtype, dev)
    pages = random_pages(num_pages, n, dev, gen)
    layout = kt.RunLayout.of(src, page_size, runs)
    staging = poisoned((layout.staging_bytes(n, head_count) + 64,), torch.uint8, dev)
    out = kt.pack_heads(
        src, pages, head_start, head_count, staging, page_size=page_size, runs_per_page=runs
    )
    ref = kt.reference_pack_heads(src.cpu(), pages.cpu(), head_start, head_count, layout)
    assert torch.equal(out.cpu(), ref), "pack_heads bytes differ from the reference"
    assert torch.all(staging[out.numel() :].cpu() == 255), "pack_heads wrote past its staging bytes"
    dst = random_region(num_pages, page_size, heads, unit, dtype, dev)
    dst_pages = random_pages(num_pages, n, dev, gen)
    want = kt.reference_unpack_heads(
        out.cpu(), dst.cpu(), dst_pages.cpu(), head_start, head_count, layout
    )
    kt.unpack_heads(
        out, dst, dst_pages, head_start, head_count, page_size=page_size, runs_per_page=runs
    )
    assert torch.equal(as_bytes(dst).cpu(), as_bytes(want)), (
        "unpack_heads bytes differ from the reference"
    )


@pytest.mark.parametrize("unit_case", UNITS, ids=[u[0] for u in UNITS])
@pytest.mark.parametrize("layout_case", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_pack_unpack_matches_reference(layout_case, unit_case):
    check_pack_unpack(
        layout_case, unit_case, heads=8, head_start=2, head_count=4, num_pages=7, n=3, dev=device()
    )


def logical(region: torch.Tensor, page_size: int, runs) -> torch.Tensor:
    return kt.logical_view(region.cpu(), kt.RunLayout.of(region, page_size, runs))


def slots_of(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    return (pages.cpu().long()[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def check_split(
    layout_case, dtype, unit, producer_heads, consumer_heads, dev, num_pages=6, n=4, seed=1
):
    """TP1 producer with all heads -> each consumer rank gets its heads of every run, any layout."""
    _, page_size, runs = layout_case
    gen = torch.Generator().manual_seed(seed)
    src = random_region(num_pages, page_size, producer_heads, unit, dtype, dev)
    src_pages = random_pages(num_pages, n, dev, gen)
    for rank in range(producer_heads // consumer_heads):
        dst = poisoned(
            (num_pages * page_size, consumer_heads, *unit),
            torch.uint8 if dtype == torch.uint8 else dtype,
            dev,
        )
        dst_pages = random_pages(num_pages, n, dev, gen)
        layout = kt.RunLayout.of(src, page_size, runs)
        staging = torch.empty(
            layout.staging_bytes(n, consumer_heads), dtype=torch.uint8, device=dev
        )
        kt.pack_heads(
            src,
            src_pages,
            rank * consumer_heads,
            consumer_heads,
            staging,
            page_size=page_size,
            runs_per_page=runs,
        )
        kt.unpack_heads(
            staging, dst, dst_pages, 0, consumer_heads, page_size=page_size, runs_per_page=runs
        )
        got = logical(dst, page_size, runs)[slots_of(dst_pages, page_size)]
        want = logical(src, page_size, runs)[slots_of(src_pages, page_size)]
        assert torch.equal(got, want[:, rank * consumer_heads : (rank + 1) * consumer_heads]), (
            f"rank {rank}"
        )


def check_merge(
    layout_case, dtype, unit, rank_heads, consumer_heads, dev, num_pages=5, n=3, seed=2
):
    """Producer ranks with `rank_heads` heads each -> one consumer with all heads."""
    _, page_size, runs = layout_case
    gen = torch.Generator().manual_seed(seed)
    dst = poisoned((num_pages * page_size, consumer_heads, *unit), dtype, dev)
    dst_pages = random_pages(num_pages, n, dev, gen)
    sources = []
    for rank in range(consumer_heads // rank_heads):
        src = random_region(num_pages, page_size, rank_heads, unit, dtype, dev)
        src_pages = random_pages(num_pages, n, dev, gen)
        layout = kt.RunLayout.of(src, page_size, runs)
        staging = torch.empty(layout.staging_bytes(n, rank_heads), dtype=torch.uint8, device=dev)
        kt.pack_heads(
            src, src_pages, 0, rank_heads, staging, page_size=page_size, runs_per_page=runs
        )
        kt.unpack_heads(
            staging,
            dst,
            dst_pages,
            rank * rank_heads,
            rank_heads,
            page_size=page_size,
            runs_per_page=runs,
        )
        sources.append(logical(src, page_size, runs)[slots_of(src_pages, page_size)])
    got = logical(dst, page_size, runs)[slots_of(dst_pages, page_size)]
    assert torch.equal(got, torch.cat(sources, dim=1)), "merged heads differ"


CUTS = [(8, 2), (8, 4)]


@pytest.mark.parametrize("producer,consumer", CUTS, ids=[f"{p}to{c}" for p, c in CUTS])
@pytest.mark.parametrize("layout_case", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_split_heads_bf16(layout_case, producer, consumer):
    check_split(layout_case, torch.bfloat16, (16,), producer, consumer, device())


@pytest.mark.parametrize("layout_case", LAYOUTS[1:], ids=[c[0] for c in LAYOUTS[1:]])
def test_split_heads_fp8_and_scales(layout_case):
    check_split(layout_case, torch.float8_e4m3fn, (16,), 8, 2, device())
    check_split(layout_case, torch.float32, (), 8, 4, device())


@pytest.mark.parametrize("layout_case", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_merge_heads(layout_case):
    check_merge(layout_case, torch.bfloat16, (16,), 2, 8, device())


def check_whole_copy(dtype, index_dim, page_size, dev, num_pages=6, n=4, seed=3):
    """Replicated units: the index key `[slots, index_dim]` and its 1-D fp32 scale, page by page."""
    gen = torch.Generator().manual_seed(seed)
    for shape, dt in (
        ((num_pages * page_size, index_dim), dtype),
        ((num_pages * page_size,), torch.float32),
    ):
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev).view(dt).view(shape)
        src_pages, dst_pages = (
            random_pages(num_pages, n, dev, gen),
            random_pages(num_pages, n, dev, gen),
        )
        staging = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        out = kt.pack_pages(src, src_pages, staging, page_size=page_size)
        dst = poisoned(shape, dt, dev)
        kt.unpack_pages(out, dst, dst_pages, page_size=page_size)
        rows = lambda t, p: as_bytes(t).cpu().view(num_pages, -1)[p.cpu().long()]  # noqa: E731
        assert torch.equal(rows(dst, dst_pages), rows(src, src_pages)), f"whole copy {dt}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("page_size", [1, 16, 128], ids=lambda p: f"p{p}")
def test_whole_copy_index_key(dtype, page_size):
    check_whole_copy(dtype, 24, page_size, device())


def test_layout_errors():
    with pytest.raises(ValueError, match="must divide page_size"):
        kt.RunLayout(16, 8, 256, 3)
    src = torch.zeros(32, 8, 4)
    with pytest.raises(AssertionError, match="outside"):
        kt.pack_heads(
            src,
            torch.zeros(1, dtype=torch.int32),
            6,
            4,
            torch.empty(4096, dtype=torch.uint8),
            page_size=16,
        )


def random_jobs(dev: str, gen: torch.Generator, align: int, long_span: int):
    """Spans between three sources and two destinations, each span's destination bytes its own
    (a later span never overwrites an earlier one), offsets and lengths multiples of ``align``,
    one span ``long_span`` bytes (more than a program's piece when large)."""
    import numpy as np

    srcs = [
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).to(dev)
        for n in (long_span + 4096, 9000, 1000)
    ]
    dsts = [poisoned((n,), torch.uint8, dev) for n in (long_span + 8192, 6000)]
    free = [list(range(0, d.numel() // 256)) for d in dsts]  # 256-byte destination slots
    jobs = []
    for si, di, k, length in ((0, 0, 1, long_span), (1, 0, 9, 200), (2, 1, 7, 64), (1, 1, 5, 120)):
        rows = []
        for _ in range(k):
            slots = (length + 255) // 256
            pick = int(torch.randint(0, len(free[di]) - slots, (1,), generator=gen))
            if free[di][pick + slots - 1] - free[di][pick] != slots - 1:
                continue  # not contiguous free slots: skip this span
            dst_off = free[di][pick] * 256
            del free[di][pick : pick + slots]
            src_max = (srcs[si].numel() - length) // align
            src_off = int(torch.randint(0, src_max + 1, (1,), generator=gen)) * align
            rows.append((src_off, dst_off, length // align * align))
        jobs.append((srcs[si], dsts[di], np.array(rows, dtype=np.int64).reshape(-1, 3)))
    return srcs, dsts, jobs


@pytest.mark.parametrize("align", [1, 2, 8], ids=lambda a: f"align{a}")
def test_copy_spans_matches_reference(align):
    """Every span lands byte-exact, in one launch; the rest of each destination keeps its poison."""
    dev = device()
    gen = torch.Generator().manual_seed(align)
    long_span = (1 << 16) * 8 + 40 if dev == "cuda" else 3 * 1024 + 8  # several pieces on CUDA
    srcs, dsts, jobs = random_jobs(dev, gen, align, long_span)
    expect = [d.clone() for d in dsts]
    for s, d, rows in jobs:
        e = expect[next(i for i, x in enumerate(dsts) if x is d)]
        for a, b, n in rows.tolist():
            e[b : b + n] = s[a : a + n]
    moved = kt.copy_spans(jobs)
    assert moved == sum(int(r[:, 2].sum()) for _, _, r in jobs)
    for got, want in zip(dsts, expect, strict=True):
        assert torch.equal(got.cpu(), want.cpu())


def test_copy_spans_pieces_and_width():
    """Long spans are cut into pieces of at most _PIECE elements that cover them exactly; the
    element is the widest dividing every address and length."""
    import numpy as np
    from sgl_atom.kernels.kv_transfer import spans as sp

    src, dst = torch.zeros(1 << 22, dtype=torch.uint8), torch.zeros(1 << 22, dtype=torch.uint8)
    rows = np.array([[0, 8, sp._PIECE * 8 * 2 + 16], [1 << 21, 0, 8]], dtype=np.int64)
    _, _, table, width = sp.piece_table([(src, dst, rows)])
    assert width == 8 and table.shape[1] == 4
    assert table[2].tolist() == [sp._PIECE, sp._PIECE, 2, 1]
    assert table[0].tolist()[:3] == [0, sp._PIECE, 2 * sp._PIECE]
    rows[1, 2] = 6  # a 6-byte span: 2-byte elements
    assert sp.piece_table([(src, dst, rows)])[3] == 2


def test_copy_spans_refuses_out_of_bounds_before_copying():
    import numpy as np

    dev = device()
    src = torch.randint(0, 256, (256,), dtype=torch.uint8).to(dev)
    dst = poisoned((128,), torch.uint8, dev)
    before = dst.clone()
    good = np.array([[0, 0, 64]], dtype=np.int64)
    bad = np.array([[0, 100, 64]], dtype=np.int64)  # writes past dst
    with pytest.raises(AssertionError, match="writes past dst"):
        kt.copy_spans([(src, dst, good), (src, dst, bad)])
    assert torch.equal(dst, before)
