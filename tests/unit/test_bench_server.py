"""The server benchmark's M3 and P/D rows (benchmarks/server_m3.py, server_pd.py): the M3
checkpoint it writes is one sgl_atom's M3 class and the atom sparse kernels accept, the derived
figures (attention part of the step, sparse vs dense) follow from the measured tokens/s, and the
P/D rows read the transfer lines the atom backend writes."""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import server_m3 as m3  # noqa: E402
import server_pd as pd  # noqa: E402

from sgl_atom.attention.sparse import SparseConfig  # noqa: E402


@pytest.mark.parametrize("dense", [False, True])
def test_written_checkpoint_is_servable_at_the_m3_shape(tmp_path, dense):
    path = m3.write_m3(tmp_path, 6, dense)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["MiniMaxM3SparseForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (
        3072,
        48,
        8,
    )
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (256, 8)
    assert cfg["moe_layer_freq"] == [1] * 6 and cfg["num_hidden_layers"] == 6
    hf = SimpleNamespace(**cfg)
    sparse = SparseConfig.from_hf(hf, cfg["num_key_value_heads"], cfg["head_dim"])
    want = () if dense else tuple(range(6))
    assert sparse.sparse_layer_ids == want
    assert sparse.topk_blocks == 16 and sparse.index_dim == 128
    # the M3 class's own refusal (index value must be off on every sparse layer) passes
    from sgl_atom.models.minimax_m3 import MiniMaxM3SparseForCausalLM

    MiniMaxM3SparseForCausalLM._check_sparse(hf)


def _row(run, kind, batch, prompt, tok_s, **extra):
    return dict(
        model="m3-shape", kv="bf16", run=run, sparse=kind, batch=batch, prompt=prompt,
        decode_tok_s=tok_s, ttft_s=1.0, **extra,
    )  # fmt: skip


def test_derived_attention_share_and_ratios_follow_the_step_times():
    rng = random.Random()
    b, long = 16, 131072
    # step times (s): the short-context step is the non-attention cost of each model
    base_s, base_d = rng.uniform(0.01, 0.02), rng.uniform(0.01, 0.02)
    attn_s, attn_d = rng.uniform(0.001, 0.005), rng.uniform(0.05, 0.2)
    fp8 = rng.uniform(0.4, 0.6)  # the fp8-weight model's share of the non-attention step
    rows = [
        _row("r1", "sparse", b, m3.BASE_PROMPT, b / base_s),
        _row("r1", "sparse", b, long, b / (base_s + attn_s)),
        _row("r1", "dense", b, m3.BASE_PROMPT, b / base_d),
        _row("r1", "dense", b, long, b / (base_d + attn_d)),
        # another run's dense row of the same workload is not compared with r1's sparse one
        _row("r0", "dense", b, long, 1.0),
        # the same run with fp8 weights: compared with its own dense rows only
        _row("r1", "sparse", b, m3.BASE_PROMPT, b / (fp8 * base_s), weights="fp8"),
        _row("r1", "sparse", b, long, b / (fp8 * base_s + attn_s), weights="fp8"),
        _row("r1", "dense", b, m3.BASE_PROMPT, b / (fp8 * base_d), weights="fp8"),
        _row("r1", "dense", b, long, b / (fp8 * base_d + attn_d), weights="fp8"),
        # the same run's sparse model with fp8 index keys: beside the same dense rows
        _row("r1", "sparse", b, m3.BASE_PROMPT, b / base_s, index="fp8"),
        _row("r1", "sparse", b, long, b / (base_s + attn_s / 2), index="fp8"),
    ]
    d = m3.derive(rows)
    sparse = d[("r1", "bf16", "auto", "sparse", b, long)]
    assert sparse["attn_ms"] == pytest.approx(attn_s * 1e3)
    assert sparse["attn_share"] == pytest.approx(attn_s / (base_s + attn_s))
    assert sparse["vs_dense"] == pytest.approx((base_d + attn_d) / (base_s + attn_s))
    assert sparse["attn_vs_dense"] == pytest.approx(attn_d / attn_s)
    dense = d[("r1", "bf16", "-", "dense", b, long)]
    assert dense["attn_share"] == pytest.approx(attn_d / (base_d + attn_d))
    assert "vs_dense" not in dense
    # the baseline itself: compared with the dense model, no attention part of its own
    got = d[("r1", "bf16", "auto", "sparse", b, m3.BASE_PROMPT)]
    assert got == {"vs_dense": pytest.approx(base_d / base_s)}
    assert d[("r0", "bf16", "-", "dense", b, long)] == {}  # no baseline in its run
    quant = d[("r1", "fp8", "auto", "sparse", b, long)]
    assert quant["attn_ms"] == pytest.approx(attn_s * 1e3)
    want = (fp8 * base_d + attn_d) / (fp8 * base_s + attn_s)
    assert quant["vs_dense"] == pytest.approx(want)
    assert quant["attn_vs_dense"] == pytest.approx(attn_d / attn_s)
    fp8_index = d[("r1", "bf16", "fp8", "sparse", b, long)]
    assert fp8_index["attn_ms"] == pytest.approx(attn_s * 1e3 / 2)
    assert fp8_index["vs_dense"] == pytest.approx((base_d + attn_d) / (base_s + attn_s / 2))
    table = m3.m3_table(rows)
    assert "sparse bf16, fp8 index" in table
    assert f"{attn_d / attn_s:.1f}" in table and "16x131072" in table
    assert f"{want:.2f}" in table and f"{(base_d + attn_d) / (base_s + attn_s):.2f}" in table


def test_every_batch_gets_its_short_baseline_first():
    got = m3.with_base([(16, 131072), (1, 32768), (16, 32768)])
    assert got == [(1, m3.BASE_PROMPT), (1, 32768), (16, m3.BASE_PROMPT), (16, 32768), (16, 131072)]


def test_pd_rows_read_the_transfer_lines_the_backend_writes():
    from types import SimpleNamespace

    from sgl_atom.disagg.conn import TransferStats

    rng = random.Random()
    log, want = [], {}
    for room in rng.sample(range(1, 1 << 62), 5):
        stats = TransferStats()
        handles = [SimpleNamespace(nbytes=rng.randint(1, 1 << 31), spans=rng.randint(1, 99))]
        seconds = rng.uniform(1e-4, 0.5)
        stats.add(handles, seconds, rng.uniform(0, seconds))
        log.append(f"[12:00:00 sgl_atom] atom P/D: room {room}: {stats.describe(1)}")
        log.append("[12:00:00] Prefill batch, #new-seq: 1")  # other lines are skipped
        want[room] = (
            stats.nbytes,
            stats.descriptors,
            round(stats.seconds * 1e3, 2),
            round(stats.posting * 1e3, 2),
        )
    got = pd.transfers("\n".join(log))
    assert got == want
    moved = list(got.values())
    figures = pd.summarize([3.0, 1.0, 2.0], moved)
    nbytes = sorted(m[0] for m in moved)[2]
    ms = sorted(m[2] for m in moved)[2]
    assert figures["ttft_s"] == 2.0 and figures["kv_bytes"] == nbytes
    assert figures["posting_ms"] == sorted(m[3] for m in moved)[2]
    assert figures["transfer_gbps"] == pytest.approx(nbytes / (ms * 1e-3) / 1e9, abs=0.01)
    # a line of an older prefill, without the writes and posting tail, still reads
    old = TransferStats.logged(
        "atom P/D: room 9: 10 KV bytes in 2 descriptors to 1 decode rank(s), 1.50 ms"
    )
    assert old[9][0].nbytes == 10 and old[9][0].seconds == pytest.approx(1.5e-3)
    assert old[9][0].posting == 0.0


def test_pd_variants_parse_and_refuse_what_they_cannot_read():
    got = pd.parse_variants(
        "base:; rndv:UCX_RNDV_THRESH=0  UCX_RNDV_SCHEME=put_zcopy;w2:X=a=b;tls:UCX_TLS=tcp,self"
    )
    assert got == {
        "base": {},
        "rndv": {"UCX_RNDV_THRESH": "0", "UCX_RNDV_SCHEME": "put_zcopy"},
        "w2": {"X": "a=b"},  # the value keeps what follows the first "="
        "tls": {"UCX_TLS": "tcp,self"},  # and its commas
    }
    assert pd.parse_variants("") == {"": {}}
    assert pd.role("prefill", "") == "prefill" and pd.role("decode", "w2") == "decode-w2"
    for bad, why in [
        ("a:X=1;a:Y=2", "given twice"),
        (":X=1", "needs a name"),
        ("a b:X=1", "needs a name"),
        ("a:X", "not KEY=VALUE"),
        ("a:=1", "not KEY=VALUE"),
    ]:
        with pytest.raises(ValueError, match=why):
            pd.parse_variants(bad)


def test_pd_table_names_each_variant_and_its_posting_time():
    rng = random.Random()
    base = {"model": "m", "batch": 1, "prompt": 4096, "run": "r1"}
    unified = {**base, "pd": "unified", "ttft_s": rng.uniform(0.1, 0.2)}
    pairs = [
        {**base, "pd": "pair", "pd_variant": v, "ttft_s": rng.uniform(0.2, 0.3),
         "kv_bytes": 2**29, "descriptors": 74, "transfer_ms": 9.0,
         "posting_ms": round(rng.uniform(1, 8), 2), "transfer_gbps": 59.7}
        for v in ("zz", "aa")
    ]  # fmt: skip
    table = pd.pd_table([pairs[0], unified, pairs[1]])
    lines = [ln for ln in table.splitlines() if ln.startswith("| m ")]
    assert [ln.split("|")[3].strip() for ln in lines] == ["unified", "pair (aa)", "pair (zz)"]
    for p in pairs:
        line = next(ln for ln in lines if f"pair ({p['pd_variant']})" in ln)
        assert f"{p['ttft_s'] / unified['ttft_s']:.2f}" in line and f"{p['posting_ms']:.3g}" in line


def test_spec_table_sets_each_dspark_step_beside_both_plain_decodes():
    """The DSpark step over the plain decode with and without overlap scheduling
    (``--serial-plain``): a step making batch x accept tokens at rate r took accept x plain / r
    plain steps; rows of one workload sit together, the plain ones first."""
    import server_dspark as dspark

    rng = random.Random()
    plain, accept = rng.uniform(100, 5000), rng.choice([4, 6])
    serial = plain * rng.uniform(0.5, 0.8)  # the table keeps 3 significant digits
    # a step of 1 to 2 plain steps, as a speculative step takes (the table rounds ratios to
    # 3 decimals: a ratio far below 1 would lose the relative precision checked below)
    rate = accept * plain / rng.uniform(1.0, 2.0)
    base = {"model": "m", "backend": "atom", "batch": 16, "prompt": 4096, "run": "r",
            "ttft_s": 1.0}  # fmt: skip
    spec = {**base, "spec": "dspark", "block": 4, "forced_accept": accept - 1, "draft_kv": "bf16",
            "accept_len": accept, "decode_tok_s": rate,
            "step_ratio": round(dspark.step_ratio(rate, accept, plain), 3),
            "step_ratio_serial": round(dspark.step_ratio(rate, accept, serial), 3)}  # fmt: skip
    other = {**base, "batch": 1, "spec": "none", "decode_tok_s": 10.0}
    rows = [spec, {**base, "spec": dspark.SERIAL, "decode_tok_s": serial}, other,
            {**base, "spec": "none", "decode_tok_s": plain}]  # fmt: skip
    lines = [ln for ln in dspark.spec_table(rows).splitlines() if ln.startswith("| m ")]
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    assert [c[1:3] for c in cells] == [
        ["1x4096", "plain"], ["16x4096", "plain"], ["16x4096", "plain, no overlap"],
        ["16x4096", "k=4 forced " + str(accept - 1)],
    ]  # fmt: skip
    assert float(cells[3][7]) == pytest.approx(accept * plain / rate, rel=5e-3)
    assert float(cells[3][8]) == pytest.approx(accept * serial / rate, rel=5e-3)


def _synthetic_trace(rng: random.Random, steps: int):
    """A Chrome trace of ``steps`` decode steps: per step a graph launch, then kernels back to
    back (one overlapping its neighbour, on a second stream), then a GPU idle gap covered by a
    host op; with the figures analyze() must find."""
    events, t = [], 1000.0
    kernel_ms: dict[str, float] = {}
    busy = idle = 0.0
    gaps = []
    for step in range(steps):
        events.append(dict(ph="X", cat="cuda_runtime", name="cudaGraphLaunch", ts=t - 5, dur=3))
        start = t
        for name in ("gemm", "attn", "gemm"):
            dur = rng.uniform(50, 400)
            events.append(dict(ph="X", cat="kernel", name=name, ts=t, dur=dur))
            kernel_ms[name] = kernel_ms.get(name, 0.0) + dur / 1e3
            t += dur
        # a copy on another stream, inside the busy span: counted once in the busy time
        events.append(dict(ph="X", cat="gpu_memcpy", name="Memcpy DtoD", ts=start + 10, dur=20))
        kernel_ms["Memcpy DtoD"] = kernel_ms.get("Memcpy DtoD", 0.0) + 0.02
        busy += (t - start) / 1e3
        if step < steps - 1:
            gap = rng.uniform(100, 900)
            host = f"host_work_{step}"
            events.append(
                dict(ph="X", cat="python_function", name="scheduler", ts=t - 50, dur=gap + 100)
            )
            events.append(dict(ph="X", cat="cpu_op", name=host, ts=t + 1, dur=gap - 2))
            gaps.append((gap / 1e3, host))
            idle += gap / 1e3
            t += gap
    events.append(dict(ph="i", name="instant marker", ts=t))  # not a complete event: skipped
    return events, kernel_ms, busy, idle, sorted(gaps, reverse=True)


def test_profile_analysis_splits_the_span_into_kernels_busy_and_idle_gaps(tmp_path):
    import gzip

    import server_profile as prof

    rng = random.Random()
    steps = rng.randint(3, 8)
    events, kernel_ms, busy, idle, gaps = _synthetic_trace(rng, steps)
    path = tmp_path / "x-TP-0-DECODE.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    a = prof.analyze(prof.load(path), graphs_per_step=1)  # steps from the graph launches
    assert a["steps"] == steps and a["graph_launches"] == steps
    assert a["gpu_busy_ms_per_step"] == pytest.approx(busy / steps)
    assert a["gpu_idle_ms_per_step"] == pytest.approx(idle / steps)
    assert a["wall_ms_per_step"] == pytest.approx((busy + idle) / steps)
    got = {k["name"]: k["ms_per_step"] for k in a["kernels"]}
    assert got == pytest.approx({n: ms / steps for n, ms in kernel_ms.items()})
    assert [k["name"] for k in a["kernels"]][0] == max(kernel_ms, key=kernel_ms.get)
    assert [g["ms"] for g in a["gaps"]] == pytest.approx([g for g, _ in gaps])
    # the host ops across each gap, innermost first: the next step's graph launch, the op
    # that ran across it, then the enclosing scheduler span
    want = [["cudaGraphLaunch", h, "scheduler"] for _, h in gaps]
    assert [g["host"] for g in a["gaps"]] == want
    assert prof.analyze(prof.load(path), steps=2 * steps)["steps"] == 2 * steps
    assert prof.analyze(prof.load(path), graphs_per_step=2)["steps"] == max(1, round(steps / 2))
    md = prof.report("x", a)
    assert f"{a['wall_ms_per_step']:.3f} ms per step" in md and "`host_work_0`" in md
    assert a["other_kernels"]["names"] == 0 and "other kernels" not in md
    # past the listed kernels, the rest is one row: the cheapest two of the three names here
    cut = prof.analyze(prof.load(path), graphs_per_step=1, top_kernels=1)
    assert [k["name"] for k in cut["kernels"]] == [max(kernel_ms, key=kernel_ms.get)]
    rest = sorted(kernel_ms.values())[:2]
    assert cut["other_kernels"]["names"] == 2
    assert cut["other_kernels"]["ms_per_step"] == pytest.approx(sum(rest) / steps)
    assert f"| 2 other kernels | {sum(rest) / steps:.3f} |" in prof.report("x", cut)
    cpu_only = [e for e in events if e.get("cat") != "kernel" and e.get("cat") != "gpu_memcpy"]
    assert prof.analyze(cpu_only)["steps"] == 0


def test_profile_splits_one_kernel_name_by_launch_shape():
    """A kernel launched with two shapes (the target's verify and the draft's block attention
    both run decode_fwd_kernel) gets a row per shape; a name with one shape keeps its bare name;
    copies, which record no shape, stay one row."""
    import server_profile as prof

    rng = random.Random()
    steps = rng.randint(2, 5)
    verify = dict(grid=[512, 1, rng.randint(1, 4)], block=[128, 1, 1], **{"shared memory": 40960})
    draft = dict(grid=[512, 1, 1], block=[128, 1, 1], **{"shared memory": 65536})
    gemm = dict(grid=[132, 1, 1], block=[384, 1, 1], **{"shared memory": 200000})
    want: dict[str, float] = {}
    events, t = [], 0.0
    for _ in range(steps):
        for name, args, n in (("attn", verify, 32), ("attn", draft, 2), ("gemm", gemm, 3)):
            for _ in range(n):
                dur = rng.uniform(5, 300)
                events.append(dict(ph="X", cat="kernel", name=name, ts=t, dur=dur, args=args))
                key = name if name == "gemm" else f"attn [{prof._launch_shape(dict(args=args))}]"
                want[key] = want.get(key, 0.0) + dur / 1e3 / steps
                t += dur
        events.append(dict(ph="X", cat="gpu_memcpy", name="Memcpy DtoD", ts=t, dur=4.0))
        want["Memcpy DtoD"] = want.get("Memcpy DtoD", 0.0) + 0.004 / steps
        t += 50.0
    a = prof.analyze(events, steps=steps)
    got = {k["name"]: k["ms_per_step"] for k in a["kernels"]}
    assert got == pytest.approx(want)
    g = "x".join(str(v) for v in verify["grid"])
    assert f"attn [grid {g}, block 128x1x1, smem 40960]" in got
    assert {k["name"]: k["launches_per_step"] for k in a["kernels"]}[
        "attn [grid 512x1x1, block 128x1x1, smem 65536]"
    ] == pytest.approx(2)
    # a long name is cut before its shape, never inside it
    long = dict(a, kernels=[dict(name="k" * 120 + " [grid 1x1x1, smem 0]", ms_per_step=1.0,
                                 launches_per_step=1.0)])  # fmt: skip
    line = [ln for ln in prof.report("x", long).splitlines() if ln.startswith("| `k")][0]
    assert line.startswith("| `" + "k" * 20)
    assert "... [grid 1x1x1, smem 0]`" in line


def test_chain_rows_table_and_prompts(tmp_path):
    import server_dspark as dspark

    from sgl_atom.testing import tiny

    target = tiny.build(tmp_path / "llama-chain", "llama-chain", log=lambda _: None)
    a = dspark.chain_prompts(target, 3, 40, seed=5)
    assert [len(p) for p in a] == [40, 40, 40] and len({tuple(p) for p in a}) == 3
    assert dspark.chain_prompts(target, 3, 40, seed=5) == a  # deterministic per seed
    assert dspark.chain_prompts(target, 3, 40, seed=6) != a

    def row(spec, batch, tok_s, **extra):
        return dict(
            model="llama-chain", kv="bf16", run="r1", spec=spec, batch=batch, prompt=64,
            output=48, decode_tok_s=tok_s, decode_tok_s_client=tok_s * 0.9, ttft_s=0.1, **extra,
        )  # fmt: skip

    rows = [
        row("chain-none", 1, 100.0, rate_method="differential"),
        row("chain-dspark", 1, 260.0, draft_kv="fp8", accept_len=5.1, vs_plain=2.6, same=1),
        row("chain-dspark", 32, 1500.0, draft_kv="bf16", accept_len=4.7, vs_plain=1.71, same=31),
        row("none", 1, 5.0),  # a forced-acceptance row: not this table's
    ]
    table = dspark.chain_table(rows)
    lines = [ln for ln in table.splitlines() if ln.startswith("| 1") or ln.startswith("| 32")]
    assert len(lines) == 3
    assert "ATOM_DSPARK, fp8 pool" in table and ">= 2.5" in table and ">= 1.8" in table
    assert "31/32" in table and "2.6" in table and "| 5 " not in table
    # the differential rate's row names both lengths it decoded; an older row its one length
    assert table.count("| 48 / 96 ") == 1 and table.count("| 48 ") == 3


def test_spec_results_are_written_with_their_plot(tmp_path, monkeypatch):
    """write_results over DSpark rows writes both DSpark tables and asks for the spec suite's
    plot (server_spec.png) from server_dspark.plot; rows of no suite with a plot ask for none."""
    import bench_server
    import server_dspark as dspark

    asked = []
    monkeypatch.setattr(bench_server, "_plot", lambda fn, rows, path: asked.append((fn, path)))
    base = dict(model="llama3-8b", backend="atom", kv="bf16", prompt=4096, output=128, run="r")
    rows = [
        dict(base, batch=1, spec="none", decode_tok_s=200.0, ttft_s=0.1),
        dict(base, batch=1, spec="dspark", block=4, forced_accept=3, draft_kv="bf16",
             accept_len=4.0, decode_tok_s=500.0, vs_plain=2.5, step_ratio=1.6, ttft_s=0.1),
        dict(base, batch=32, prompt=64, spec="chain-dspark", draft_kv="fp8", accept_len=4.9,
             decode_tok_s=2e4, decode_tok_s_client=1.9e4, vs_plain=2.2, same=32, ttft_s=0.01),
    ]  # fmt: skip
    (tmp_path / "server.json").write_text(json.dumps({"rows": rows}))
    header = {"machine": "m", "date": "d", "command": "c", "copy_gbps": 1.0}
    md = bench_server.write_results(tmp_path, header, [])
    assert "under forced acceptance" in md and "with real acceptance" in md
    assert asked == [(dspark.plot, tmp_path / "server_spec.png")]

    asked.clear()
    (tmp_path / "server.json").write_text(json.dumps({"rows": rows[:1]}))
    bench_server.write_results(tmp_path, header, [])
    assert asked == []


def test_differential_rate_cancels_what_both_runs_share(monkeypatch):
    """The chain rows' rate: batch x N over (fastest time to 2N tokens - fastest time to N
    tokens), after one untimed N-token run, with the N-token time and the longer run's outputs;
    a run no longer than the short one is unmeasurable (0). The client rate past the first
    token comes from one formula."""
    import bench_server

    # 1 s of fixed cost (prefill, first token), 8 tokens in 1 s; the first run pays 5 s more
    # and one of the longer runs 1 s of noise
    times = {8: [6.5, 1.5, 1.6, 1.5], 16: [3.5, 2.5, 2.6]}
    asked = []

    def fake(srv, ids, new):
        asked.append(new)
        return times[new].pop(0), [[new] * new for _ in ids]

    monkeypatch.setattr(bench_server, "generate_ids", fake)
    rate, short, outs = bench_server.differential_rate(None, [[1], [2], [3]], 8)
    assert asked == [8, 8, 16, 8, 16, 8, 16] and rate == 3 * 8 / 1.0 and short == 1.5
    assert outs == [[16] * 16] * 3
    times.update({8: [9.0, 1.5], 16: [1.5]})
    assert bench_server.differential_rate(None, [[1]], 8, repeats=1)[0] == 0.0
    assert bench_server.client_rate(3, 8, 1.5, 0.5) == 3 * 7 / 1.0
    assert bench_server.client_rate(3, 8, 0.5, 0.5) == 0.0


def test_chain_rows_stay_within_the_targets_trained_length():
    """N and 2N new tokens after the 64-token prompt stay within the 160 tokens the chain
    target was trained on; a shorter N is kept."""
    import server_dspark as dspark

    n = dspark.chain_output(128)
    assert dspark.CHAIN_PROMPT + 2 * n <= dspark.CHAIN_TRAINED and n == 48
    assert dspark.chain_output(16) == 16 and dspark.chain_output(0) == 1


def test_m3_base_row_stays_for_the_runs_that_need_it(tmp_path):
    """A later run that measures the 1K workload again replaces that row, but the old one stays
    while an older run's longer workload is still measured against it; a long step no longer
    than its 1K step reads as below noise, not as a negative time."""
    import bench_server

    rng = random.Random()
    b, long = 16, 131072
    base_tok = rng.uniform(3000, 5000)
    full = dict(backend="atom", output=64, byte_limit_tok_s=0.0, weights="fp8", index="fp8")
    old_base = dict(_row("r0", "sparse", b, m3.BASE_PROMPT, base_tok), **full)
    old_long = dict(_row("r0", "sparse", b, long, base_tok * 0.9), **full)
    (tmp_path / "server.json").write_text(json.dumps({"rows": [old_base, old_long]}))
    fields = {k: old_base[k] for k in ("model", "backend", "kv", "batch", "prompt", "output")}
    extra = {"sparse": "sparse", "weights": "fp8", "index": "fp8"}
    new = bench_server.Row(**fields, run="r1", decode_tok_s=base_tok * 1.01, ttft_s=0.1,
                           byte_limit_tok_s=0.0, extra=extra)  # fmt: skip
    rows = bench_server.merge(tmp_path / "server.json", {}, [new])["rows"]
    assert sorted(r["run"] for r in rows) == ["r0", "r0", "r1"]
    d = m3.derive(rows)
    want = (b / (base_tok * 0.9) - b / base_tok) * 1e3
    assert d[("r0", "fp8", "fp8", "sparse", b, long)]["attn_ms"] == pytest.approx(want)
    # without the older run's long row, its 1K row is simply replaced
    (tmp_path / "server.json").write_text(json.dumps({"rows": [old_base]}))
    rows = bench_server.merge(tmp_path / "server.json", {}, [new])["rows"]
    assert [r["run"] for r in rows] == ["r1"]
    # a long step faster than the 1K one (batch 1 noise)
    noisy = [_row("r2", "dense", 1, m3.BASE_PROMPT, 400.0), _row("r2", "dense", 1, long, 420.0)]
    assert m3.derive(noisy)[("r2", "bf16", "-", "dense", 1, long)] == {"attn_noise": True}
    assert "< noise" in m3.m3_table(noisy)


def test_dspark_rows_with_and_without_overlap_are_kept_apart(tmp_path):
    """``--spec-overlap on,off``: a DSpark row measured without overlap scheduling is its own
    configuration (a later run of the other mode keeps it), and both tables name it."""
    import bench_server
    import server_dspark as dspark

    base = dict(model="llama3-8b", backend="atom", kv="bf16", batch=16, prompt=4096, output=128,
                run="r", ttft_s=0.1, byte_limit_tok_s=0.0)  # fmt: skip
    forced = dict(base, spec="dspark", block=4, forced_accept=3, draft_kv="fp8", accept_len=4.0,
                  vs_plain=2.0, step_ratio=1.5)  # fmt: skip
    off, on = dict(forced, overlap="off", decode_tok_s=900.0), dict(forced, overlap="on")
    assert bench_server.row_key(off) != bench_server.row_key(dict(on, decode_tok_s=1.0))
    (tmp_path / "server.json").write_text(json.dumps({"rows": [off]}))
    fields = {k: on[k] for k in ("model", "backend", "kv", "batch", "prompt", "output", "run")}
    extra = {k: v for k, v in on.items() if k not in fields and k != "ttft_s"}
    new = bench_server.Row(
        **fields, decode_tok_s=1200.0, ttft_s=0.1, byte_limit_tok_s=0.0, extra=extra
    )
    rows = bench_server.merge(tmp_path / "server.json", {}, [new])["rows"]
    assert sorted(r["decode_tok_s"] for r in rows) == [900.0, 1200.0]
    table = dspark.spec_table([dict(base, spec="none", decode_tok_s=600.0), *rows])
    assert table.count("k=4 forced 3, no overlap") == 1 and table.count("k=4 forced 3 ") == 1
    chain = dict(base, spec="chain-dspark", prompt=64, draft_kv="bf16", accept_len=4.9,
                 decode_tok_s=2e4, vs_plain=2.2, same=16)  # fmt: skip
    table = dspark.chain_table([chain, dict(chain, overlap="off")])
    assert table.count("ATOM_DSPARK, bf16 pool, no overlap") == 1
    assert len(re.findall(r"ATOM_DSPARK, bf16 pool +\|", table)) == 1
    with pytest.raises(SystemExit, match="--spec-overlap"):
        bench_server.parse_args(["--spec", "--spec-overlap", "on,sometimes"])
    assert bench_server.parse_args(["--spec", "--spec-overlap", "on,off"]).spec_overlap == "on,off"
    # overlap with each step's lengths copied to the host: its own rows, label and server env
    host = dict(forced, overlap="host-lens", decode_tok_s=1100.0)
    assert bench_server.row_key(host) != bench_server.row_key(on)
    table = dspark.spec_table([dict(base, spec="none", decode_tok_s=600.0), *rows, host])
    assert table.count("k=4 forced 3, host lengths") == 1 and table.count("k=4 forced 3 ") == 1
    args = dspark.spec_server_args(tmp_path, "fp8", 3, "host-lens")
    assert "--disable-overlap-schedule" not in args
    assert dspark.OVERLAP_ENV["host-lens"] == {"SGL_ATOM_DSPARK_HOST_SEQ_LENS": "1"}
    parsed = bench_server.parse_args(["--spec", "--spec-overlap", "on,host-lens"])
    assert parsed.spec_overlap == "on,host-lens"
    # a +w8 pool: the draft's GEMMs in fp8, its own rows (the pool dtype as SGLang spells it)
    w8 = dspark.spec_server_args(tmp_path, "fp8+w8", 3)
    assert w8[w8.index("--speculative-draft-kv-cache-dtype") + 1] == "fp8_e4m3"
    assert w8[w8.index("--speculative-draft-model-quantization") + 1] == "fp8"
    assert "--speculative-draft-model-quantization" not in args
    assert bench_server.row_key(dict(forced, draft_kv="fp8+w8")) != bench_server.row_key(forced)
    with pytest.raises(ValueError, match=r"--draft-kv fp8\+w4: a pool dtype, optionally \+w8"):
        dspark.spec_server_args(tmp_path, "fp8+w4", 3)


def test_spec_log_rate_is_time_weighted():
    """Lines of equal steps: tokens (batch x interval x accept) over their summed time, so a
    line whose interval was cut short by a late result does not pull the rate its way."""
    import server_dspark as dspark

    rng = random.Random()
    batch, interval = rng.choice([1, 16]), 4
    lines, tokens, seconds = [], 0.0, 0.0
    for i in range(rng.randint(4, 9)):
        accept = rng.choice([3.0, 4.0, 5.0])
        dt = rng.choice([1e-4, rng.uniform(0.01, 0.05)])  # two results processed at once
        rate = batch * interval * accept / dt
        if i:  # the first line is dropped
            tokens, seconds = tokens + batch * interval * accept, seconds + dt
        lines.append(
            f"Decode batch, #running-req: {batch}, #token: 9, accept len: {accept:.2f}, "
            f"gen throughput (token/s): {rate:.4f}, #queue-req: 0"
        )
    lines.append("Decode batch, #running-req: 99, accept len: 4.00, gen throughput (token/s): 1")
    got, _, n = dspark.spec_log_rate("\n".join(lines), batch)
    assert n == len(lines) - 2
    assert got == pytest.approx(tokens / seconds, rel=1e-5)


def test_a_server_that_runs_fewer_of_the_batch_is_timed_over_those(monkeypatch):
    """A spec server that admits 62 of 64 requests: its rate comes from the lines with 62
    running (not the client's, whose tail decodes the queued two alone), and its step is that
    of 62 requests against the plain step of 64; the row and its label say so."""
    import bench_server
    import server_dspark as dspark

    rng = random.Random()
    batch, running, accept = 64, rng.randint(50, 63), 4.0
    rate = rng.uniform(3e3, 9e3)
    line = ("Decode batch, #running-req: {n}, #token: 9, accept len: 4.00, "
            "gen throughput (token/s): {r:.3f}, #queue-req: {q}")  # fmt: skip
    log = "\n".join([line.format(n=running, r=rate, q=batch - running)] * 6
                    + [line.format(n=batch - running, r=rate / 20, q=0)] * 3)  # fmt: skip
    assert dspark.admitted(log, batch) == running
    assert dspark.admitted(log.replace(f"running-req: {running},", "running-req: 64,"), 64) == 64
    assert dspark.admitted("", batch) == batch
    monkeypatch.setattr(bench_server, "timed_decode", lambda *a, **k: (0.1, log, rate / 3))
    plain = bench_server.Row("tiny", "atom", "bf16", batch, 64, 8, 3000.0, 0.1, 0.0, "r",
                             extra={"spec": "none"})  # fmt: skip
    row = bench_server.run_spec_workload(None, plain, 4, 3, "bf16", spec=dspark.SGLANG_SPEC)
    assert row.decode_tok_s == pytest.approx(rate, rel=1e-3)
    step, plain_step = running * accept / rate, batch / plain.decode_tok_s
    assert row.extra["step_ratio"] == pytest.approx(step / plain_step, rel=1e-3)
    assert row.extra["running"] == running
    label = dspark.spec_label({**row.extra, "backend": "atom", "batch": batch})
    assert label.endswith(f", {running} of {batch} running")
    whole = log.replace(f"running-req: {running},", f"running-req: {batch},")
    monkeypatch.setattr(bench_server, "timed_decode", lambda *a, **k: (0.1, whole, rate / 3))
    row = bench_server.run_spec_workload(None, plain, 4, 3, "bf16", spec=dspark.SGLANG_SPEC)
    assert "running" not in row.extra
    assert row.extra["step_ratio"] == pytest.approx(accept * plain.decode_tok_s / rate, rel=1e-3)


def test_sglang_dspark_reads_the_same_draft_and_forces_the_same_acceptance(tmp_path):
    """``--spec-sglang``: SGLang's own DSpark parses the draft folder written for it as the same
    checkpoint (block, taps, Markov rank, mask token; the same weights file) under one of its
    registered architectures; the server flags exist in SGLang's parser, and its simulated
    acceptance commits exactly N drafts plus the bonus at every step."""
    import argparse

    import bench_server
    import server_dspark as dspark
    from sglang.srt.arg_groups.choices import DRAFT_ATTENTION_BACKEND_CHOICES
    from sglang.srt.models import dspark as sglang_dspark
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.dspark_components.dspark_config import parse_dspark_draft_config
    from sglang.srt.speculative.spec_utils import sample_simulated_acc_len
    from transformers import AutoConfig

    from sgl_atom import plugin

    plugin.register()  # the atom backend among SGLang's --attention-backend choices
    rng = random.Random()
    shape = bench_server.MODELS["tiny"]
    k = rng.choice([4, 7])
    ours = dspark.write_drafts("tiny", shape, [k], tmp_path, 4096)[k]
    theirs = dspark.sglang_draft(ours)
    assert theirs != ours and dspark.sglang_draft(ours) == theirs  # written once, reused
    assert (theirs / "model.safetensors").resolve() == (ours / "model.safetensors").resolve()
    mine, other = (json.loads((p / "config.json").read_text()) for p in (ours, theirs))
    assert other.pop("architectures") == [dspark.SGLANG_DRAFT_ARCH]
    assert mine.pop("architectures") == ["AtomDSparkDraftModel"] and mine == other
    assert dspark.SGLANG_DRAFT_ARCH in [c.__name__ for c in sglang_dspark.EntryClass]
    parsed = parse_dspark_draft_config(draft_hf_config=AutoConfig.from_pretrained(str(theirs)))
    assert parsed.gamma == k and parsed.num_hidden_layers == dspark.DRAFT_LAYERS
    assert parsed.target_layer_ids == dspark.tap_layers(shape["num_hidden_layers"])
    assert parsed.markov_rank == mine["markov_rank"] and parsed.mask_token_id < shape["vocab_size"]

    kv, overlap = rng.choice(["bf16", "fp8"]), rng.choice(["on", "off"])
    for target, (name, draft_backend) in bench_server.SGLANG_SPEC_TARGETS.items():
        flags = dspark.sglang_spec_server_args(theirs, k, kv, draft_backend, overlap)
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        args = parser.parse_args(["--model-path", "m", *bench_server.BACKENDS[name][2], *flags])
        assert args.speculative_algorithm == "DSPARK" and args.speculative_num_draft_tokens == k + 1
        assert args.speculative_draft_load_format == "auto"  # the file's weights, not dummy ones
        assert args.speculative_draft_kv_cache_dtype == {"bf16": "bf16", "fp8": "fp8_e4m3"}[kv]
        assert args.disable_overlap_schedule == (overlap == "off")
        # the draft's attention runs where SGLang's draft worker supports it (else it would fall
        # back to another backend than the rows name)
        drafted_on = draft_backend or args.attention_backend
        assert drafted_on in DRAFT_ATTENTION_BACKEND_CHOICES, target
    n = rng.randrange(k)
    env = dspark.sglang_spec_env(n)
    draws = {sample_simulated_acc_len(float(env["SGLANG_SIMULATE_ACC_LEN"]), "match-expected",
                                      k + 1) for _ in range(20)}  # fmt: skip
    assert draws == {n + 1}
    assert env["SGLANG_RAGGED_VERIFY_MODE"] == "static"


def test_sglang_dspark_rows_sit_beside_their_backends_plain_decode(tmp_path, monkeypatch):
    """bench_sglang_spec: on the triton target a plain triton server runs first and SGLang's
    DSpark rows are measured against it; on the atom target against the atom plain rows given,
    with the draft on Triton; a server that fails is reported and skipped, the rows before and
    after it kept. The table names each row's worker and backend."""
    from contextlib import contextmanager

    import bench_server
    import server_dspark as dspark

    from sgl_atom.testing.server import ServerStartError

    rng = random.Random()
    shape = bench_server.MODELS["tiny"]
    drafts = dspark.write_drafts("tiny", shape, [4], tmp_path, 4096)
    workloads = [(1, 64), (2, 64)]
    started, fail = [], {"tiny_sglang-dspark-triton-k4-n3-fp8"}

    @contextmanager
    def fake_started(path, args, name, env, logs, warm):
        started.append((name, args, env))
        if name in fail:
            raise ServerStartError(f"{name} exited during start-up")
        yield SimpleNamespace(name=name)

    def fake_plain(srv, model, backend, kv, batch, prompt, output, gbps, run_id, extra):
        return bench_server.Row(model, backend, kv, batch, prompt, output, rng.uniform(1, 9e3),
                                0.1, 0.0, run_id, extra=dict(extra))  # fmt: skip

    def fake_spec(srv, plain, block, forced, draft_kv, serial, overlap, spec):
        assert serial is None and spec == dspark.SGLANG_SPEC
        extra = dict(spec=spec, block=block, forced_accept=forced, draft_kv=draft_kv,
                     overlap=overlap, accept_len=forced + 1.0, step_ratio=1.0,
                     against=plain.backend)  # fmt: skip
        return bench_server.Row(plain.model, plain.backend, plain.kv, plain.batch, plain.prompt,
                                plain.output, 1.0, 0.1, 0.0, plain.run, extra=extra)  # fmt: skip

    monkeypatch.setattr(bench_server, "started", fake_started)
    monkeypatch.setattr(bench_server, "run_workload", fake_plain)
    monkeypatch.setattr(bench_server, "run_spec_workload", fake_spec)
    atom_plain = [fake_plain(None, "tiny", "atom", "bf16", b, p, 8, 1.0, "r", {"spec": "none"})
                  for b, p in workloads]  # fmt: skip
    spec = (tmp_path, drafts, workloads, 8, "r", "", 64, [(4, 3)], ["bf16", "fp8"], ["on"])
    saved = []
    rows = bench_server.bench_sglang_spec("tiny", "triton", atom_plain, spec, 1.0, saved.append)
    names = [name for name, _, _ in started]
    assert names == ["tiny_triton-plain", "tiny_sglang-dspark-triton-k4-n3-bf16",
                     "tiny_sglang-dspark-triton-k4-n3-fp8"]  # fmt: skip
    assert [r.extra["spec"] for r in rows] == ["none"] * 2 + [dspark.SGLANG_SPEC] * 2
    assert {r.extra.get("against") for r in rows[2:]} == {"triton"} and saved[-1] == rows
    _, args, env = started[1]
    assert args[args.index("--attention-backend") + 1] == "triton"
    assert "--speculative-draft-attention-backend" not in args
    assert env == dspark.sglang_spec_env(3)

    started.clear()
    rows = bench_server.bench_sglang_spec("tiny", "atom", atom_plain, spec, 1.0, saved.append)
    assert [name for name, _, _ in started] == [
        "tiny_sglang-dspark-atom-k4-n3-bf16", "tiny_sglang-dspark-atom-k4-n3-fp8"]  # fmt: skip
    assert len(rows) == 4 and {r.extra["against"] for r in rows} == {"atom"}
    args = started[0][1]
    assert args[args.index("--speculative-draft-attention-backend") + 1] == "triton"
    assert args[args.index("--attention-backend") + 1] == "atom"

    base = dict(model="tiny", kv="bf16", batch=1, prompt=64, output=8, run="r", ttft_s=0.1)
    sg = dict(base, spec=dspark.SGLANG_SPEC, block=4, forced_accept=3, draft_kv="fp8",
              accept_len=4.0, decode_tok_s=9.0, vs_plain=2.0, step_ratio=1.5)  # fmt: skip
    table = dspark.spec_table([
        dict(sg, backend="triton"), dict(base, backend="triton", spec="none", decode_tok_s=5.0),
        dict(sg, backend="atom"), dict(base, backend="atom", spec="none", decode_tok_s=6.0),
    ])  # fmt: skip
    labels = [ln.split("|")[3].strip() for ln in table.splitlines() if ln.startswith("| tiny ")]
    sglang = "SGLang DSPARK k=4 forced 3"
    assert labels == ["plain", f"{sglang}, atom backend",
                      "plain, triton backend", f"{sglang}, triton backend"]  # fmt: skip


@pytest.mark.parametrize("targets", [["triton"], ["atom", "triton"]])
def test_spec_sglang_only_starts_no_atom_dspark_server(tmp_path, monkeypatch, targets):
    """--spec-sglang-only: no ATOM_DSPARK server, the plain atom one only for an atom target,
    and every SGLang target still measured (against those plain rows where it is atom)."""
    from contextlib import contextmanager

    import bench_server

    started, sglang = [], []

    @contextmanager
    def fake_started(path, args, name, env, logs, warm):
        started.append(name)
        yield SimpleNamespace(name=name)

    def fake_plain(srv, model, backend, kv, batch, prompt, output, gbps, run_id, extra):
        return bench_server.Row(model, backend, kv, batch, prompt, output, 1.0, 0.1, 0.0,
                                run_id, extra=dict(extra))  # fmt: skip

    def fake_sglang(model, target, plain, spec, gbps, save):
        sglang.append((target, len(plain)))
        return []

    monkeypatch.setattr(bench_server, "write_model", lambda model, root: tmp_path)
    monkeypatch.setattr(bench_server.dspark, "write_drafts", lambda *a: {4: tmp_path})
    monkeypatch.setattr(bench_server, "started", fake_started)
    monkeypatch.setattr(bench_server, "run_workload", fake_plain)
    monkeypatch.setattr(bench_server, "bench_sglang_spec", fake_sglang)
    monkeypatch.setattr(bench_server, "run_spec_workload", lambda srv, plain, *a: plain)
    loads = [(1, 64), (2, 64)]
    rows = bench_server.bench_spec("tiny", loads, 8, 1.0, "r", tmp_path, "", [(4, 3)], ["bf16"],
                                   False, sglang=targets, atom_rows=False)  # fmt: skip
    atom = "atom" in targets
    assert started == (["tiny_atom-bf16-plain"] if atom else [])
    assert len(rows) == (2 if atom else 0)
    assert sglang == [(t, 2 if atom else 0) for t in targets]
    started.clear()
    bench_server.bench_spec("tiny", loads, 8, 1.0, "r", tmp_path, "", [(4, 3)], ["bf16"], False,
                            sglang=targets)  # fmt: skip
    assert started == ["tiny_atom-bf16-plain", "tiny_dspark-k4-n3-bf16"]


def test_spec_sglang_flag_is_checked():
    import bench_server

    assert bench_server.parse_args(["--spec", "--spec-sglang", "triton,atom"]).spec_sglang == [
        "triton", "atom"]  # fmt: skip
    assert bench_server.parse_args(["--spec"]).spec_sglang == []
    for argv, match in (
        (["--spec", "--spec-sglang", "fa9"], "unknown"),
        (["--spec-sglang", "triton"], "goes with --spec"),
        (["--spec", "--spec-chain", "--spec-sglang", "triton"], "goes with --spec"),
        (["--cpu-smoke", "--out", "/tmp/x", "--spec-sglang", "triton"], "refuses CPU"),
        (["--spec", "--spec-sglang-only"], "name SGLang's targets"),
    ):
        with pytest.raises(SystemExit, match=match):
            bench_server.parse_args(argv)


def test_fp8_target_weights_reach_every_server_and_row(tmp_path, monkeypatch):
    """--spec-target-weights fp8: the plain and the ATOM_DSPARK server both serve the target
    with --quantization fp8 under names that say so; the plain rows' byte limit reads one byte
    per layer weight; the DSpark rows carry the target's weights, keep a key of their own beside
    bf16 rows, and the table names the target with its weights. The flag is refused where it
    cannot run."""
    from contextlib import contextmanager

    import bench_server
    import server_dspark as dspark

    started = []

    @contextmanager
    def fake_started(path, args, name, env, logs, warm):
        started.append((name, args))
        yield SimpleNamespace(name=name)

    rng = random.Random()
    rate = rng.uniform(3e3, 9e3)
    line = ("Decode batch, #running-req: 2, #token: 9, accept len: 4.00, "
            "gen throughput (token/s): {r:.3f}, #queue-req: 0")  # fmt: skip
    log = "\n".join([line.format(r=rate)] * 6)
    monkeypatch.setattr(bench_server, "write_model", lambda model, root: tmp_path)
    monkeypatch.setattr(bench_server.dspark, "write_drafts", lambda *a: {4: tmp_path})
    monkeypatch.setattr(bench_server, "started", fake_started)
    monkeypatch.setattr(bench_server, "timed_decode", lambda *a, **k: (0.1, log, rate / 3))
    loads = [(2, 64)]
    rows = {
        w: bench_server.bench_spec(
            "tiny", loads, 8, 1.0, "r", tmp_path, "", [(4, 3)], ["fp8"], False, target_weights=w
        )
        for w in ("bf16", "fp8")
    }
    names = [name for name, _ in started]
    assert names == [
        "tiny_atom-bf16-plain",
        "tiny_dspark-k4-n3-fp8",
        "tiny_atom-bf16-fp8-weights-plain",
        "tiny_dspark-k4-n3-fp8-fp8-weights",
    ]
    for name, args in started:
        quant = args[args.index("--quantization") + 1] if "--quantization" in args else None
        assert quant == ("fp8" if "fp8-weights" in name else None), name
    bf16_plain, bf16_spec = rows["bf16"]
    fp8_plain, fp8_spec = rows["fp8"]
    assert "weights" not in bf16_plain.extra and "weights" not in bf16_spec.extra
    assert fp8_plain.extra["weights"] == fp8_spec.extra["weights"] == "fp8"
    assert len({r.key() for r in (bf16_plain, bf16_spec, fp8_plain, fp8_spec)}) == 4
    shape = bench_server.MODELS["tiny"]
    layers = bench_server.weight_bytes_per_step(shape) - bench_server.weight_bytes_per_step(
        dict(shape, num_hidden_layers=0)
    )
    head = bench_server.weight_bytes_per_step(dict(shape, num_hidden_layers=0))
    assert bench_server.weight_bytes_per_step(shape, "fp8") == pytest.approx(layers / 2 + head)
    assert fp8_plain.byte_limit_tok_s > bf16_plain.byte_limit_tok_s
    table = dspark.spec_table(
        [{**bench_server.asdict(r), **r.extra} for r in (fp8_spec, bf16_plain, fp8_plain)]
    )
    targets = [ln.split("|")[1].strip() for ln in table.splitlines() if ln.startswith("| tiny")]
    assert targets == ["tiny", "tiny, fp8 weights", "tiny, fp8 weights"]
    flag = ["--spec-target-weights", "fp8"]
    for argv in (flag, ["--spec", "--spec-chain", *flag],
                 ["--cpu-smoke", "--out", "/tmp/x", *flag],
                 ["--spec", "--spec-sglang", "triton", *flag]):  # fmt: skip
        with pytest.raises(SystemExit, match="goes with --spec"):
            bench_server.parse_args(argv)
    assert bench_server.parse_args(["--spec", *flag]).spec_target_weights == "fp8"
