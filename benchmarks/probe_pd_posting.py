"""Where a P/D room's posting time goes on one host: the NIXL WRITE of a request's metadata rows
between two processes, and the CUDA IPC path's one copy launch, each timed on its own.

    python benchmarks/probe_pd_posting.py [--reps 50]

A spawned consumer registers 10 host buffers (a decode's metadata buffers: 64 rows of 64 B) and
sends its NIXL metadata over a pipe; the producer then posts one row of each buffer per request
as the prefill does (``NixlEngine.write_many(pages=...)``: one WRITE of 10 descriptors), and the
same through NIXL's prepared descriptor lists (``prep_xfer_dlist`` once, ``make_prepped_xfer``
per request). Reported: the host time to post and the time until landed, medians. On a GPU it
also times ``copy_addressed`` over 74 spans of 128 MiB (a 1K-token request of the 8B shape):
the host time to return from the launch, and until the copy is done.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NBUF, ROWS, ITEM = 10, 64, 64


def _consumer(conn) -> None:
    import torch

    from sgl_atom.disagg.engine import NixlEngine

    eng = NixlEngine("cons")
    bufs = {f"aux{i}": torch.zeros(ROWS * ITEM, dtype=torch.uint8) for i in range(NBUF)}
    regions = eng.register(bufs)  # before the metadata, which names the registered memory
    conn.send((eng.metadata(), regions))
    conn.recv()
    eng.close()


def _ms(xs: list[float]) -> str:
    return f"median {statistics.median(xs) * 1e3:.3f} ms, min {min(xs) * 1e3:.3f} ms"


def nixl_rows(reps: int) -> None:
    import torch

    from sgl_atom.disagg.engine import NixlEngine, poll

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(child,), daemon=True)
    proc.start()
    eng = NixlEngine("prod")
    try:
        meta, regs = parent.recv()
        src = {f"aux{i}": torch.zeros(ROWS * ITEM, dtype=torch.uint8) for i in range(NBUF)}
        eng.register(src)
        eng.add_peer("cons", meta, regions=dict(regs.values()))
        rows = [(f"aux{i}", regs[f"aux{i}"][0], ITEM) for i in range(NBUF)]
        post, total = [], []
        for r in range(reps + 3):
            t0 = time.perf_counter()
            handles = eng.write_many("cons", [], pages=(np.array([[r % ROWS] * 2 + [1]]), rows))
            t1 = time.perf_counter()
            for h in handles:
                eng.wait(h, 10)
            if r >= 3:
                post.append(t1 - t0)
                total.append(time.perf_counter() - t0)
        print(f"metadata rows, write_many: posting {_ms(post)}; landed {_ms(total)}")
        ag = eng._agent
        loc = [
            [src[f"aux{i}"].data_ptr() + r * ITEM, ITEM, 0]
            for i in range(NBUF)
            for r in range(ROWS)
        ]
        rem = [[regs[f"aux{i}"][0] + r * ITEM, ITEM, 0] for i in range(NBUF) for r in range(ROWS)]
        lh = ag.prep_xfer_dlist(
            "NIXL_INIT_AGENT", ag.get_xfer_descs(np.array(loc, np.uint64), "DRAM")
        )
        rh = ag.prep_xfer_dlist("cons", ag.get_xfer_descs(np.array(rem, np.uint64), "DRAM"))
        post, total = [], []
        for r in range(reps + 3):
            idx = [i * ROWS + r % ROWS for i in range(NBUF)]
            t0 = time.perf_counter()
            x = ag.make_prepped_xfer("WRITE", lh, idx, rh, idx)
            ag.transfer(x)
            t1 = time.perf_counter()
            # the engine's polling schedule: a busy loop would starve UCX's progress thread
            assert poll(lambda x=x: ag.check_xfer_state(x) != "PROC", 10) is None
            assert ag.check_xfer_state(x) == "DONE"
            ag.release_xfer_handle(x)
            if r >= 3:
                post.append(t1 - t0)
                total.append(time.perf_counter() - t0)
        print(f"metadata rows, prepped lists: posting {_ms(post)}; landed {_ms(total)}")
    finally:
        parent.send("done")
        eng.close()
        proc.join(10)


def ipc_copy(reps: int) -> None:
    import torch

    from kernels.kv_transfer import copy_addressed

    nbytes, spans = 128 << 20, 74
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    cuts = np.linspace(0, nbytes, spans + 1).astype(np.int64)
    off, lens = cuts[:-1], np.diff(cuts)
    stream = torch.cuda.Stream()
    post, total = [], []
    with torch.cuda.stream(stream):
        for r in range(reps + 3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            copy_addressed(src, dst, off, off, lens)
            t1 = time.perf_counter()
            stream.synchronize()
            if r >= 3:
                post.append(t1 - t0)
                total.append(time.perf_counter() - t0)
    assert torch.equal(src, dst)
    rate = nbytes / statistics.median(total) / 1e9
    print(f"CUDA IPC path, copy_addressed of {spans} spans, {nbytes >> 20} MiB: "
          f"launch {_ms(post)}; done {_ms(total)} ({rate:.0f} GB/s)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    import torch

    nixl_rows(args.reps)
    if torch.cuda.is_available():
        ipc_copy(args.reps)


if __name__ == "__main__":
    main()
