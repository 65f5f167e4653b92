"""Server benchmark: real SGLang servers with dummy weights, SGLang's `triton` backend against
the atom backend at bf16 and fp8 KV, side by side in one run on one GPU.

    python benchmarks/bench_server.py --out benchmarks/results            # full suite
    python benchmarks/bench_server.py --out benchmarks/results --quick    # one 10-minute call
    python benchmarks/bench_server.py --out benchmarks/results --spec --output 128  # DSpark rows
    python benchmarks/bench_server.py --out benchmarks/results --m3       # M3, sparse vs dense
    python benchmarks/bench_server.py --out /tmp/smoke --cpu-smoke        # the spec path on CPU
    python benchmarks/bench_server.py --out /tmp/smoke --cpu-smoke --m3   # the M3 path on CPU
    python benchmarks/bench_server.py --out benchmarks/results --pd       # P/D pair vs unified

Each (model, backend) gets its own server (`--load-format dummy`, `--skip-tokenizer-init`,
CUDA graphs on, radix cache off), started and stopped by PID one after another, so the card runs
one server at a time. Per workload (batch x prompt tokens, `output` new tokens each):
- TTFT: wall time of the batch with max_new_tokens=1 (the whole batch's prefill);
- decode tokens/s: median of SGLang's own "gen throughput" log lines while the whole batch
  decodes (steady state); the client-side figure (extra tokens over extra time) is kept too;
- byte limit: (weight bytes + KV bytes read per step at mid-decode) over the device copy rate
  measured in the same run, in tokens/s, and the fraction of it reached.
Writes server.md / server.json / server.png into --out; rows of other runs that this run did
not measure (other models, later suites) are kept, rows it measured are replaced.

`--spec` measures ATOM_DSPARK instead (`server_dspark.py`): per model, a plain atom bf16 server
(rows with "spec": "none") and then one server per draft block k and draft KV dtype, a random
draft of real shape under `--atom-dspark-forced-accept N` (rows with "spec": "dspark",
"forced_accept", "block", "draft_kv", "overlap", "accept_len", "step_ratio": one draft+verify
step over one plain decode step of the same run). `--spec-overlap on,off` runs every DSpark
server under SGLang's overlap scheduling (its default, "overlap": "on") and again with
`--disable-overlap-schedule` ("off"); "host-lens" runs it under overlap with each step's sequence
lengths copied to the host (`SGL_ATOM_DSPARK_HOST_SEQ_LENS=1`, a wait on every verify);
`--serial-plain` adds the plain decode without overlap
(rows with "spec": "none-serial"; DSpark rows then carry "step_ratio_serial", the step over that
one). A DSpark row's tokens/s is SGLang's log lines time-weighted (their tokens over their
summed time, `server_dspark.spec_log_rate`): under overlap scheduling the interval between two
lines jitters. Their table is the second one in server.md. `--spec --spec-chain` measures real
acceptance instead: the word-chain llama target and its distilled draft (trained weights,
prompts of words), plain and then ATOM_DSPARK per `--draft-kv`, at `--chain-batches` (1 and
32): decode tokens/s (the batch decoded to N and to 2N new tokens, the rate from the difference
of the two times: short runs of a small model barely fill SGLang's log interval), accept length
(SGLang's log), the speedup over plain and how many greedy outputs (2N tokens) equal plain's
(rows with "spec": "chain-none" / "chain-dspark", per `--spec-overlap` as above).
`--cpu-smoke` runs that suite on CPU (SGLang's CPU engine through sgl_atom.launch_server,
kernels' torch references) on a tiny shape: it checks the code path, its figures mean nothing.

`--m3` measures sgl_atom's MiniMax-M3 class instead (`server_m3.py`): its sparse layers, then
the same model all dense, at 32K/64K/128K context and batch 1 and 16 (rows with "sparse":
"sparse" / "dense"); a 1K workload per batch gives the attention share of each step. Their
table is the third one in server.md, their plot server_m3.png. With `--cpu-smoke`, on the tiny
m3 shape on CPU.

`--profile-steps N` adds, after each timed decode (the chain rows' too), one more run of the
same batch under SGLang's profiler (N decode steps, `server_profile.py`): per step, the GPU's
busy and idle time, its kernels by time, and its longest idle gaps with the host operations
across them, appended to server_profile.md in --out.

`--host-profile SECONDS` adds, after each timed decode of the 8B rows, one more run of the same
batch with py-spy sampling the server's scheduler for SECONDS of its decode (`host_profile.py`,
py-spy from ``SGL_ATOM_PY_SPY`` or PATH): the scheduler's own host work per step against the
step time, and where it goes, appended to server_host_profile.md in --out. The decode must
outlast the window: pick --output so it does (a warning says when it did not).

`--pd` measures a P/D pair on one GPU against a unified server (`server_pd.py`): TTFT at batch
1 per prompt length and the KV each request moves (bytes, NIXL descriptors, write time, GB/s,
from the prefill's `SGL_ATOM_PD_TRANSFER_LOG` lines); rows with "pd": "unified" / "pair", their
table in server.md, their plot server_pd.png.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_profile  # noqa: E402
import server_dspark as dspark  # noqa: E402
import server_m3 as m3  # noqa: E402
import server_pd as pd  # noqa: E402
import server_profile  # noqa: E402

from sgl_atom.testing.server import Server, ServerPool  # noqa: E402

HERE = Path(__file__).resolve().parent

# Attention shapes. llama3-8b: Llama-3-8B; gqa8-70b16: Llama-3-70B's layer (64 q / 8 KV heads,
# GQA group 8) over 16 layers, so weights stay near 8B's and the KV per token is half.
MODELS: dict[str, dict] = {
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "gqa8-70b16": dict(
        hidden_size=8192,
        intermediate_size=14336,
        num_hidden_layers=16,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    # --cpu-smoke only: the tiny llama's shape (tests' "llama" kind)
    "tiny": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
}
GPU_MODELS = [m for m in MODELS if m != "tiny"]
BACKENDS: dict[str, tuple[str, str, list[str]]] = {
    # name: (backend, kv, server args)
    "triton": ("triton", "bf16", ["--attention-backend", "triton"]),
    "atom-bf16": ("atom", "bf16", ["--attention-backend", "atom", "--page-size", "16"]),
    "atom-fp8": (
        "atom",
        "fp8",
        ["--attention-backend", "atom", "--page-size", "16", "--kv-cache-dtype", "fp8_e4m3"],
    ),
}
# --spec-sglang: SGLang's own DSpark worker per target attention backend -> (the BACKENDS entry
# whose flags the target runs with and whose plain decode its rows are measured against, the
# draft's attention backend where SGLang's DSpark draft cannot run on the target's: None, the
# target's). On "atom" the target verifies through the atom backend and the plain rows are the
# run's atom bf16 ones; SGLang's draft runs on its own Triton backend.
# --spec-target-weights: the 8B target's GEMM weights in the --spec rows (fp8: SGLang's own fp8
# linear method, quantized as the dummy weights load; embedding and LM head stay bf16)
TARGET_WEIGHT_FLAGS: dict[str, list[str]] = {"bf16": [], "fp8": ["--quantization", "fp8"]}

SGLANG_SPEC_TARGETS: dict[str, tuple[str, str | None]] = {
    "triton": ("triton", None),
    "atom": ("atom-bf16", "triton"),
}
WORKLOADS = [(1, 16384), (16, 16384), (64, 4096), (128, 2048)]
GEN_RE = re.compile(r"Decode batch.*?#running-req: (\d+).*?gen throughput \(token/s\): ([\d.]+)")


@dataclass
class Row:
    model: str
    backend: str
    kv: str
    batch: int
    prompt: int
    output: int
    decode_tok_s: float
    ttft_s: float
    byte_limit_tok_s: float
    run: str
    decode_tok_s_client: float = 0.0
    log_samples: int = 0
    extra: dict = field(default_factory=dict)

    def key(self) -> tuple:
        return row_key({**asdict(self), **self.extra})


def row_key(d: dict) -> tuple:
    """What a row measured: a later run's row of the same key replaces it."""
    fields = ("model", "backend", "kv", "batch", "prompt", "output")
    extra = ("spec", "block", "forced_accept", "draft_kv", "overlap", "sparse", "weights", "index",
             "pd", "pd_variant")  # fmt: skip
    return tuple(d[f] for f in fields) + tuple(d.get(f) for f in extra)


def write_model(name: str, root: Path) -> Path:
    """A config-only Llama checkpoint of shape ``name`` (weights come from --load-format dummy)."""
    shape = MODELS[name]
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "head_dim": shape["hidden_size"] // shape["num_attention_heads"],
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **shape,
    }
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def weight_bytes_per_step(shape: dict, weights: str = "bf16") -> float:
    """Weight bytes read by one decode step: all layers and the LM head (the embedding is
    gathered, a few rows only). ``weights`` "fp8" (``--quantization fp8``): the layers' GEMM
    weights one byte each, the LM head still bf16."""
    h, i, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    d = h // shape["num_attention_heads"]
    attn = h * d * (2 * shape["num_attention_heads"] + 2 * shape["num_key_value_heads"])
    mlp = 3 * h * i
    layer_bytes = 1.0 if weights == "fp8" else 2.0
    return layer_bytes * L * (attn + mlp) + 2.0 * h * shape["vocab_size"]


def kv_bytes_per_token(shape: dict, kv: str) -> float:
    d = shape["hidden_size"] // shape["num_attention_heads"]
    per_head = d * 2 if kv == "bf16" else d + 4  # fp8: bytes + one fp32 scale per (token, head)
    return 2.0 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * per_head


def byte_limit(
    shape: dict, kv: str, batch: int, prompt: int, output: int, gbps: float, weights: str = "bf16"
) -> float:
    kv_bytes = batch * (prompt + output / 2) * kv_bytes_per_token(shape, kv)
    step_bytes = weight_bytes_per_step(shape, weights) + kv_bytes
    return batch / (step_bytes / (gbps * 1e9))


def measure_copy_gbps() -> float:
    """Device copy rate (GB/s, read + write) in a child process, so this one holds no context."""
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); from common import copy_bandwidth; "
        "print(copy_bandwidth())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def cpu_copy_gbps(nbytes: int = 256 << 20) -> float:
    """Host memory copy rate (GB/s, read + write) for --cpu-smoke."""
    import torch

    src, dst = torch.ones(nbytes // 2, dtype=torch.bfloat16), torch.empty(nbytes // 2)
    dst = dst.to(torch.bfloat16)
    t0 = time.perf_counter()
    for _ in range(4):
        dst.copy_(src)
    return 4 * 2 * nbytes / (time.perf_counter() - t0) / 1e9


def random_prompts(batch: int, prompt: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(prompt)] for _ in range(batch)]


def generate(srv: Server, ids: list[list[int]], new: int) -> float:
    return generate_ids(srv, ids, new)[0]


def generate_ids(srv: Server, ids: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    """(seconds, greedy output ids of each prompt), exactly ``new`` tokens each."""
    params = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
    t0 = time.perf_counter()
    outs = srv.post("/generate", {"input_ids": ids, "sampling_params": params}, timeout=1800)
    dt = time.perf_counter() - t0
    outs = outs if isinstance(outs, list) else [outs]
    got = [len(o["output_ids"]) for o in outs]
    if got != [new] * len(ids):
        raise RuntimeError(f"server returned {got} tokens, asked {new} for each of {len(ids)}")
    return dt, [o["output_ids"] for o in outs]


def log_decode_rate(log: str, batch: int) -> tuple[float, int]:
    """Median of SGLang's gen-throughput log lines with the whole batch running (first dropped:
    its interval can hold the end of the prefill)."""
    rates = [float(r) for n, r in GEN_RE.findall(log) if int(n) == batch][1:]
    if not rates:
        return 0.0, 0
    rates.sort()
    return rates[len(rates) // 2], len(rates)


@dataclass
class Profiling:
    """``--profile-steps``: decode steps to profile after each timed decode (0: none), where
    the traces go, and the markdown file the reports are appended to."""

    steps: int = 0
    traces: Path | None = None
    report: Path | None = None
    activities: tuple[str, ...] = ("CPU", "GPU")


PROFILE = Profiling()


class HostProfiling:
    """``--host-profile``: seconds of py-spy sampling per decode (0: none), the markdown file
    the reports go to, and the recording of the last timed decode, summarized once its step
    time is known."""

    seconds: int = 0
    report: Path | None = None
    pending: tuple[str, Path] | None = None


HOST = HostProfiling()


def host_record(srv: Server, ids, output: int, ttft: float, label: str) -> None:
    """Decode ``ids`` once more while py-spy samples the scheduler from just past the prefill
    (``ttft``) for ``HOST.seconds``; the recording waits in ``HOST.pending``."""
    import threading

    pid = host_profile.scheduler_pid(srv.proc.pid) if srv.proc else None
    if pid is None:
        print(f"[bench_server] {label}: no scheduler process found to sample", flush=True)
        return
    done = threading.Event()

    def decode() -> None:
        try:
            generate(srv, ids, output)
        finally:
            done.set()

    t = threading.Thread(target=decode, daemon=True)
    t.start()
    time.sleep(ttft + 0.3)
    raw = HOST.report.parent / f"host_{label}.txt"
    try:
        _, text = host_profile.record(pid, HOST.seconds, raw)
    except (OSError, RuntimeError) as e:
        print(f"[bench_server] {label}: py-spy: {e}", flush=True)
        t.join()
        return
    if done.is_set():
        print(f"[bench_server] WARNING {label}: the decode ended inside the py-spy window; "
              "raise --output", flush=True)  # fmt: skip
    if "behind" in text:
        print(f"[bench_server] WARNING {label}: py-spy fell behind its rate", flush=True)
    t.join()
    HOST.pending = (label, raw)


def host_report(step_ms: float) -> None:
    """The pending recording's summary at ``step_ms`` per decode step, printed and appended to
    ``HOST.report``."""
    if HOST.pending is None:
        return
    label, raw = HOST.pending
    HOST.pending = None
    s = host_profile.summarize(raw, HOST.seconds, step_ms)
    md = host_profile.report(label, s)
    with open(HOST.report, "a") as f:
        f.write(md + "\n")
    if "error" not in s:
        print(f"[bench_server] host profile {label}: step {step_ms:.2f} ms, scheduler work "
              f"{s['work_ms_per_step']:.2f} ms, waiting for the GPU {s['wait_ms_per_step']:.2f} "
              "ms", flush=True)  # fmt: skip


def timed_decode(
    srv: Server, vocab: int, batch: int, prompt: int, output: int, warm=False, graphs_per_step=1
):
    """(TTFT s, the server log written while ``output`` tokens decoded, client tokens/s).

    ``warm``: a short untimed run of the same batch first. The DSpark draft runs eagerly, so
    its Triton kernels compile at the first step of each new batch shape (a plain decode runs
    in CUDA graphs captured at start-up); without it the client figure holds those compiles.
    With ``PROFILE.steps``, the same batch decodes once more under the profiler
    (``graphs_per_step``: CUDA graph launches per step, for the report)."""
    ids = random_prompts(batch, prompt, vocab, seed=batch * 100003 + prompt)
    if warm:
        generate(srv, ids, 9)
    ttft, log, client, _ = decode_ids(srv, ids, output)
    if PROFILE.steps:
        # enough tokens for steps + 1 decode steps (the profiler stops at the one after the
        # last), even when a speculative step commits up to 8 tokens
        new = max(output, 8 * (PROFILE.steps + 2))
        profile_step(srv, ids, new, f"{srv.name}-{batch}x{prompt}", graphs_per_step)
    if HOST.seconds:
        host_record(srv, ids, output, ttft, f"{srv.name}-{batch}x{prompt}")
    return ttft, log, client


def decode_ids(srv: Server, ids: list[list[int]], output: int):
    """(TTFT s, the server log written while ``output`` tokens decoded, client tokens/s, the
    greedy output ids) of one batch: a 1-token run for the TTFT, then the timed one."""
    ttft = generate(srv, ids, 1)
    mark = len(srv.log_text())
    total, outs = generate_ids(srv, ids, output)
    return ttft, srv.log_text()[mark:], client_rate(len(ids), output, total, ttft), outs


def client_rate(batch: int, output: int, total: float, ttft: float) -> float:
    """Tokens/s past the first token of a batch that took ``total`` s for ``output`` tokens
    each, with ``ttft`` from a 1-token run (0: unmeasurable)."""
    return batch * (output - 1) / (total - ttft) if total > ttft else 0.0


def differential_rate(srv: Server, ids: list[list[int]], output: int, repeats: int = 3):
    """(decode tokens/s, seconds of the ``output``-token run, greedy output ids of the longer
    run): the batch decoded to ``output`` and to ``2 * output`` new tokens, rate = batch x
    output over the difference of the two times. Prefill, first token and per-request costs
    cancel, and nothing depends on SGLang's log interval, which short runs of a small model
    barely fill. One untimed ``output``-token run first (first-use costs of the batch size),
    then ``repeats`` of each length, the fastest of each kept: a single pair of a small model's
    sub-second runs was noise-bound on the H200 (the longer run once no slower than the
    shorter one at batch 32)."""
    generate_ids(srv, ids, output)
    short = long = float("inf")
    outs: list[list[int]] = []
    for _ in range(repeats):
        short = min(short, generate_ids(srv, ids, output)[0])
        took, outs = generate_ids(srv, ids, 2 * output)
        long = min(long, took)
    return (len(ids) * output / (long - short) if long > short else 0.0), short, outs


def profile_step(srv: Server, ids, output: int, label: str, graphs_per_step: int) -> None:
    """Decode ``ids`` once more with SGLang's profiler on for ``PROFILE.steps`` decode steps;
    the breakdown is printed and appended to ``PROFILE.report``."""
    import requests

    def post(path: str, payload: dict) -> None:
        requests.post(srv.url + path, json=payload, timeout=60).raise_for_status()

    trace = server_profile.profile_decode(
        post,
        lambda: generate(srv, ids, output),
        PROFILE.traces,
        label,
        PROFILE.steps,
        activities=PROFILE.activities,
    )
    if trace is None:
        print(f"[bench_server] {label}: no decode trace written", flush=True)
        return
    events = server_profile.load(trace)
    a = server_profile.analyze(events, PROFILE.steps, graphs_per_step)
    md = server_profile.report(label, a)
    with open(PROFILE.report, "a") as f:
        f.write(md + "\n")
    if a.get("steps"):
        print(
            f"[bench_server] profile {label}: {a['wall_ms_per_step']:.3f} ms/step, GPU busy "
            f"{a['gpu_busy_ms_per_step']:.3f} ms ({a['gpu_busy_fraction']:.0%})",
            flush=True,
        )


def run_workload(srv, model, backend, kv, batch, prompt, output, gbps, run_id, extra=None) -> Row:
    ttft, log, client = timed_decode(srv, MODELS[model]["vocab_size"], batch, prompt, output)
    rate, n = log_decode_rate(log, batch)
    host_report(batch / (rate or client) * 1e3 if rate or client else 0.0)
    weights = (extra or {}).get("weights", "bf16")
    limit = byte_limit(MODELS[model], kv, batch, prompt, output, gbps, weights)
    return Row(
        model,
        backend,
        kv,
        batch,
        prompt,
        output,
        decode_tok_s=round(rate or client, 1),
        ttft_s=round(ttft, 3),
        byte_limit_tok_s=round(limit, 1),
        run=run_id,
        decode_tok_s_client=round(client, 1),
        log_samples=n,
        extra=dict(extra or {}),
    )


def run_spec_workload(
    srv,
    plain: Row,
    block: int,
    forced: int,
    draft_kv: str,
    serial: Row | None = None,
    overlap: str = "on",
    spec: str = "dspark",
) -> Row:
    """A DSpark row of ``plain``'s model and workload, with its step time over ``plain``'s (and
    over ``serial``'s, the plain decode without overlap scheduling, when measured); ``spec``:
    "dspark" (ATOM_DSPARK) or ``server_dspark.SGLANG_SPEC`` (SGLang's own DSpark worker)."""
    vocab = MODELS[plain.model]["vocab_size"]
    ttft, log, client = timed_decode(
        srv, vocab, plain.batch, plain.prompt, plain.output, warm=True, graphs_per_step=2
    )
    running = dspark.admitted(log, plain.batch)
    rate, accept, n = dspark.spec_log_rate(log, running)
    rate, accept = rate or client, accept or forced + 1
    host_report(running * accept / rate * 1e3 if rate else 0.0)
    if abs(accept - (forced + 1)) > 0.05:
        print(f"[bench_server] WARNING: accept len {accept:.2f}, forced {forced + 1}", flush=True)
    extra = dict(spec=spec, block=block, forced_accept=forced, draft_kv=draft_kv)
    extra |= dict(overlap=overlap, accept_len=round(accept, 2))
    if "weights" in plain.extra:  # the target's, as its plain decode was served
        extra["weights"] = plain.extra["weights"]
    # a server that ran fewer of the batch at once: its step is timed over those (the SGLang
    # log's lines with them running), the plain step over the whole batch
    share = running / plain.batch
    if running < plain.batch:
        extra["running"] = running
        print(f"[bench_server] WARNING: {running} of {plain.batch} requests decoded together, "
              f"the rest queued: the step is timed with {running} running", flush=True)  # fmt: skip
    extra["vs_plain"] = round(rate / plain.decode_tok_s, 2)
    extra["step_ratio"] = round(dspark.step_ratio(rate, accept, plain.decode_tok_s) * share, 3)
    if serial is not None:
        ratio = dspark.step_ratio(rate, accept, serial.decode_tok_s) * share
        extra["step_ratio_serial"] = round(ratio, 3)
    return Row(
        plain.model,
        plain.backend,
        plain.kv,
        plain.batch,
        plain.prompt,
        plain.output,
        decode_tok_s=round(rate, 1),
        ttft_s=round(ttft, 3),
        byte_limit_tok_s=plain.byte_limit_tok_s,  # the plain decode's, for reference
        run=plain.run,
        decode_tok_s_client=round(client, 1),
        log_samples=n,
        extra=extra,
    )


def server_args(
    backend_args,
    workloads,
    output,
    cpu=False,
    log_interval=0,
    mem_fraction="0.85",
    capped=False,
    dummy=True,
) -> list[str]:
    """``capped``: the KV pool holds the workloads' largest batch and no more, so servers sharing
    the card can start side by side (SGLang sizes an uncapped pool from the memory free when it
    starts). ``dummy``: random weights (``--load-format dummy``), else the checkpoint's."""
    max_bs = max(b for b, _ in workloads)
    ctx = max(p for _, p in workloads) + output + 64
    args = [
        *(["--load-format", "dummy"] if dummy else []),
        "--skip-tokenizer-init",
        "--dtype",
        "bfloat16",
        "--disable-radix-cache",
        "--sampling-backend",
        "pytorch",
        "--context-length",
        str(ctx),
        "--max-running-requests",
        str(max_bs),
    ]
    if cpu or capped:  # SGLang's CPU engine would size the pool from host memory
        # room past the batch: a P/D decode server admits a request only with its reserved
        # decode tokens (SGLang's --num-reserved-decode-tokens, 512) free beside it
        args += ["--max-total-tokens", str(max(4096, max_bs * ctx + 1024))]
    if not cpu:
        args += ["--cuda-graph-max-bs-decode", str(max_bs), "--mem-fraction-static", mem_fraction]
    if log_interval:
        args += ["--decode-log-interval", str(log_interval)]
    return args + list(backend_args)


# --cpu-smoke: the kernels' torch references, one intra-op thread (the host's cores are shared)
CPU_ENV = {"SGL_ATOM_CPU_KERNELS": "reference", "OMP_NUM_THREADS": "1"}


@contextmanager
def started(path: Path, args: list[str], name: str, env: dict | None, logs: str, warm: int):
    """A server on ``path``, warmed up with 2 requests of ``warm`` tokens; stopped by PID and
    its log kept in ``logs`` on the way out."""
    srv = Server(path, args, env=env, name=name)
    try:
        srv.start(timeout=900)
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        generate(srv, random_prompts(2, warm, vocab, 1), 8)
        yield srv
    finally:
        srv.stop()
        if logs:
            Path(logs).mkdir(parents=True, exist_ok=True)
            Path(logs, f"server_{name}.log").write_text(srv.log_text())


def _print(row: Row, name: str) -> None:
    spec = (
        f", accept {row.extra['accept_len']}, step x{row.extra['step_ratio']}"
        if row.extra.get("spec") in ("dspark", dspark.SGLANG_SPEC)
        else ""
    )
    print(
        f"[bench_server] {row.model} {name} {row.batch}x{row.prompt}: {row.decode_tok_s} tok/s "
        f"(client {row.decode_tok_s_client}){spec}, TTFT {row.ttft_s} s, "
        f"limit {row.byte_limit_tok_s}",
        flush=True,
    )


def bench_server(model, name, workloads, output, gbps, run_id, root, logs) -> list[Row]:
    backend, kv, backend_args = BACKENDS[name]
    path = write_model(model, root)
    rows: list[Row] = []
    args = server_args(backend_args, workloads, output)
    with started(path, args, f"{model}_{name}", None, logs, 1024) as srv:
        for batch, prompt in workloads:
            rows.append(run_workload(srv, model, backend, kv, batch, prompt, output, gbps, run_id))
            _print(rows[-1], name)
    return rows


def bench_spec(model, workloads, output, gbps, run_id, root, logs, blocks, draft_kvs, cpu,
               save=lambda rows: None, serial=False, overlaps=("on",), sglang=(),
               atom_rows=True, target_weights="bf16"):  # fmt: skip
    """The plain atom bf16 decode of ``model`` (with ``serial``, once more without overlap
    scheduling), then ATOM_DSPARK with a random draft of real shape per (block k, forced N),
    draft KV dtype and overlap mode (``overlaps``: "on", SGLang's default, and/or "off"), each
    server after the other; then, per target backend of ``sglang`` (``SGLANG_SPEC_TARGETS``),
    SGLang's own DSpark worker on the same draft weights (:func:`bench_sglang_spec`). Without
    ``atom_rows`` no ATOM_DSPARK server runs, and the plain atom one only where an SGLang
    target is atom. ``target_weights`` "fp8": every server's target with ``--quantization fp8``
    (its rows and server names say so; the draft stays as ``draft_kvs`` asks). ``save`` gets the
    rows so far after each server."""
    path = write_model(model, root)
    drafts = dspark.write_drafts(model, MODELS[model], [k for k, _ in blocks], root, 32768)
    env = CPU_ENV if cpu else {}
    interval = 1 if cpu else 4  # a spec step makes k+1 tokens: log often enough to sample it
    warm = min(1024, max(p for _, p in workloads))
    base = BACKENDS["atom-bf16"][2] + TARGET_WEIGHT_FLAGS[target_weights]
    tw = {} if target_weights == "bf16" else {"weights": target_weights}
    tag = "" if target_weights == "bf16" else f"-{target_weights}-weights"
    baselines = {"none": ([], "plain")}
    if serial:
        baselines[dspark.SERIAL] = (["--disable-overlap-schedule"], "plain-no-overlap")
    if not atom_rows:
        baselines = {k: v for k, v in baselines.items() if k == "none" and "atom" in sglang}
    plains: dict[str, list[Row]] = {"none": []}
    rows: list[Row] = []
    for kind, (flags, label) in baselines.items():
        args = server_args([*base, *flags], workloads, output, cpu, interval)
        with started(path, args, f"{model}_atom-bf16{tag}-{label}", env, logs, warm) as srv:
            for batch, prompt in workloads:
                row = run_workload(
                    srv, model, "atom", "bf16", batch, prompt, output, gbps, run_id,
                    {"spec": kind, **tw},
                )  # fmt: skip
                plains.setdefault(kind, []).append(row)
                _print(row, f"atom-bf16{tag} {label}")
        rows += plains[kind]
        save(rows)
    plain, serials = plains["none"], plains.get(dspark.SERIAL, [None] * len(workloads))
    for (k, n), kv, ov in itertools.product(blocks, draft_kvs, overlaps) if atom_rows else ():
        name = f"{model}_dspark-k{k}-n{n}-{kv}{tag}" + dspark.OVERLAP_SUFFIX.get(ov, "")
        spec = dspark.spec_server_args(drafts[k], kv, n, ov)
        args = server_args([*base, *spec], workloads, output, cpu, interval)
        srv_env = {**env, **dspark.SPEC_ENV, **dspark.OVERLAP_ENV.get(ov, {})}
        with started(path, args, name, srv_env, logs, warm) as srv:
            for p, q in zip(plain, serials, strict=True):
                rows.append(run_spec_workload(srv, p, k, n, kv, q, ov))
                _print(rows[-1], name.partition("_")[2])
        save(rows)
    spec = (path, drafts, workloads, output, run_id, logs, warm, blocks, draft_kvs, overlaps)
    for target in sglang:
        done = list(rows)
        rows += bench_sglang_spec(
            model, target, plain, spec, gbps, lambda new, done=done: save(done + new)
        )
        save(rows)
    return rows


def bench_sglang_spec(model, target, atom_plain, spec, gbps, save) -> list[Row]:
    """SGLang's own DSpark worker (``--speculative-algorithm DSPARK``) with the same draft
    weights as ATOM_DSPARK's rows, under its simulated acceptance of the same N, per block, draft
    KV dtype and overlap mode, the target on ``target``'s attention backend
    (``SGLANG_SPEC_TARGETS``); its rows' step over that backend's plain decode (the atom rows
    ``atom_plain`` for "atom", else a plain server of that backend first). A server that fails
    to start or to serve is reported and skipped (its log kept with the others): SGLang's worker
    is measured as it is, and the rows measured so far stay."""
    import requests

    path, drafts, workloads, output, run_id, logs, warm, blocks, draft_kvs, overlaps = spec
    name, draft_backend = SGLANG_SPEC_TARGETS[target]
    backend, kv, target_args = BACKENDS[name]
    rows: list[Row] = []
    plain = atom_plain
    if backend != "atom":
        args = server_args(target_args, workloads, output, log_interval=4)
        with started(path, args, f"{model}_{name}-plain", None, logs, warm) as srv:
            plain = [
                run_workload(srv, model, backend, kv, b, p, output, gbps, run_id, {"spec": "none"})
                for b, p in workloads
            ]
        for row in plain:
            _print(row, f"{name} plain")
        rows += plain
        save(rows)
    # SGLang's worker gets the pool dtypes; the +w8 variants are ATOM_DSPARK's fp8 draft GEMMs
    pools = dict.fromkeys(dspark.draft_variant(kv)[0] for kv in draft_kvs)
    for (k, n), draft_kv, ov in itertools.product(blocks, pools, overlaps):
        label = f"{model}_sglang-dspark-{target}-k{k}-n{n}-{draft_kv}"
        label += dspark.OVERLAP_SUFFIX.get(ov, "")
        flags = dspark.sglang_spec_server_args(
            dspark.sglang_draft(drafts[k]), k, draft_kv, draft_backend, ov
        )
        args = server_args([*target_args, *flags], workloads, output, log_interval=4)
        try:
            with started(path, args, label, dspark.sglang_spec_env(n), logs, warm) as srv:
                for p in plain:
                    rows.append(
                        run_spec_workload(srv, p, k, n, draft_kv, None, ov, dspark.SGLANG_SPEC)
                    )
                    _print(rows[-1], label.partition("_")[2])
        except (RuntimeError, requests.RequestException) as e:  # ServerStartError included
            print(f"[bench_server] {label}: SGLang's DSpark server failed: {e}", flush=True)
        save(rows)
    return rows


def bench_chain(args, run_id: str, save=lambda rows: None) -> list[Row]:
    """ATOM_DSPARK with real acceptance (``server_dspark`` chain rows): the word-chain llama
    target and its distilled draft (trained weights, word prompts), served plain and then with
    the draft at each ``--draft-kv``; per batch, decode tokens/s, accept length, the speedup
    over plain and whether the greedy outputs equal plain's."""
    from sgl_atom.testing import DSPARK_CHAIN

    target = dspark.chain_target()
    batches = [int(b) for b in args.chain_batches.split(",")]
    prompt, output = dspark.CHAIN_PROMPT, dspark.chain_output(args.output)
    if output != args.output:
        print(f"[bench_server] chain rows: {output} vs {2 * output} new tokens, not {args.output}: "
              f"the target holds its chain for {dspark.CHAIN_TRAINED} tokens (prompt "
              f"{prompt} + new), the draft was distilled on {dspark.CHAIN_DRAFT_TRAINED}",
              flush=True)  # fmt: skip
    loads = [(b, prompt) for b in batches]
    env = {**(CPU_ENV if args.cpu_smoke else {}), **dspark.SPEC_ENV}
    base = [*BACKENDS["atom-bf16"][2], "--max-running-requests", str(max(batches))]
    servers = {("none", "on"): []}
    for kv, ov in itertools.product(args.draft_kv.split(","), args.spec_overlap.split(",")):
        servers[(kv, ov)] = dspark.spec_server_args(DSPARK_CHAIN, kv, None, ov)
    plain: dict[int, Row] = {}
    outputs: dict[int, list] = {}
    rows: list[Row] = []
    for (kind, ov), spec in servers.items():
        # the differential rate decodes 2N new tokens: the context must hold them
        srv_args = server_args([*base, *spec], loads, 2 * output, args.cpu_smoke, 1, dummy=False)
        label = f"llama-chain_{'plain' if kind == 'none' else 'dspark-' + kind}"
        label += dspark.OVERLAP_SUFFIX.get(ov, "")
        srv_env = {**env, **dspark.OVERLAP_ENV.get(ov, {})}
        with started(target, srv_args, label, srv_env, args.logs, 16) as srv:
            for batch in batches:
                ids = dspark.chain_prompts(target, batch, prompt, seed=batch)
                ttft = generate(srv, ids, 1)
                mark = len(srv.log_text())
                rate, short, outs = differential_rate(srv, ids, output)
                client = client_rate(batch, output, short, ttft)
                log_rate, accept, n = dspark.spec_log_rate(srv.log_text()[mark:], batch)
                extra = {"spec": "chain-none" if kind == "none" else "chain-dspark"}
                extra |= dict(log_tok_s=round(log_rate, 1), rate_method="differential")
                if kind == "none":
                    outputs[batch] = outs
                else:
                    same = sum(a == b for a, b in zip(outs, outputs[batch], strict=True))
                    extra |= dict(draft_kv=kind, overlap=ov, accept_len=round(accept, 2))
                    extra["same"] = same
                    plain_rate = plain[batch].decode_tok_s
                    extra["vs_plain"] = round(rate / plain_rate, 2) if plain_rate else 0
                row = Row("llama-chain", "atom", "bf16", batch, prompt, output,
                          decode_tok_s=round(rate, 1), ttft_s=round(ttft, 3),
                          byte_limit_tok_s=0.0, run=run_id, decode_tok_s_client=round(client, 1),
                          log_samples=n, extra=extra)  # fmt: skip
                if kind == "none":
                    plain[batch] = row
                rows.append(row)
                if PROFILE.steps:  # within the trained length: prompt + at most 2N new tokens
                    new = min(2 * output, max(output, 8 * (PROFILE.steps + 2)))
                    profile_step(
                        srv, ids, new, f"{label}-{batch}x{prompt}", 1 if kind == "none" else 2
                    )
                print(
                    f"[bench_server] llama-chain {label} {batch}x{prompt}: {row.decode_tok_s} "
                    f"tok/s ({output} vs {2 * output} new tokens; SGLang's log {log_rate:.1f}), "
                    f"accept {extra.get('accept_len', 1)}"
                    f", vs plain {extra.get('vs_plain', '-')}, greedy equal to plain "
                    f"{extra.get('same', batch)}/{batch}",
                    flush=True,
                )
        save(rows)
    return rows


def bench_m3(args, run_id: str, root: Path, save=lambda rows: None) -> list[Row]:
    """sgl_atom's M3 class (``server_m3``), its sparse layers then the same model all dense,
    one server each at ``args.m3_kv`` KV, every workload plus a 1K one per batch."""
    workloads = m3.with_base(
        [tuple(int(x) for x in w.split("x")) for w in args.workloads.split(",")]
    )
    name = "m3-tiny" if args.cpu_smoke else "m3-shape"
    env = {**m3.ENV, **(CPU_ENV if args.cpu_smoke else {})}
    backend = ["--attention-backend", "atom", "--page-size", "16"]
    if args.m3_kv == "fp8":
        backend += ["--kv-cache-dtype", "fp8_e4m3"]
    weights = {}  # bf16 rows carry no "weights" (as before the option existed)
    if args.m3_weights == "fp8":
        backend += ["--quantization", "fp8"]
        weights = {"weights": "fp8"}
    rows: list[Row] = []
    for kind in args.m3_kinds.split(","):
        # the sparse server once per index-key dtype asked for (an explicit one is named on its
        # rows: SGL_ATOM_M3_INDEX_DTYPE); the dense model has no index
        for index in args.m3_index.split(",") if kind == "sparse" else ["auto"]:
            path = m3.write_m3(root, args.m3_layers, kind == "dense", tiny=args.cpu_smoke)
            vocab = json.loads((path / "config.json").read_text())["vocab_size"]
            srv_args = server_args(backend, workloads, args.output, args.cpu_smoke, 4)
            named = {} if index == "auto" else {"index": index}
            suffix = f"-{index}" if named else ""
            label = f"{name}_{kind}-{args.m3_kv}-{args.m3_weights}{suffix}"
            srv_env = {**env, "SGL_ATOM_M3_INDEX_DTYPE": index}
            with started(path, srv_args, label, srv_env, args.logs, 256) as srv:
                for batch, prompt in workloads:
                    ttft, log, client = timed_decode(srv, vocab, batch, prompt, args.output)
                    rate, n = log_decode_rate(log, batch)
                    rows.append(
                        Row(name, "atom", args.m3_kv, batch, prompt, args.output,
                            decode_tok_s=round(rate or client, 1), ttft_s=round(ttft, 3),
                            byte_limit_tok_s=0.0, run=run_id,
                            decode_tok_s_client=round(client, 1), log_samples=n,
                            extra={"sparse": kind, "layers": args.m3_layers, **weights, **named})
                    )  # fmt: skip
                    index_note = f", {index} index" if named else ""
                    _print(
                        rows[-1], f"{kind} {args.m3_kv} KV, {args.m3_weights} weights{index_note}"
                    )
            save(rows)
    return rows


def bench_pd(args, run_id: str, root: Path, save=lambda rows: None) -> list[Row]:
    """A unified atom bf16 server, then a prefill + decode pair of the same model on the same
    card (``server_pd``): TTFT at batch 1 per prompt length, and the pair's KV transfer."""
    from sgl_atom.testing.pd import PDRequest, decode_args, prefill_args
    from sgl_atom.testing.server import free_port

    model = args.models.split(",")[0]
    path, vocab = write_model(model, root), MODELS[model]["vocab_size"]
    loads = [tuple(int(x) for x in w.split("x")) for w in args.workloads.split(",")]
    if any(b != 1 for b, _ in loads):
        raise SystemExit("--pd measures batch 1 (TTFT of one request): give 1xN workloads")
    cpu, env, base = args.cpu_smoke, CPU_ENV if args.cpu_smoke else {}, BACKENDS["atom-bf16"][2]
    reps = 2 if cpu else pd.REPS

    def ids(prompt: int, rep: int) -> list[int]:
        return random_prompts(1, prompt, vocab, seed=prompt * 131 + rep)[0]

    variants = pd.parse_variants(args.pd_variants)

    def row(kind: str, prompt: int, ttfts: list[float], moved: list, variant: str = "") -> Row:
        figures = pd.summarize(ttfts, moved)
        named = {"pd_variant": variant} if variant else {}
        return Row(model, "atom", "bf16", 1, prompt, 1, decode_tok_s=0.0,
                   ttft_s=round(figures.pop("ttft_s"), 4), byte_limit_tok_s=0.0, run=run_id,
                   extra={"pd": kind, **named, **figures})  # fmt: skip

    roles = {"unified": (base, env)}
    ports: dict[str, int] = {}
    for variant, overrides in variants.items():  # one prefill + decode pair per variant
        bp = ports[variant] = free_port()
        pair_env = {**env, **pd.PAIR_ENV, **overrides}
        nccl = ["--nccl-port", str(free_port())]
        roles[pd.role("prefill", variant)] = ([*base, *prefill_args(bp), *nccl], pair_env)
        nccl = ["--nccl-port", str(free_port())]
        roles[pd.role("decode", variant)] = ([*base, *decode_args(cpu), *nccl], pair_env)
    # side by side, each pool capped to the workloads' size (pd.py): one start-up wait, not three
    jobs = {
        f"pd-{role}": (path, server_args(extra, loads, 1, cpu, capped=True), role_env)
        for role, (extra, role_env) in roles.items()
    }
    pool = ServerPool()
    rows: list[Row] = []
    try:
        servers = {n.removeprefix("pd-"): srv for n, srv in pool.start_many(jobs, 900).items()}
        unified = servers["unified"]
        generate(unified, random_prompts(2, 256, vocab, 1), 8)  # warm-up
        for _, prompt in loads:
            ttfts = [generate(unified, [ids(prompt, r)], 1) for r in range(reps)]
            rows.append(row("unified", prompt, ttfts, []))
            print(
                f"[bench_server] {model} unified 1x{prompt}: TTFT {rows[-1].ttft_s} s", flush=True
            )
        save(rows)
        room = 1000

        def ask(variant: str, tokens: list[int], new: int) -> float:
            nonlocal room
            room += 1
            params = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
            pair = servers[pd.role("prefill", variant)], servers[pd.role("decode", variant)]
            req = PDRequest(*pair, {"input_ids": tokens, "sampling_params": params},
                            ports[variant], room, timeout=1800)  # fmt: skip
            out = req.join(timeout=1800)
            if not isinstance(out.get("d"), dict) or len(out["d"]["output_ids"]) != new:
                raise RuntimeError(f"P/D request {room} was not served: {out}")
            return req.seconds["d"]

        for variant in variants:  # the pairs one after another, the others idle
            prefill = servers[pd.role("prefill", variant)]
            ask(variant, ids(256, 99), 8)  # warm-up: handshake, first transfer
            label = f"P/D pair ({variant})" if variant else "P/D pair"
            for _, prompt in loads:
                first = room + 1
                ttfts = [ask(variant, ids(prompt, r), 1) for r in range(reps)]
                seen = pd.transfers(prefill.log_text())
                moved = [seen[r] for r in range(first, room + 1) if r in seen]
                rows.append(row("pair", prompt, ttfts, moved, variant))
                extra = rows[-1].extra
                print(
                    f"[bench_server] {model} {label} 1x{prompt}: TTFT {rows[-1].ttft_s} s, "
                    f"{extra.get('kv_bytes', 0) / 2**20:.1f} MiB in {extra.get('transfer_ms')} "
                    f"ms, {extra.get('posting_ms')} ms of it posting "
                    f"({extra.get('transfer_gbps')} GB/s), {len(moved)}/{reps} transfer lines",
                    flush=True,
                )
                save(rows)
    finally:
        pool.stop_all()
        for srv in pool.started if args.logs else []:
            Path(args.logs, f"server_{model}_{srv.name}.log").write_text(srv.log_text())
    save(rows)
    return rows


def merge(path: Path, header: dict, rows: list[Row]) -> dict:
    """The results file with this run's rows in place of the same configurations' old ones."""
    old = json.loads(path.read_text()) if path.exists() else {"rows": []}
    mine = {r.key() for r in rows}

    kept = [d for d in old.get("rows", []) if row_key(d) not in mine]
    # an M3 1K row stays beside its replacement while a kept row of its run is measured
    # against it (server_m3.derive): a longer workload's attention part needs its own run's base
    replaced = [d for d in old.get("rows", []) if row_key(d) in mine]
    kept += [b for b in replaced if any(m3.is_base_of(b, d) for d in kept)]
    new = []
    for r in rows:
        d = asdict(r)
        d.update(d.pop("extra"))
        new.append(d)
    return {**header, "rows": kept + new}


def table(rows: list[dict]) -> str:
    sys.path.insert(0, str(HERE))
    from common import format_table

    by = {
        (r["model"], r["batch"], r["prompt"], r["backend"], r["kv"]): r
        for r in rows
        if not r.get("spec") and not r.get("pd") and not r.get("sparse")
    }
    out = []
    order = {"triton": 0, "atom": 1}
    for (model, batch, prompt, backend, kv), r in sorted(
        by.items(), key=lambda it: (it[0][:3], order.get(it[0][3], 2), it[0][4])
    ):
        base = by.get((model, batch, prompt, "triton", "bf16"))
        bf16 = by.get((model, batch, prompt, "atom", "bf16"))
        out.append(
            [
                model,
                f"{batch}x{prompt}",
                f"{backend} {kv}",
                round(r["decode_tok_s"]),
                round(r["decode_tok_s"] / base["decode_tok_s"], 2) if base else "-",
                round(r["decode_tok_s"] / bf16["decode_tok_s"], 2) if bf16 else "-",
                round(r["byte_limit_tok_s"]),
                f"{r['decode_tok_s'] / r['byte_limit_tok_s']:.0%}",
                r["ttft_s"],
                r["run"],
            ]
        )
    return format_table(
        [
            "model",
            "batch x prompt",
            "backend",
            "decode tok/s",
            "vs triton",
            "vs atom bf16",
            "byte limit",
            "of limit",
            "TTFT s",
            "run",
        ],
        out,
    )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if not r.get("spec") and not r.get("pd") and not r.get("sparse")]
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.5), squeeze=False)
    names = [("triton", "bf16"), ("atom", "bf16"), ("atom", "fp8")]
    for ax, model in zip(axes[0], models, strict=True):
        loads = sorted({(r["batch"], r["prompt"]) for r in rows if r["model"] == model})
        for k, (backend, kv) in enumerate(names):
            vals = []
            for b, p in loads:
                m = [
                    r
                    for r in rows
                    if r["model"] == model
                    and (r["batch"], r["prompt"]) == (b, p)
                    and r["backend"] == backend
                    and r["kv"] == kv
                ]
                vals.append(m[0]["decode_tok_s"] / m[0]["byte_limit_tok_s"] if m else 0)
            ax.bar(
                [x + 0.27 * (k - 1) for x in range(len(loads))], vals, 0.27, label=f"{backend} {kv}"
            )
        ax.set_xticks(range(len(loads)), [f"{b}x{p // 1024}K" for b, p in loads])
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("decode tokens/s / byte limit")
        ax.set_title(f"{model}: decode in an SGLang server")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--models", help=f"default {','.join(GPU_MODELS)}; llama3-8b with --spec")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--workloads", help="comma-separated BATCHxPROMPT (defaults: see --spec)")
    ap.add_argument("--output", type=int, default=256, help="new tokens per request")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="llama3-8b only, 128 new tokens: fits one 10-minute device call",
    )
    ap.add_argument(
        "--spec",
        action="store_true",
        help=f"ATOM_DSPARK rows beside the plain atom bf16 decode (workloads "
        f"{dspark.DEFAULT_WORKLOADS}) instead of the backends",
    )
    ap.add_argument(
        "--spec-blocks", default=dspark.DEFAULT_BLOCKS, help="k:N,... (block k, N forced)"
    )
    ap.add_argument(
        "--draft-kv",
        default=dspark.DEFAULT_DRAFT_KV,
        help=f"draft KV pool dtypes; KV+{dspark.W8} (e.g. fp8+{dspark.W8}): also the draft's "
        "GEMMs in fp8 (--speculative-draft-model-quantization fp8)",
    )
    ap.add_argument(
        "--serial-plain",
        action="store_true",
        help="--spec: also the plain decode with --disable-overlap-schedule: splits a step's "
        "cost into scheduling and draft+verify",
    )
    ap.add_argument(
        "--spec-overlap",
        default="on",
        help="--spec, --spec-chain: the DSpark servers under SGLang's overlap scheduling (on), "
        "with --disable-overlap-schedule (off), under overlap with each step's lengths copied to "
        "the host (host-lens: SGL_ATOM_DSPARK_HOST_SEQ_LENS=1), or several (on,off,host-lens)",
    )
    ap.add_argument(
        "--spec-sglang",
        default="",
        help="--spec: also SGLang's own DSpark worker (--speculative-algorithm DSPARK) on the same "
        "draft weights under its simulated acceptance of the same N, the target on each of these "
        f"attention backends ({', '.join(SGLANG_SPEC_TARGETS)}), beside that backend's plain "
        "decode; GPU only",
    )
    ap.add_argument(
        "--spec-target-weights",
        choices=list(TARGET_WEIGHT_FLAGS),
        default="bf16",
        help="--spec: the target's GEMM weights in every server, plain and ATOM_DSPARK alike "
        "(fp8: --quantization fp8; the draft stays as --draft-kv asks); GPU only",
    )
    ap.add_argument(
        "--spec-sglang-only",
        action="store_true",
        help="--spec-sglang without ATOM_DSPARK's servers (and without the plain atom one "
        "unless a target is atom): SGLang's rows of a call of their own, merged into --out's "
        "server.json beside ATOM_DSPARK's rows of an earlier call",
    )
    ap.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="--spec on CPU, tiny shape, 2x64, 8 new tokens: the code path, not figures",
    )
    ap.add_argument(
        "--m3",
        action="store_true",
        help=f"sgl_atom's M3 class at MiniMax's shape, sparse vs all dense (workloads "
        f"{m3.DEFAULT_WORKLOADS}, plus 1K per batch)",
    )
    ap.add_argument(
        "--pd",
        action="store_true",
        help=f"a P/D pair on one GPU (atom transfer backend) vs a unified server: TTFT and KV "
        f"transfer at batch 1 (workloads {pd.DEFAULT_WORKLOADS})",
    )
    ap.add_argument(
        "--pd-variants",
        default="",
        help="--pd: pairs that differ by environment, side by side and measured one after "
        "another: 'NAME:KEY=VALUE KEY=VALUE;NAME2:...' (each adds to the pair's UCX and "
        "SGL_ATOM_ settings; a NAME with nothing after the colon is the plain pair); each "
        "variant is two more servers of the model on the card",
    )
    ap.add_argument("--m3-layers", type=int, default=m3.DEFAULT_LAYERS, help="M3 layers")
    ap.add_argument("--m3-kv", choices=["bf16", "fp8"], default="bf16", help="M3 KV dtype")
    ap.add_argument(
        "--m3-index",
        default="auto",
        help="index-key dtypes of the sparse M3 server, comma-separated (auto, bf16, fp8, int4: "
        "SGL_ATOM_M3_INDEX_DTYPE); one sparse server each",
    )
    ap.add_argument(
        "--m3-weights",
        choices=["bf16", "fp8"],
        default="bf16",
        help="M3 projection and expert weights: bf16, or fp8 (--quantization fp8, quantised "
        "as the dummy weights load; router, embedding and LM head stay bf16)",
    )
    ap.add_argument(
        "--m3-kinds", default="sparse,dense", help="M3 servers: its sparse layers, all dense"
    )
    ap.add_argument("--logs", default="", help="folder for each server's full log")
    ap.add_argument(
        "--spec-chain",
        action="store_true",
        help="ATOM_DSPARK with real acceptance: the word-chain target and its trained draft "
        "(server_dspark chain rows), plain then each --draft-kv",
    )
    ap.add_argument(
        "--chain-batches", default="1,32", help="--spec-chain: batch sizes (prompts of words)"
    )
    ap.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after each timed decode, profile this many decode steps of the same batch "
        "(server_profile.md in --out)",
    )
    ap.add_argument(
        "--host-profile",
        type=int,
        default=0,
        metavar="SECONDS",
        help="after each timed decode of the 8B rows, sample the scheduler with py-spy for this "
        "many seconds of the same batch's decode (server_host_profile.md in --out)",
    )
    args = ap.parse_args(argv)
    try:
        pd.parse_variants(args.pd_variants)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if bad := set(args.spec_overlap.split(",")) - set(dspark.OVERLAP_FLAGS):
        raise SystemExit(
            f"--spec-overlap: {sorted(bad)} unknown; give any of {', '.join(dspark.OVERLAP_FLAGS)}"
        )
    sglang = [t for t in args.spec_sglang.split(",") if t]
    if bad := set(sglang) - set(SGLANG_SPEC_TARGETS):
        raise SystemExit(
            f"--spec-sglang: {sorted(bad)} unknown; give any of {', '.join(SGLANG_SPEC_TARGETS)}"
        )
    if sglang and (not args.spec or args.spec_chain or args.cpu_smoke):
        raise SystemExit(
            "--spec-sglang goes with --spec (forced acceptance) on a GPU: SGLang's DSpark worker "
            "refuses CPU, and the chain rows measure ATOM_DSPARK alone"
        )
    args.spec_sglang = sglang
    if args.spec_target_weights != "bf16" and (
        not args.spec or args.spec_chain or args.cpu_smoke or sglang
    ):
        raise SystemExit(
            "--spec-target-weights goes with --spec (forced acceptance) on a GPU, without "
            "--spec-sglang: SGLang's fp8 linear method has no CPU kernels, the chain rows serve "
            "their trained target as it is, and SGLang's DSpark worker would quantize its draft "
            "like the target"
        )
    if args.spec_sglang_only and not sglang:
        raise SystemExit("--spec-sglang-only: name SGLang's targets with --spec-sglang")
    if bad := set(args.m3_index.split(",")) - {"auto", "bf16", "fp8", "int4"}:
        raise SystemExit(f"--m3-index: {sorted(bad)} unknown; give auto, bf16, fp8 or int4")
    if bad := set(args.m3_kinds.split(",")) - {"sparse", "dense"}:
        raise SystemExit(f"--m3-kinds: {sorted(bad)} unknown; give sparse, dense or both")
    if args.quick:
        args.models, args.output = args.models or "llama3-8b", 128
    if args.cpu_smoke:
        args.spec, args.models, args.output = not (args.m3 or args.pd), "tiny", 8
        args.chain_batches = "1,2" if args.spec_chain else args.chain_batches
        args.workloads = args.workloads or ("2x1536" if args.m3 else "1x256" if args.pd else "2x64")
        args.m3_layers = 4 if args.m3 else args.m3_layers
        if Path(args.out).resolve() == (HERE / "results").resolve():
            raise SystemExit("--cpu-smoke: give a scratch --out; CPU figures never go to results/")
    args.models = args.models or ("llama3-8b" if args.spec else ",".join(GPU_MODELS))
    default_loads = (
        pd.DEFAULT_WORKLOADS
        if args.pd
        else m3.DEFAULT_WORKLOADS
        if args.m3
        else dspark.DEFAULT_WORKLOADS
        if args.spec
        else ",".join(f"{b}x{p}" for b, p in WORKLOADS)
    )
    args.workloads = args.workloads or default_loads
    return args


def run_suite(args, gbps: float, run_id: str, save=lambda rows: None) -> list[Row]:
    """Every server of the suite, one after another; ``save`` gets all rows so far after each
    (a call cut short keeps what it measured)."""
    workloads = [tuple(int(x) for x in w.split("x")) for w in args.workloads.split(",")]
    blocks = dspark.parse_blocks(args.spec_blocks)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.m3:
            return bench_m3(args, run_id, root, save)
        if args.pd:
            return bench_pd(args, run_id, root, save)
        if args.spec_chain:
            return bench_chain(args, run_id, save)
        for model in args.models.split(","):
            if args.spec:
                kvs = args.draft_kv.split(",")
                done = list(rows)
                rows += bench_spec(
                    model, workloads, args.output, gbps, run_id, root, args.logs, blocks, kvs,
                    args.cpu_smoke, lambda new, done=done: save(done + new), args.serial_plain,
                    args.spec_overlap.split(","), args.spec_sglang, not args.spec_sglang_only,
                    args.spec_target_weights,
                )  # fmt: skip
                continue
            for name in args.backends.split(","):
                rows += bench_server(
                    model, name, workloads, args.output, gbps, run_id, root, args.logs
                )
                save(rows)
    return rows


def _plot(fn, rows: list[dict], path: Path) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        print(f"[bench_server] matplotlib is not installed here: no {path.name}", flush=True)
        return
    fn(rows, path)


def write_results(out: Path, header: dict, rows: list[Row]) -> str:
    """server.json (merged with earlier runs), server.md (both tables), server.png; the md."""
    out.mkdir(parents=True, exist_ok=True)
    data = merge(out / "server.json", header, rows)
    (out / "server.json").write_text(json.dumps(data, indent=1))
    plain = any(not r.get("spec") and not r.get("pd") and not r.get("sparse") for r in data["rows"])
    md = table(data["rows"]) if plain else ""
    if any(r.get("spec") in ("none", "dspark") for r in data["rows"]):
        md += "\n\n" if md else ""
        md += "ATOM_DSPARK under forced acceptance, beside the plain atom bf16 decode:\n\n"
        md += dspark.spec_table(data["rows"])
    if any(str(r.get("spec", "")).startswith("chain-") for r in data["rows"]):
        md += "\n\n" if md else ""
        md += "ATOM_DSPARK with real acceptance (word-chain target, trained draft):\n\n"
        md += dspark.chain_table(data["rows"])
    if any(r.get("spec") in ("dspark", "chain-dspark") for r in data["rows"]):
        _plot(dspark.plot, data["rows"], out / "server_spec.png")
    if any(r.get("pd") for r in data["rows"]):
        md += "\n\n" if md else ""
        md += "P/D pair on one GPU (atom transfer backend) beside a unified server:\n\n"
        md += pd.pd_table(data["rows"])
        _plot(pd.plot, data["rows"], out / "server_pd.png")
    if any(r.get("sparse") for r in data["rows"]):
        md += "\n\n" if md else ""
        md += "sgl_atom's M3 class at MiniMax's shape, sparse beside all dense:\n\n"
        md += m3.m3_table(data["rows"])
        _plot(m3.plot, data["rows"], out / "server_m3.png")
    gbps = header["copy_gbps"]
    (out / "server.md").write_text(
        f"# Server benchmark\n\n{header['machine']}, {header['date']}, copy {gbps:.0f} GB/s\n\n"
        f"`{header['command']}`\n\n{md}\n"
    )
    if plain:
        _plot(plot, data["rows"], out / "server.png")
    return md


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # a SIGTERM (a `timeout` around the run) unwinds like Ctrl-C: every started server is stopped
    # on the way out instead of holding the GPU's memory after this process is gone
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
    gbps = cpu_copy_gbps() if args.cpu_smoke else measure_copy_gbps()
    print(f"[bench_server] copy rate {gbps:.0f} GB/s, run {run_id}", flush=True)
    import torch

    header = {
        "machine": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "command": "python benchmarks/bench_server.py " + " ".join(argv or sys.argv[1:]),
        "copy_gbps": round(gbps, 1),
    }
    if args.profile_steps:
        PROFILE.steps = args.profile_steps
        PROFILE.traces = Path(tempfile.mkdtemp(prefix="bench_server_traces-"))
        PROFILE.report = Path(args.out) / "server_profile.md"
        PROFILE.activities = ("CPU",) if args.cpu_smoke else ("CPU", "GPU")
        PROFILE.report.parent.mkdir(parents=True, exist_ok=True)
        PROFILE.report.write_text(
            f"# Decode steps under SGLang's profiler\n\n{header['machine']}, {header['date']}, "
            f"run {run_id}\n\n`{header['command']}`\n\n"
        )
    if args.host_profile:
        HOST.seconds = args.host_profile
        HOST.report = Path(args.out) / "server_host_profile.md"
        HOST.report.parent.mkdir(parents=True, exist_ok=True)
        HOST.report.write_text(
            f"# The scheduler's host time per decode step (py-spy)\n\n{header['machine']}, "
            f"{header['date']}, run {run_id}\n\n`{header['command']}`\n\n"
        )
    rows = run_suite(args, gbps, run_id, lambda rows: write_results(Path(args.out), header, rows))
    print(write_results(Path(args.out), header, rows))


if __name__ == "__main__":
    main()
