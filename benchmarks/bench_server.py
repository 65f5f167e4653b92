"""Server benchmark: real SGLang servers with dummy weights, SGLang's `triton` backend against
the atom backend at bf16 and fp8 KV, side by side in one run on one GPU.

    python benchmarks/bench_server.py --out benchmarks/results            # full suite
    python benchmarks/bench_server.py --out benchmarks/results --quick    # one 10-minute call

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
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
from sgl_atom.testing.server import Server  # noqa: E402

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
}
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
        e = self.extra
        return (
            self.model,
            self.backend,
            self.kv,
            self.batch,
            self.prompt,
            self.output,
            e.get("spec"),
            e.get("sparse"),
            e.get("pd"),
        )


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


def weight_bytes_per_step(shape: dict) -> float:
    """bf16 weight bytes read by one decode step (all layers and the LM head; the embedding is
    gathered, a few rows only)."""
    h, i, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    d = h // shape["num_attention_heads"]
    attn = h * d * (2 * shape["num_attention_heads"] + 2 * shape["num_key_value_heads"])
    mlp = 3 * h * i
    return 2.0 * (L * (attn + mlp) + h * shape["vocab_size"])


def kv_bytes_per_token(shape: dict, kv: str) -> float:
    d = shape["hidden_size"] // shape["num_attention_heads"]
    per_head = d * 2 if kv == "bf16" else d + 4  # fp8: bytes + one fp32 scale per (token, head)
    return 2.0 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * per_head


def byte_limit(shape: dict, kv: str, batch: int, prompt: int, output: int, gbps: float) -> float:
    step_bytes = weight_bytes_per_step(shape) + batch * (prompt + output / 2) * kv_bytes_per_token(
        shape, kv
    )
    return batch / (step_bytes / (gbps * 1e9))


def measure_copy_gbps() -> float:
    """Device copy rate (GB/s, read + write) in a child process, so this one holds no context."""
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); from common import copy_bandwidth; "
        "print(copy_bandwidth())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def random_prompts(batch: int, prompt: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(prompt)] for _ in range(batch)]


def generate(srv: Server, ids: list[list[int]], new: int) -> float:
    params = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
    t0 = time.perf_counter()
    outs = srv.post("/generate", {"input_ids": ids, "sampling_params": params}, timeout=1800)
    dt = time.perf_counter() - t0
    outs = outs if isinstance(outs, list) else [outs]
    got = [len(o["output_ids"]) for o in outs]
    if got != [new] * len(ids):
        raise RuntimeError(f"server returned {got} tokens, asked {new} for each of {len(ids)}")
    return dt


def log_decode_rate(log: str, batch: int) -> tuple[float, int]:
    """Median of SGLang's gen-throughput log lines with the whole batch running (first dropped:
    its interval can hold the end of the prefill)."""
    rates = [float(r) for n, r in GEN_RE.findall(log) if int(n) == batch][1:]
    if not rates:
        return 0.0, 0
    rates.sort()
    return rates[len(rates) // 2], len(rates)


def run_workload(srv, model, backend, kv, batch, prompt, output, gbps, run_id) -> Row:
    shape = MODELS[model]
    ids = random_prompts(batch, prompt, shape["vocab_size"], seed=batch * 100003 + prompt)
    ttft = generate(srv, ids, 1)
    mark = len(srv.log_text())
    total = generate(srv, ids, output)
    rate, n = log_decode_rate(srv.log_text()[mark:], batch)
    client = batch * (output - 1) / max(total - ttft, 1e-9)
    return Row(
        model,
        backend,
        kv,
        batch,
        prompt,
        output,
        decode_tok_s=round(rate or client, 1),
        ttft_s=round(ttft, 3),
        byte_limit_tok_s=round(byte_limit(shape, kv, batch, prompt, output, gbps), 1),
        run=run_id,
        decode_tok_s_client=round(client, 1),
        log_samples=n,
    )


def server_args(model: str, name: str, workloads, output: int) -> list[str]:
    max_bs = max(b for b, _ in workloads)
    ctx = max(p for _, p in workloads) + output + 64
    return [
        "--load-format",
        "dummy",
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
        "--cuda-graph-max-bs-decode",
        str(max_bs),
        "--mem-fraction-static",
        "0.85",
        *BACKENDS[name][2],
    ]


def bench_server(model, name, workloads, output, gbps, run_id, root, logs) -> list[Row]:
    backend, kv, _ = BACKENDS[name]
    path = write_model(model, root)
    srv = Server(path, server_args(model, name, workloads, output), name=f"{model}-{name}")
    rows: list[Row] = []
    try:
        srv.start(timeout=900)
        generate(srv, random_prompts(2, 1024, MODELS[model]["vocab_size"], 1), 8)  # warm-up
        for batch, prompt in workloads:
            row = run_workload(srv, model, backend, kv, batch, prompt, output, gbps, run_id)
            print(
                f"[bench_server] {model} {name} {batch}x{prompt}: {row.decode_tok_s} tok/s "
                f"(client {row.decode_tok_s_client}), TTFT {row.ttft_s} s, "
                f"limit {row.byte_limit_tok_s}",
                flush=True,
            )
            rows.append(row)
    finally:
        srv.stop()
        if logs:
            Path(logs, f"server_{model}_{name}.log").write_text(srv.log_text())
    return rows


def merge(path: Path, header: dict, rows: list[Row]) -> dict:
    """The results file with this run's rows in place of the same configurations' old ones."""
    old = json.loads(path.read_text()) if path.exists() else {"rows": []}
    mine = {r.key() for r in rows}

    def key_of(d):
        return (
            d["model"],
            d["backend"],
            d["kv"],
            d["batch"],
            d["prompt"],
            d["output"],
            d.get("spec"),
            d.get("sparse"),
            d.get("pd"),
        )

    kept = [d for d in old.get("rows", []) if key_of(d) not in mine]
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument(
        "--workloads",
        default=",".join(f"{b}x{p}" for b, p in WORKLOADS),
        help="comma-separated BATCHxPROMPT",
    )
    ap.add_argument("--output", type=int, default=256, help="new tokens per request")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="llama3-8b only, 128 new tokens: fits one 10-minute device call",
    )
    ap.add_argument("--logs", default="", help="folder for each server's full log")
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.output = "llama3-8b", 128
    workloads = [tuple(int(x) for x in w.split("x")) for w in args.workloads.split(",")]
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
    gbps = measure_copy_gbps()
    print(f"[bench_server] copy rate {gbps:.0f} GB/s, run {run_id}", flush=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as root:
        for model in args.models.split(","):
            for name in args.backends.split(","):
                rows += bench_server(
                    model, name, workloads, args.output, gbps, run_id, Path(root), args.logs
                )
    import torch

    header = {
        "machine": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "command": "python benchmarks/bench_server.py " + " ".join(argv or sys.argv[1:]),
        "copy_gbps": round(gbps, 1),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = merge(out / "server.json", header, rows)
    (out / "server.json").write_text(json.dumps(data, indent=1))
    md = table(data["rows"])
    (out / "server.md").write_text(
        f"# Server benchmark\n\n{header['machine']}, {header['date']}, copy {gbps:.0f} GB/s\n\n"
        f"`{header['command']}`\n\n{md}\n"
    )
    plot(data["rows"], out / "server.png")
    print(md)


if __name__ == "__main__":
    main()
