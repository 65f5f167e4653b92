"""NixlEngine over GPU memory: CUDA tensors are registered as NIXL VRAM and written GPU to GPU.

Run on the GPU machine with NIXL installed: `python -m pytest -q -s tests/gpu/test_nixl_vram.py`.
Two agents in one process (the producer and the consumer of a P/D pair); the spans are the
pages of one request in shuffled order, as the planner emits them. The destination is poisoned
first: the written bytes must equal the source exactly and every other byte must keep the
poison. A throughput line compares one large WRITE with a device-to-device ``copy_`` of the same
bytes (the measured ceiling).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
# sgl_atom.disagg needs pydantic, which the GPU machine gets with SGLang (part 2 of the bundle)
pytest.importorskip("pydantic", reason="sgl_atom.disagg needs pydantic: bring up SGLang first")

from sgl_atom.disagg.engine import DRAM, VRAM, NixlEngine, TransferError, mem_kind  # noqa: E402

PAGE_BYTES = 16 * 8 * 128 * 2  # a 16-token page of 8 bf16 heads of dim 128
PAGES = 512
POISON = 0xA5


@pytest.fixture(scope="module")
def engines():
    try:
        a, b = NixlEngine("vram-producer"), NixlEngine("vram-consumer")
    except TransferError as e:
        pytest.skip(f"NIXL not usable here: {e}")
    yield a, b
    a.close()
    b.close()


def _buffers(device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (PAGES * PAGE_BYTES,), dtype=torch.uint8, generator=g)
    dst = torch.full((PAGES * PAGE_BYTES,), POISON, dtype=torch.uint8)
    return src.to(device), dst.to(device)


def _spans(seed: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    src_pages = rng.permutation(PAGES)[:n]
    dst_pages = rng.permutation(PAGES)[:n]
    return np.stack(
        [src_pages * PAGE_BYTES, dst_pages * PAGE_BYTES, np.full(n, PAGE_BYTES)], axis=1
    ).astype(np.int64)


def _connect(a: NixlEngine, b: NixlEngine, dst: torch.Tensor) -> None:
    """Load the consumer's metadata afresh (it now holds dst's registration) with dst's kind."""
    a.remove_peer(b.name)
    a.add_peer(
        b.name,
        b.metadata(),
        regions={dst.data_ptr(): dst.numel()},
        kinds={dst.data_ptr(): mem_kind(dst)},
    )


CASES = [("cuda:0", "cuda:0"), ("cpu", "cuda:0"), ("cuda:0", "cpu"), ("cuda:0", "cuda:1")]


@pytest.mark.parametrize("src_dev,dst_dev", CASES, ids=lambda d: d.replace(":", ""))
def test_write_spans_between_memory_kinds(engines, src_dev, dst_dev):
    if "cuda:1" in (src_dev, dst_dev) and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    a, b = engines
    tag = f"{src_dev}-{dst_dev}".replace(":", "")
    src, dst = _buffers(src_dev, seed=len(tag))
    a.register({f"src-{tag}": src})
    b.register({f"dst-{tag}": dst})
    assert a.kind(f"src-{tag}") == mem_kind(src)
    assert mem_kind(dst)[0] == (VRAM if dst.is_cuda else DRAM)
    _connect(a, b, dst)
    spans = _spans(seed=7, n=PAGES // 2)
    a.wait(a.write(b.name, spans, f"src-{tag}", dst.data_ptr(), notif=tag.encode()))
    torch.cuda.synchronize()

    got, want = dst.cpu(), src.cpu()
    expect = torch.full_like(got, POISON)
    for s, d, n in spans:
        expect[d : d + n] = want[s : s + n]
    assert torch.equal(got, expect), f"{tag}: written bytes differ from the source pages"


def test_vram_write_throughput_vs_device_copy(engines):
    a, b = engines
    n = 256 * 2**20
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda:0")
    a.register({"big-src": src})
    b.register({"big-dst": dst})
    _connect(a, b, dst)
    one = np.array([[0, 0, n]], dtype=np.int64)
    starts = np.arange(0, n, PAGE_BYTES)
    shuffled = np.random.default_rng(0).permutation(starts)
    pages = np.stack([starts, shuffled, np.full(len(starts), PAGE_BYTES)], axis=1)

    def timed(fn, reps=5) -> float:
        fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best

    t_copy = timed(lambda: dst.copy_(src))
    dst.zero_()
    t_one = timed(lambda: a.wait(a.write(b.name, one, "big-src", dst.data_ptr())))
    assert torch.equal(dst, src)
    t_pages = timed(lambda: a.wait(a.write(b.name, pages, "big-src", dst.data_ptr())))

    def fig(t: float) -> str:
        return f"{t * 1e3:.2f} ms = {n / t / 1e9:.2f} GB/s ({t_copy / t:.4f} of copy_)"

    print(
        f"\n[nixl vram] 256 MiB on {torch.cuda.get_device_name(0)}: device copy_ {fig(t_copy)}; "
        f"NixlEngine one span {fig(t_one)}; {len(pages)} shuffled 32 KiB page spans "
        f"{fig(t_pages)}"
    )
