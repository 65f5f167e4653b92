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
