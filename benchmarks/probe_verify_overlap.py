"""One Llama-3-8B layer of a DSpark verify at 64 x 4K (64 requests x k + 1 = 5 rows, 320 rows
through the GEMMs, bf16 KV), run as the server runs it (one stream: qkv, the atom verify
attention, o, gate/up, SiLU-and-mul, down) against the same requests as two micro-batches on two
streams, so that one half's attention, which reads the KV cache and is memory-bound, runs beside
the other half's GEMMs, which are compute-bound at 160 rows. A probe of that lever: it prints
figures and changes nothing the server runs.

Variants, each a CUDA graph of ``--layers`` layers replayed (weights and KV distinct per layer,
so nothing is read from L2 that a server would read from HBM):

- ``serial``: the 320 rows at once, one stream (the server's verify today);
- ``halves``: the two halves one after the other on one stream (what splitting costs the GEMMs
  and the attention without any overlap);
- ``overlap``: the halves on two streams, each half's attention of a layer ordered after the
  other half's attention of that layer, so attentions alternate and each runs beside the other
  half's GEMMs;
- ``free``: the halves on two streams without that ordering (the hardware interleaves them);
- ``plain``: a decode layer of the 64 requests (64 rows, the decode attention), the step base.

With ``--kernels`` it also times each side of a layer alone, on one stream: the attention of
the layers (``verify attention`` / ``decode attention``, q precomputed) and the rest
(``verify GEMMs`` / ``decode GEMMs``: the GEMMs and elementwise work), and lists the kernels of
the ``plain`` and ``serial`` graphs under torch's profiler, per kernel and launch shape
(``server_profile.py``'s grouping). Whether the verify attention takes longer beside the
320-row GEMMs than alone (a DSpark step in the server spends more in attention than the kernels
alone predict) shows there. ``--waves ''`` skips the two-stream variants.

The split-KV attention of a half is planned at ``--waves`` programs per SM (2 is the server's:
each half alone fills the GPU; lower leaves SMs to the GEMMs beside it). Per-layer times are
scaled to 32 layers, and each variant's layer is put in a step as the server's measured ratio
would change: ``step`` = (plain step + 32 x (variant - serial)) over the plain step, given
``--step-ratio`` (the measured DSpark step over the plain one) and ``--plain-step-ms``.

    python benchmarks/probe_verify_overlap.py [--layers 8] [--waves 2,1] [--batch 64]
        [--context 4096] [--step-ratio 1.48 --plain-step-ms 12.71]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import LLAMA3_8B_GEMMS, device_name, format_table, import_kernels, time_ms

pa = import_kernels("paged_attention")

HQ, HKV, D, PAGE = 32, 8, 128, 16
HIDDEN = 4096
GRAPH_CONTEXT = 32768  # the server plans a captured graph's splits for its context bound
DEVICE = "cuda"


class Layer:
    """One layer's weights and KV cache (random, bf16)."""

    def __init__(self, batch: int, context: int, seed: int) -> None:
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        w = {}
        for name in ("qkv", "o", "gate_up", "down"):
            n, k = LLAMA3_8B_GEMMS[name]
            w[name] = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16, generator=g) * k**-0.5
        self.w = w
        pages = batch * (context // PAGE)
        shape = (pages * PAGE, HKV, D)
        self.k = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16, generator=g)
        self.v = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16, generator=g)
        perm = torch.randperm(pages, device=DEVICE, generator=g).to(torch.int32)
        self.table = perm.view(batch, context // PAGE)
        self.lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)


class Half:
    """A micro-batch's slice of the requests and its own buffers (so two can run at once)."""

    def __init__(self, layers: list[Layer], lo: int, hi: int, rows: int, waves: float) -> None:
        self.rows = rows
        n = (hi - lo) * rows
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.splits = pa.decode_num_splits(hi - lo, HKV, GRAPH_CONTEXT, sms, waves)
        self.ws = pa.decode_workspace(n, HQ, D, self.splits, DEVICE)
        self.q = torch.empty(n, HQ, D, device=DEVICE, dtype=torch.bfloat16)
        self.attn = torch.empty(n, HQ, D, device=DEVICE, dtype=torch.bfloat16)
        self.tables = [layer.table[lo:hi] for layer in layers]
        self.lens = [layer.lens[lo:hi] for layer in layers]

    def attention(self, i: int, layer: Layer, qkv: torch.Tensor, tuning: dict) -> None:
        self.q.copy_(qkv[:, : HQ * D].view(-1, HQ, D))
        args = (self.q, layer.k, layer.v, self.tables[i], self.lens[i], PAGE, D**-0.5)
        kw = dict(out=self.attn, num_splits=self.splits, workspace=self.ws, **tuning)
        if self.rows == 1:
            pa.decode_fwd(*args, max_context=GRAPH_CONTEXT, **kw)
        else:
            pa.verify_fwd(*args, self.rows, max_context=GRAPH_CONTEXT, **kw)


def qkv_of(x: torch.Tensor, layer: Layer) -> torch.Tensor:
    return F.linear(x, layer.w["qkv"])


def after_attention(x: torch.Tensor, attn: torch.Tensor, layer: Layer) -> torch.Tensor:
    """o, the residual, gate/up, SiLU-and-mul, down and the residual: the layer's GEMM side."""
    x = x + F.linear(attn.view(x.shape[0], -1), layer.w["o"])
    gate, up = F.linear(x, layer.w["gate_up"]).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, layer.w["down"])


def one_stream(
    x: torch.Tensor, layers: list[Layer], half: Half, tuning: dict | None
) -> torch.Tensor:
    """The layers on the current stream; ``tuning`` None: without their attention (the GEMM
    side alone, o to down over ``half.attn`` as it is)."""
    for i, layer in enumerate(layers):
        qkv = qkv_of(x, layer)
        if tuning is not None:
            half.attention(i, layer, qkv, tuning)
        x = after_attention(x, half.attn, layer)
    return x


def attention_side(layers: list[Layer], half: Half, qkvs: list[torch.Tensor], tuning: dict):
    """The layers' attention alone (their q from ``qkvs``, computed before)."""
    for i, layer in enumerate(layers):
        half.attention(i, layer, qkvs[i], tuning)
    return half.attn


def kernel_rows(fn, label: str, layers: int, replays: int = 5) -> list[list[object]]:
    """``fn`` captured in one CUDA graph and replayed under torch's profiler: per kernel and
    launch shape, us per layer and launches per layer."""
    import tempfile
    from pathlib import Path

    import server_profile

    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        a = server_profile.analyze(server_profile.load(path), steps=replays * layers)
    if not a.get("steps"):
        return [[label, "no kernel recorded", "-", "-"]]
    rows = [[label, server_profile.short_name(k["name"], 110), k["ms_per_step"] * 1e3,
             k["launches_per_step"]] for k in a["kernels"]]  # fmt: skip
    return rows + [[label, "GPU busy", a["gpu_busy_ms_per_step"] * 1e3, "-"]]


def two_streams(xs, layers, halves, streams, tuning, ordered: bool):
    """Each half's layers on its own stream, forked from and joined to the current one; when
    ``ordered``, half b's attention of layer i waits for half a's, and half a's attention of
    layer i + 1 for half b's of layer i, so the two attentions never run at once."""
    main = torch.cuda.current_stream()
    for s in streams:
        s.wait_stream(main)
    done = [[torch.cuda.Event() for _ in layers] for _ in halves]
    outs = list(xs)
    # issue order alternates the halves per layer so each stream's queue holds its next work
    qkv = [None, None]
    for h in (0, 1):
        with torch.cuda.stream(streams[h]):
            qkv[h] = qkv_of(outs[h], layers[0])
    for i, layer in enumerate(layers):
        for h in (0, 1):
            with torch.cuda.stream(streams[h]):
                if ordered:
                    if h == 1:
                        streams[1].wait_event(done[0][i])
                    elif i > 0:
                        streams[0].wait_event(done[1][i - 1])
                halves[h].attention(i, layer, qkv[h], tuning)
                done[h][i].record(streams[h])
                outs[h] = after_attention(outs[h], halves[h].attn, layer)
                if i + 1 < len(layers):
                    qkv[h] = qkv_of(outs[h], layers[i + 1])
    for s in streams:
        main.wait_stream(s)
    return outs


def committed_tuning(section: str) -> dict:
    """The bf16 tiling the atom backend launches on this device for ``section`` ("decode" or
    "verify"), from its committed tuning file, as kernel keyword arguments."""
    from sgl_atom.attention import decode_tuning as dt

    tuning, _ = dt.load("bf16", torch.cuda.get_device_name(0), section=section)
    return tuning.kernel_kwargs()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=5, help="verify rows per request (k + 1)")
    ap.add_argument("--waves", default="2,1", help="split plans of a half's attention")
    ap.add_argument("--step-ratio", type=float, default=1.48)
    ap.add_argument("--plain-step-ms", type=float, default=12.71)
    ap.add_argument(
        "--kernels",
        action="store_true",
        help="also each side of a layer alone, and the plain and serial graphs' kernels",
    )
    args = ap.parse_args()
    b, r, nl = args.batch, args.rows, args.layers
    print(f"{device_name()}: {nl} layers, {b} x {args.context}, {r} verify rows", flush=True)
    layers = [Layer(b, args.context, seed) for seed in range(nl)]
    vt, dt_ = committed_tuning("verify"), committed_tuning("decode")
    g = torch.Generator(device=DEVICE).manual_seed(1234)
    x = torch.randn(b * r, HIDDEN, device=DEVICE, dtype=torch.bfloat16, generator=g)
    x1 = x[::r].contiguous()
    full = Half(layers, 0, b, r, 2.0)
    plain = Half(layers, 0, b, 1, 2.0)
    half_rows = b // 2 * r
    xs = (x[:half_rows], x[half_rows:])
    streams = (torch.cuda.Stream(), torch.cuda.Stream())

    ref = one_stream(x, layers, full, vt)
    times = {
        "plain": time_ms(lambda: one_stream(x1, layers, plain, dt_)),
        "serial": time_ms(lambda: one_stream(x, layers, full, vt)),
    }
    kernels = []
    if args.kernels:
        qkv_full = [qkv_of(x, layer) for layer in layers]
        qkv_plain = [qkv_of(x1, layer) for layer in layers]
        times["verify attention"] = time_ms(lambda: attention_side(layers, full, qkv_full, vt))
        times["decode attention"] = time_ms(lambda: attention_side(layers, plain, qkv_plain, dt_))
        times["verify GEMMs"] = time_ms(lambda: one_stream(x, layers, full, None))
        times["decode GEMMs"] = time_ms(lambda: one_stream(x1, layers, plain, None))
        kernels += kernel_rows(lambda: one_stream(x1, layers, plain, dt_), "plain", nl)
        kernels += kernel_rows(lambda: one_stream(x, layers, full, vt), "serial", nl)
    for waves in (float(w) for w in args.waves.split(",") if w):
        halves = (Half(layers, 0, b // 2, r, waves), Half(layers, b // 2, b, r, waves))
        split = [one_stream(xh, layers, h, vt) for xh, h in zip(xs, halves, strict=True)]
        tag = f"waves {waves:g}"
        for ordered, name in ((True, "overlap"), (False, "free")):
            # poisoned outputs: each half's result must be rewritten by the two-stream run
            for h in halves:
                h.attn.fill_(float("nan"))
            outs = two_streams(xs, layers, halves, streams, vt, ordered)
            torch.cuda.synchronize()
            diff = max(
                (o.float() - s.float()).abs().max().item() for o, s in zip(outs, split, strict=True)
            )
            print(f"{name} {tag}: max |diff| against one stream {diff:.3g}", flush=True)
            if not diff <= 1e-2 * ref.float().abs().max().item():  # NaN fails too
                raise SystemExit(f"{name} {tag}: two-stream output differs from one stream")
            times[f"{name}, {tag}"] = time_ms(
                lambda hs=halves, o=ordered: two_streams(xs, layers, hs, streams, vt, o)
            )
        err = (torch.cat(split).float() - ref.float()).abs().max() / ref.float().abs().max()
        print(f"halves {tag}: max |diff| against the {b * r}-row run, relative {err:.2e}",
              flush=True)  # fmt: skip
        pairs = list(zip(xs, halves, strict=True))
        times[f"halves, {tag}"] = time_ms(
            lambda p=pairs: [one_stream(xh, layers, h, vt) for xh, h in p]
        )
    serial = times["serial"] / nl
    rows = []
    for name, ms in times.items():
        per = ms / nl
        if name == "plain" or name.endswith(("attention", "GEMMs")):  # not a verify layer
            rows.append([name, per * 1e3, per * 32, "-", "-"])
        else:
            step = args.step_ratio + 32 * (per - serial) / args.plain_step_ms
            rows.append([name, per * 1e3, per * 32, (per - serial) * 32, step])
        print(f"{name}: {per * 1e3:.1f} us per layer", flush=True)
    print(format_table(["variant", "us / layer", "ms / 32 layers", "vs serial, ms / step",
                        f"step vs plain (from x{args.step_ratio:g})"], rows))  # fmt: skip
    if kernels:
        print()
        print(format_table(["graph", "kernel [launch shape]", "us / layer", "launches / layer"],
                           kernels))  # fmt: skip


if __name__ == "__main__":
    main()
