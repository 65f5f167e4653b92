"""NixlEngine vs a raw NIXL WRITE: the same 64 MiB between two processes on one host.

    python benchmarks/bench_disagg_engine.py [--mib 64] [--reps 5] [--out benchmarks/results]

A spawned consumer registers a zeroed buffer and sends its NIXL metadata over a pipe. The
producer then times, interleaved rep by rep:
  raw      one NIXL WRITE of the whole contiguous region (nixl_agent API, one descriptor),
           polled on the engine's schedule
  engine   NixlEngine.write of the spans a TP1->TP1 plan gives for every page in order
           (spans computed inside the timed section; the engine coalesces them)
  shuffled the same through NixlEngine with the pages in random order: one descriptor per page,
           reported for scale only
  regions  the buffer as 64 regions (a pool's layers x K/V), one NixlEngine.write per region,
           all posted then all waited for (the P/D backend's former way)
  one-write the same 64 regions through NixlEngine.write_many: one WRITE carrying 64
           descriptors (one prebuilt span per region)
  page-spans the same 64 regions as 2 KiB pages (one token of 8 heads x 128 in bf16): each
           region's per-page spans built inside the timed section, then checked, coalesced
           and turned into descriptors region by region in one write_many (the P/D backend's
           former way)
  page-runs the same pages as one list of page runs built once, every region's descriptors
           from it at once (write_many(pages=...), the P/D backend's way)
The consumer's buffer is hashed after the raw and engine paths (zeroed between them) and must
equal the source. UCX runs over TCP on loopback (UCX_NET_DEVICES=lo, UCX_TLS=tcp,self).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import statistics
import sys
import time

LOOPBACK = {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,self"}
HEADS, DIM, PAGE = 8, 128, 16  # bf16: 32 KiB per page
REGIONS = 64
TOKEN_PAGE = HEADS * DIM * 2  # bytes of a 1-token page: SGLang's default page size


def _consumer(conn, nbytes: int) -> None:
    import torch

    from sgl_atom.disagg.engine import NixlEngine

    engine = NixlEngine("consumer")
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    addrs = engine.register({"dst": buf})
    conn.send((engine.metadata(), addrs["dst"]))
    while (cmd := conn.recv()) != "stop":
        if cmd == "zero":
            buf.zero_()
            conn.send(True)
        elif cmd == "hash":
            conn.send(hashlib.sha256(buf.numpy().tobytes()).hexdigest())
    engine.close()


def _raw_write(agent, local, remote) -> float:
    start = time.perf_counter()
    xfer = agent.initialize_xfer("WRITE", local, remote, "consumer", b"")
    state, delay = agent.transfer(xfer), 1e-5
    while state == "PROC":  # the engine's polling schedule: a busy loop starves UCX's threads
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)
        state = agent.check_xfer_state(xfer)
    xfer.release()
    assert state == "DONE", f"raw WRITE ended in {state}"
    return time.perf_counter() - start


def _engine_write(engine, pair, pages, dst_addr) -> float:
    start = time.perf_counter()
    engine.wait(engine.write("consumer", pair.spans(pages, pages), "src", dst_addr), 60)
    return time.perf_counter() - start


def _regions_write(engine, items, many: bool) -> float:
    start = time.perf_counter()
    if many:
        handles = engine.write_many("consumer", items)
    else:
        handles = [engine.write("consumer", *item) for item in items]
    for h in handles:
        engine.wait(h, 60)
    return time.perf_counter() - start


def _pages_write(engine, regions, pages, page_bytes: int, runs: bool) -> float:
    import numpy as np

    from sgl_atom.disagg.engine import page_runs

    start = time.perf_counter()
    if runs:
        spec = [(name, addr, page_bytes) for name, addr in regions]
        handles = engine.write_many("consumer", [], pages=(page_runs(pages, pages), spec))
    else:
        items = []
        for name, addr in regions:
            off = pages * page_bytes
            spans = np.stack([off, off, np.full(len(pages), page_bytes, dtype=np.int64)], axis=1)
            items.append((spans, name, addr))
        handles = engine.write_many("consumer", items)
    for h in handles:
        engine.wait(h, 60)
    return time.perf_counter() - start


def _check(conn, want: str, what: str) -> None:
    conn.send("hash")
    got = conn.recv()
    if got != want:
        sys.exit(f"{what}: consumer bytes differ from the source ({got} != {want})")
    conn.send("zero")
    conn.recv()


def run(mib: int, reps: int) -> dict[str, list[float]]:
    import numpy as np
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    from sgl_atom.disagg import build_rank_regions, plan_transfer
    from sgl_atom.disagg.engine import NixlEngine

    regions = build_rank_regions(
        layers=[0], tp_rank=0, tp_size=1, kv_heads=HEADS, head_dim=DIM, dtype="bf16",
        page_size=PAGE,
    )  # fmt: skip
    pair = plan_transfer(regions, 0, 1, regions, 0, 1).pairs[0]
    nbytes = mib << 20
    n_pages = nbytes // pair.src_page_bytes
    assert n_pages * pair.src_page_bytes == nbytes, "MiB must be a whole number of pages"
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    want = hashlib.sha256(src.numpy().tobytes()).hexdigest()

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(child, nbytes), daemon=True)
    proc.start()
    engine = NixlEngine("producer")
    raw = nixl_agent("producer-raw", nixl_agent_config(backends=["UCX"]))
    try:
        meta, (dst_addr, dst_len) = conn.recv()
        src_addr, src_len = engine.register({"src": src})["src"]
        raw_reg = raw.register_memory([(src_addr, src_len, 0, "src")], "DRAM")
        engine.add_peer("consumer", meta, regions={dst_addr: dst_len})
        assert raw.add_remote_agent(meta) in ("consumer", b"consumer")
        local = raw.get_xfer_descs([(src_addr, src_len, 0)], "DRAM")
        remote = raw.get_xfer_descs([(dst_addr, dst_len, 0)], "DRAM")
        in_order = list(range(n_pages))
        shuffled = np.random.default_rng(0).permutation(n_pages).tolist()
        times = {"raw": [], "engine": [], "shuffled": []}
        _raw_write(raw, local, remote)  # connect and warm up both paths
        _engine_write(engine, pair, in_order, dst_addr)
        for _ in range(reps):
            times["raw"].append(_raw_write(raw, local, remote))
            times["engine"].append(_engine_write(engine, pair, in_order, dst_addr))
        _check(conn, want, "engine")
        _raw_write(raw, local, remote)
        _check(conn, want, "raw")
        for _ in range(reps):
            times["shuffled"].append(_engine_write(engine, pair, shuffled, dst_addr))
        # the same bytes as REGIONS regions of a second engine (a pool's layers x K/V)
        part = nbytes // REGIONS
        cut = NixlEngine("producer-regions")
        try:
            cut.register({f"r{i}": src[i * part : (i + 1) * part] for i in range(REGIONS)})
            cut.add_peer(
                "consumer", meta, regions={dst_addr + i * part: part for i in range(REGIONS)}
            )
            items = [([(0, 0, part)], f"r{i}", dst_addr + i * part) for i in range(REGIONS)]
            times["regions"], times["one-write"] = [], []
            _regions_write(cut, items, False)  # connect and warm up
            _regions_write(cut, items, True)
            _check(conn, want, "one-write")
            for _ in range(reps):
                times["regions"].append(_regions_write(cut, items, False))
                times["one-write"].append(_regions_write(cut, items, True))
            _check(conn, want, "regions and one-write")
            named = [(f"r{i}", dst_addr + i * part) for i in range(REGIONS)]
            pages = np.arange(part // TOKEN_PAGE, dtype=np.int64)
            times["page-spans"], times["page-runs"] = [], []
            for runs in (False, True):  # warm up
                _pages_write(cut, named, pages, TOKEN_PAGE, runs)
            for _ in range(reps):
                for runs, path in ((False, "page-spans"), (True, "page-runs")):
                    times[path].append(_pages_write(cut, named, pages, TOKEN_PAGE, runs))
            _check(conn, want, "page-spans and page-runs")
        finally:
            cut.close()
        raw.remove_remote_agent("consumer")
        raw.deregister_memory(raw_reg)
        conn.send("stop")
        proc.join(10)
        return times
    finally:
        engine.close()
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def table(times: dict[str, list[float]], mib: int, n_pages: int) -> str:
    base = statistics.median(times["raw"])
    per = (mib << 20) // REGIONS // TOKEN_PAGE
    descs = {"raw": "1", "engine": f"{n_pages} -> 1", "shuffled": str(n_pages),
             "regions": f"{REGIONS} WRITEs", "one-write": f"{REGIONS} in 1 WRITE",
             "page-spans": f"{REGIONS}x{per} -> {REGIONS}",
             "page-runs": f"{REGIONS}x{per} -> {REGIONS}"}  # fmt: skip
    head = ["path", "MiB", "spans", "median s", "best s", "GiB/s (median)", "overhead %"]
    rows = []
    for path, ts in times.items():
        med = statistics.median(ts)
        over = "-" if path == "raw" else f"{100 * (med / base - 1):+.1f}"
        rows.append([path, str(mib), descs[path], f"{med:.4f}", f"{min(ts):.4f}",
                     f"{mib / 1024 / med:.2f}", over])  # fmt: skip
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = "| " + " | ".join(f"{{:<{w}}}" for w in widths) + " |"
    lines = [fmt.format(*head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    return "\n".join(lines + [fmt.format(*r) for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    for key, value in LOOPBACK.items():
        os.environ.setdefault(key, value)
    times = run(args.mib, args.reps)
    n_pages = (args.mib << 20) // (PAGE * HEADS * DIM * 2)
    out = table(times, args.mib, n_pages)
    print(out)
    per_rep = "\n".join(
        f"- {path}: " + ", ".join(f"{t:.4f}" for t in ts) + " s" for path, ts in times.items()
    )
    cmd = "python benchmarks/bench_disagg_engine.py " + " ".join(sys.argv[1:])
    env = ", ".join(f"{k}={os.environ[k]}" for k in LOOPBACK)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "disagg_engine.md"), "w") as f:
        f.write(_report(cmd.strip(), env, args, out, per_rep))


def _report(cmd, env, args, out, per_rep) -> str:
    return f"""# NixlEngine vs raw NIXL WRITE, {args.mib} MiB, two processes on one host

- date: {time.strftime("%Y-%m-%d")}; machine: CPU host ({os.cpu_count()} cores, shared), no GPU;
  NIXL 1.5.1, UCX backend over loopback TCP ({env}); source and destination are DRAM (CPU tensors)
- command: `{cmd}`
- {args.reps} reps per path, raw and engine interleaved rep by rep, after one warm-up each;
  the consumer's buffer is hashed after the raw and engine paths and equals the source
- engine: spans of a TP1->TP1 plan over {PAGE}-token pages of a bf16 `[slots, {HEADS}, {DIM}]`
  region, every page in order, spans computed inside the timed section; shuffled: pages in
  random order (one descriptor per page), for scale only; regions / one-write: the buffer as
  {REGIONS} regions of a second engine, one WRITE each vs one WRITE for all (after the others,
  checked by hash); page-spans / page-runs: those regions as {TOKEN_PAGE}-byte pages (one token),
  descriptors built inside the timed section region by region, or for all regions from one list
  of page runs (checked by hash). Overhead is of the median vs raw.

{out}

Per rep:
{per_rep}
"""


if __name__ == "__main__":
    main()
