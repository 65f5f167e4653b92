"""NixlEngine moves a planned head cut between two processes over UCX on loopback.

The consumer runs in a spawned process: it registers zeroed K/V buffers, sends its NIXL
metadata and buffer addresses over a pipe, waits for the producer's notification and sends its
buffers back for checking.
"""

import multiprocessing as mp
import time
from contextlib import contextmanager

import pytest
import torch

from sgl_atom.disagg import build_rank_regions, plan_transfer

pytest.importorskip("nixl._api", reason="NIXL is not installed (pip install nixl==1.5.1)")

from sgl_atom.disagg.engine import NixlEngine, TransferError, coalesce  # noqa: E402

HEADS, DIM, PAGE, PAGES = 4, 8, 16, 5
SRC_PAGES, DST_PAGES = [3, 0, 4], [1, 4, 2]
LOOPBACK = {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,self"}


@pytest.fixture(autouse=True)
def _loopback(monkeypatch):
    for key, value in LOOPBACK.items():
        monkeypatch.setenv(key, value)


def _regions(rank: int, tp: int):
    return build_rank_regions(
        layers=[0], tp_rank=rank, tp_size=tp, kv_heads=HEADS, head_dim=DIM, dtype="bf16",
        page_size=PAGE,
    )  # fmt: skip


def _consumer(conn, heads: int, wait_tag: bytes | None) -> None:
    engine = NixlEngine("consumer")
    try:
        bufs = {k: torch.zeros(PAGES * PAGE, heads, DIM, dtype=torch.bfloat16) for k in "kv"}
        addrs = engine.register(bufs)
        conn.send((engine.metadata(), addrs))  # metadata after registering: it lists the memory
        if wait_tag is None:
            conn.recv()  # parked until the parent kills us
            return
        deadline = time.monotonic() + 20
        while not engine.notified("producer", wait_tag):
            if time.monotonic() > deadline:
                conn.send(None)
                return
            time.sleep(0.001)
        conn.send({k: b.view(torch.int16).numpy().copy() for k, b in bufs.items()})  # by value
    finally:
        engine.close()


# the consumer's first message: a spawned interpreter importing torch and starting NIXL, which
# on a loaded 2-core host (the e2e servers of the same CI run) took past 30 s
CONSUMER_START_S = 120.0


def _spawn(heads: int, wait_tag: bytes | None):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(child, heads, wait_tag), daemon=True)
    proc.start()
    return proc, parent


def _stop(proc) -> None:
    proc.terminate()
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def _recv(conn, timeout_s: float):
    if not conn.poll(timeout_s):
        raise AssertionError(f"consumer sent nothing within {timeout_s} s")
    return conn.recv()


def _assert_landed(src: dict, got: dict) -> None:
    """Decode rank 1 of 2 holds heads 2..3 of SRC_PAGES at DST_PAGES, and nothing else."""
    for k in "kv":
        want = torch.zeros(PAGES * PAGE, HEADS // 2, DIM, dtype=torch.bfloat16)
        for sp, dp in zip(SRC_PAGES, DST_PAGES, strict=True):
            want[dp * PAGE : (dp + 1) * PAGE] = src[k][sp * PAGE : (sp + 1) * PAGE, 2:]
        out = torch.from_numpy(got[k])
        assert torch.equal(out, want.view(torch.int16)), f"region {k}"
        untouched = [p for p in range(PAGES) if p not in DST_PAGES]
        assert not out.view(PAGES, -1)[untouched].any(), f"region {k}: stray bytes"


@contextmanager
def _head_split(names: tuple[str, str], seed: int, progress_thread: bool = True):
    """A producer engine with random bf16 K/V registered as ``names`` and a consumer process
    holding 2 of the 4 heads, waiting for b"kv-done": (producer, src, the consumer's {k|v:
    (address, bytes)}, its pipe)."""
    torch.manual_seed(seed)
    src = {k: torch.randn(PAGES * PAGE, HEADS, DIM).to(torch.bfloat16) for k in "kv"}
    proc, conn = _spawn(HEADS // 2, b"kv-done")
    producer = NixlEngine("producer", progress_thread=progress_thread)
    try:
        meta, dst = _recv(conn, CONSUMER_START_S)
        producer.register({name: src[k] for name, k in zip(names, "kv", strict=True)})
        producer.add_peer("consumer", meta, regions=dict(dst.values()))
        yield producer, src, dst, conn
    finally:
        producer.close()
        _stop(proc)


def test_coalesce_merges_only_runs_contiguous_on_both_sides():
    import numpy as np

    rows = np.array([[0, 100, 8], [8, 108, 8], [16, 200, 8], [40, 208, 8]], dtype=np.uint64)
    assert coalesce(rows).tolist() == [[0, 100, 16], [16, 200, 8], [40, 208, 8]]


@pytest.mark.parametrize("progress_thread", [True, False])
def test_write_tp1_to_tp2_head_split_lands_exact_bytes(progress_thread):
    """Also with a producer without NIXL's progress thread (SGL_ATOM_PD_NIXL_PROGRESS_THREAD=0
    on a prefill): its writes land as it polls them, and the notification arrives."""
    plan = plan_transfer(_regions(0, 1), 0, 1, _regions(1, 2), 1, 2)
    assert [p.mode for p in plan.pairs] == ["split", "split"]
    with _head_split(("k", "v"), 0, progress_thread) as (producer, src, dst, conn):
        for name, pair in zip("kv", plan.pairs, strict=True):
            spans = pair.spans(SRC_PAGES, DST_PAGES)
            notif = b"kv-done" if name == "v" else b""
            producer.wait(producer.write("consumer", spans, name, dst[name][0], notif), 10)
        got = _recv(conn, 20)
        assert got is not None, "consumer saw no notification"
    _assert_landed(src, got)


def test_write_many_posts_every_region_in_one_write_or_nothing():
    """Both regions' spans go in one WRITE; a call with one bad item posts none of its items."""
    plan = plan_transfer(_regions(0, 1), 0, 1, _regions(1, 2), 1, 2)
    with _head_split(("k", "v"), 1) as (producer, src, dst, conn):
        items = [
            (pair.spans(SRC_PAGES, DST_PAGES), name, dst[name][0])
            for name, pair in zip("kv", plan.pairs, strict=True)
        ]
        addr_v, n_v = dst["v"]
        stray = ([(0, 0, 64)], "k", dst["k"][0])  # into page 0, which no later write touches
        with pytest.raises(TransferError, match="write up to"):
            producer.write_many("consumer", [stray, ([(0, n_v - 4, 8)], "v", addr_v)])
        handles = producer.write_many("consumer", items, b"kv-done")
        assert len(handles) == 1
        assert handles[0].nbytes == sum(int(n) for spans, _, _ in items for *_, n in spans)
        producer.wait(handles[0], 10)
        got = _recv(conn, 20)
        assert got is not None, "consumer saw no notification"
    _assert_landed(src, got)  # page 0 of k holds no stray bytes from the refused call


def test_write_many_moves_whole_pages_from_one_list_of_page_runs():
    """Whole-page regions (TP1 -> TP1) posted as (page runs, regions): every region moves the
    runs, in one WRITE; a run past the peer's region posts nothing."""
    import numpy as np

    from sgl_atom.disagg.engine import page_runs

    plan = plan_transfer(_regions(0, 1), 0, 1, _regions(0, 1), 0, 1)
    assert all(p.whole_pages for p in plan.pairs)
    torch.manual_seed(4)
    src = {k: torch.randn(PAGES * PAGE, HEADS, DIM).to(torch.bfloat16) for k in "kv"}
    proc, conn = _spawn(HEADS, b"kv-done")
    producer = NixlEngine("producer")
    try:
        meta, dst = _recv(conn, CONSUMER_START_S)
        producer.register(src)
        producer.add_peer("consumer", meta, regions=dict(dst.values()))
        src_pages, dst_pages = np.array([3, 4, 0]), np.array([1, 2, 4])
        runs = page_runs(src_pages, dst_pages)
        assert runs.tolist() == [[3, 1, 2], [0, 4, 1]]
        regions = [(k, dst[k][0], p.src_page_bytes) for k, p in zip("kv", plan.pairs, strict=True)]
        with pytest.raises(TransferError, match="pages write up to byte"):
            producer.write_many("consumer", [], pages=(np.array([[0, PAGES - 1, 2]]), regions))
        handles = producer.write_many("consumer", [], b"kv-done", pages=(runs, regions))
        assert len(handles) == 1 and handles[0].spans == 4
        assert handles[0].nbytes == 2 * 3 * plan.pairs[0].src_page_bytes
        producer.wait(handles[0], 10)
        got = _recv(conn, 20)
        assert got is not None, "consumer saw no notification"
    finally:
        producer.close()
        _stop(proc)
    for k in "kv":
        want = torch.zeros(PAGES * PAGE, HEADS, DIM, dtype=torch.bfloat16)
        for sp, dp in zip(src_pages.tolist(), dst_pages.tolist(), strict=True):
            want[dp * PAGE : (dp + 1) * PAGE] = src[k][sp * PAGE : (sp + 1) * PAGE]
        assert torch.equal(torch.from_numpy(got[k]), want.view(torch.int16)), f"region {k}"


def test_write_refuses_spans_outside_the_regions():
    proc, conn = _spawn(HEADS, None)
    producer = NixlEngine("producer")
    try:
        meta, dst = _recv(conn, CONSUMER_START_S)
        (addr, n), _ = dst.values()
        producer.register({"k": torch.zeros(n, dtype=torch.uint8)})
        producer.add_peer("consumer", meta, regions=dict(dst.values()))
        with pytest.raises(TransferError, match="read up to"):
            producer.write("consumer", [(n - 4, 0, 8)], "k", addr)
        with pytest.raises(TransferError, match="write up to"):
            producer.write("consumer", [(0, n - 4, 8)], "k", addr)
        with pytest.raises(TransferError, match="not the base"):
            producer.write("consumer", [(0, 0, 8)], "k", addr + 64)
    finally:
        producer.close()
        _stop(proc)


def test_write_to_dead_peer_raises_within_timeout():
    proc, conn = _spawn(HEADS, None)
    producer = NixlEngine("producer")
    try:
        meta, dst = _recv(conn, CONSUMER_START_S)
        (addr, n), _ = dst.values()
        producer.register({"k": torch.ones(n, dtype=torch.uint8)})
        producer.add_peer("consumer", meta)
        _stop(proc)
        start = time.monotonic()
        with pytest.raises(TransferError):
            producer.wait(producer.write("consumer", [(0, 0, n)], "k", addr, b"x"), 5)
        assert time.monotonic() - start < 10
    finally:
        producer.close()
        _stop(proc)


def test_add_peer_refuses_metadata_of_another_agent():
    other = NixlEngine("someone-else")
    producer = NixlEngine("producer")
    try:
        with pytest.raises(TransferError, match="belongs to agent 'someone-else'"):
            producer.add_peer("consumer", other.metadata())
    finally:
        producer.close()
        other.close()


class _StuckWrite:
    """A posted WRITE that never leaves PROC (a peer that died mid-transfer); counts releases."""

    released = 0

    def release(self):
        _StuckWrite.released += 1


def _stuck_engine(polls: list):
    from types import SimpleNamespace

    from sgl_atom.disagg.engine import WriteHandle

    engine = object.__new__(NixlEngine)  # no agent: only wait()'s polling is exercised
    engine.name = "prefill"
    engine._agent = SimpleNamespace(check_xfer_state=lambda xfer: polls.append(xfer) or "PROC")
    return engine, WriteHandle(_StuckWrite(), "decode", 3, 4096, "PROC")


def test_wait_is_abandoned_as_soon_as_asked_not_at_its_timeout():
    polls: list = []
    engine, handle = _stuck_engine(polls)
    asked = []
    failed_at = time.monotonic() + 0.2  # the room fails 0.2 s into the wait

    def abandon():
        asked.append(time.monotonic())
        return "the room failed" if time.monotonic() >= failed_at else None

    t0, before = time.monotonic(), _StuckWrite.released
    with pytest.raises(TransferError, match="abandoned while PROC: the room failed") as err:
        engine.wait(handle, timeout_s=30.0, abandon=abandon)
    took = time.monotonic() - t0
    assert 0.2 <= took < 2.0, took
    assert "prefill -> decode" in str(err.value) and polls
    assert len(asked) >= 5  # asked while polling, not once
    assert _StuckWrite.released == before + 1  # the request is released


def test_wait_without_abandon_times_out_naming_the_state():
    engine, handle = _stuck_engine([])
    with pytest.raises(TransferError, match="still PROC after 0.3 s"):
        engine.wait(handle, timeout_s=0.3)


def test_packed_head_split_lands_exact_bytes_in_fewer_descriptors():
    """The producer's staging path (stage.py): TP1 -> TP2, the consumer's heads gathered into
    whole decode pages, written in rounds through a buffer of two pages (so it is reused), lands
    the same bytes as the span-by-span path in fewer NIXL descriptors."""
    from sgl_atom.disagg.stage import Stager, packs

    plan = plan_transfer(_regions(0, 1), 0, 1, _regions(1, 2), 1, 2)
    assert all(packs(p) for p in plan.pairs)
    waited = []
    with _head_split(("r0", "r1"), 1) as (producer, src, dst, conn):
        stager = Stager(producer, [src["k"], src["v"]], 2 * plan.pairs[0].dst_page_bytes)
        jobs = [(pair, dst[k][0]) for k, pair in zip("kv", plan.pairs, strict=True)]

        def wait(h):
            producer.wait(h, 10)
            waited.append(h)

        landed, pending = stager.write("consumer", jobs, SRC_PAGES, DST_PAGES, wait)
        assert landed == waited and len(landed) >= 2, "a two-page buffer took more rounds"
        for h in pending:
            wait(h)
        descriptors = sum(h.spans for h in waited)
        span_path = sum(len(p.spans(SRC_PAGES, DST_PAGES)) for p in plan.pairs)
        assert descriptors <= len(SRC_PAGES) * len(plan.pairs) < span_path
        first = plan.pairs[0].spans(SRC_PAGES, DST_PAGES)[:1]  # same bytes again, to notify
        producer.wait(producer.write("consumer", first, "r0", dst["k"][0], b"kv-done"), 10)
        got = _recv(conn, 20)
        assert got is not None, "consumer saw no notification"
    _assert_landed(src, got)


def test_staging_refuses_a_page_larger_than_its_buffer():
    from sgl_atom.disagg.stage import Stager

    pair = plan_transfer(_regions(0, 1), 0, 1, _regions(1, 2), 1, 2).pairs[0]
    stager = Stager(object(), [torch.zeros(PAGES * PAGE, HEADS, DIM)], pair.dst_page_bytes - 1)
    stager.buf = torch.empty(stager.capacity, dtype=torch.uint8)  # nothing to register
    with pytest.raises(ValueError, match="SGL_ATOM_PD_STAGING_MB: a page of .* more than"):
        stager.write("consumer", [(pair, 0)], [0], [0], lambda h: None)
