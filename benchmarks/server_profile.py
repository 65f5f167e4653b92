"""Where a decode step's time goes inside a running server (`bench_server.py --profile-steps N`).

While a timed batch decodes, SGLang's own profiler (``/start_profile`` with ``num_steps``,
torch.profiler with CPU and GPU activities) records N scheduler steps into a Chrome trace per
rank. :func:`analyze` reads the trace and splits the recorded span into:

* GPU busy time: the union of the kernel and device-copy intervals (kernels replayed from a
  CUDA graph are reported one by one);
* GPU idle time: the rest, listed by gap, longest first, each with the host operations
  running across it (what the GPU waited for: scheduler work, a synchronising copy, a
  launch);
* kernels by name: total time per step and launches per step (the costliest 40, the rest
  summed in one row). A name launched with several shapes (grid, block, shared memory, as the
  trace's kernel events record them) gets one row per shape, so that one kernel serving two
  callers (the target's verify and the draft's block attention, say) is split between them.

The step count is the profiled one where known, else the CUDA graph launches divided by
``graphs_per_step`` (1 for a plain decode, 2 for ATOM_DSPARK: the draft's graph and the
target's verify graph). :func:`report` prints it as markdown.

    python benchmarks/server_profile.py TRACE.json.gz [--graphs-per-step 2]
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "python_function", "user_annotation", "cuda_runtime", "cuda_driver")
GRAPH_LAUNCH = "cudaGraphLaunch"


def load(path: Path) -> list[dict]:
    """The complete ("X") events of a Chrome trace (.json or .json.gz)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def analyze(
    events: list[dict],
    steps: int | None = None,
    graphs_per_step: int = 1,
    top: int = 12,
    top_kernels: int = 40,
) -> dict:
    """Per-step figures of one rank's trace (times in ms); see the module docstring.
    ``steps``: the steps the trace holds when known (the profiled count), else counted from
    the CUDA graph launches. The ``top_kernels`` costliest kernels are listed by name, the rest
    summed in ``other_kernels``; the ``top`` longest idle gaps are listed."""
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    host = [e for e in events if e.get("cat") in HOST_CATS]
    if not gpu:
        return {"steps": 0, "note": "no GPU activity in the trace"}
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    t0, t1 = busy[0][0], busy[-1][1]
    launches = sum(1 for e in host if e["name"] == GRAPH_LAUNCH and t0 - 1e4 <= e["ts"] <= t1)
    steps = steps or max(1, round(launches / max(1, graphs_per_step)))
    gaps = [(b[0] - a[1], a[1], b[0]) for a, b in zip(busy, busy[1:], strict=False)]
    gaps.sort(reverse=True)
    by_name: dict[str, list[float]] = defaultdict(list)
    shapes: dict[str, set[str]] = defaultdict(set)
    shaped = [(e, _launch_shape(e)) for e in gpu]
    for e, shape in shaped:
        shapes[e["name"]].add(shape)
    for e, shape in shaped:
        name = e["name"] if len(shapes[e["name"]]) == 1 else f"{e['name']} [{shape}]"
        by_name[name].append(e["dur"])
    kernels = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    span = (t1 - t0) / 1e3
    busy_ms = sum(b - a for a, b in busy) / 1e3
    return {
        "steps": steps,
        "graph_launches": launches,
        "wall_ms_per_step": span / steps,
        "gpu_busy_ms_per_step": busy_ms / steps,
        "gpu_idle_ms_per_step": (span - busy_ms) / steps,
        "gpu_busy_fraction": busy_ms / span if span else 0.0,
        "kernels": [
            {
                "name": name,
                "ms_per_step": sum(durs) / 1e3 / steps,
                "launches_per_step": len(durs) / steps,
            }
            for name, durs in kernels[:top_kernels]
        ],
        "other_kernels": {
            "names": len(kernels[top_kernels:]),
            "ms_per_step": sum(sum(d) for _, d in kernels[top_kernels:]) / 1e3 / steps,
            "launches_per_step": sum(len(d) for _, d in kernels[top_kernels:]) / steps,
        },
        "gaps": [
            {"ms": gap / 1e3, "host": _host_ops_across(host, start, end)}
            for gap, start, end in gaps[:top]
        ],
    }


def _launch_shape(event: dict) -> str:
    """A kernel event's launch shape as the trace records it ("grid 512x1x1, block 128x1x1,
    smem 49152"), or "" where it records none (copies, memsets)."""
    args = event.get("args") or {}
    parts = []
    for key, label in (("grid", "grid"), ("block", "block")):
        if isinstance(args.get(key), list):
            parts.append(f"{label} {'x'.join(str(v) for v in args[key])}")
    if "shared memory" in args:
        parts.append(f"smem {args['shared memory']}")
    return ", ".join(parts)


def short_name(name: str, width: int = 90) -> str:
    """``name`` cut to ``width`` characters for a table, its launch shape (``" [...]"``), when
    named, kept whole."""
    if len(name) <= width:
        return name
    head, sep, shape = name.partition(" [")
    keep = max(20, width - len(sep + shape))
    return (head if len(head) <= keep else head[: keep - 3] + "...") + sep + shape


def _host_ops_across(host: list[dict], start: float, end: float, most: int = 4) -> list[str]:
    """The host operations overlapping [start, end], innermost (shortest) first."""
    over = [e for e in host if e["ts"] < end and e["ts"] + e["dur"] > start]
    over.sort(key=lambda e: e["dur"])
    names: list[str] = []
    for e in over:
        if e["name"] not in names:
            names.append(e["name"])
        if len(names) == most:
            break
    return names


def report(label: str, a: dict) -> str:
    """Markdown of one :func:`analyze` result."""
    if not a.get("steps"):
        return f"### {label}\n\n{a.get('note', 'nothing recorded')}\n"
    lines = [
        f"### {label}",
        "",
        f"{a['steps']} steps ({a['graph_launches']} CUDA graph launches): "
        f"{a['wall_ms_per_step']:.3f} ms per step, GPU busy {a['gpu_busy_ms_per_step']:.3f} ms "
        f"({a['gpu_busy_fraction']:.0%}), idle {a['gpu_idle_ms_per_step']:.3f} ms",
        "",
        "| kernel | ms/step | launches/step |",
        "|---|---|---|",
    ]
    for k in a["kernels"]:
        name = short_name(k["name"])
        lines.append(f"| `{name}` | {k['ms_per_step']:.3f} | {k['launches_per_step']:.1f} |")
    rest = a.get("other_kernels") or {}
    if rest.get("names"):
        lines.append(
            f"| {rest['names']} other kernels | {rest['ms_per_step']:.3f} | "
            f"{rest['launches_per_step']:.1f} |"
        )
    lines += ["", "| GPU idle gap ms | host operations across it (innermost first) |", "|---|---|"]
    for g in a["gaps"]:
        lines.append(f"| {g['ms']:.3f} | {', '.join(f'`{h}`' for h in g['host']) or '-'} |")
    return "\n".join(lines) + "\n"


def profile_decode(
    post: Callable[[str, dict], dict],
    run: Callable[[], object],
    out_dir: Path,
    prefix: str,
    steps: int,
    timeout_s: float = 120,
    activities: tuple[str, ...] = ("CPU", "GPU"),
) -> Path | None:
    """Ask the server (``post(path, payload)``) to profile its next ``steps`` prefill and
    ``steps`` decode steps separately (SGLang's ``profile_by_stage``), then ``run`` a batch
    that decodes for more than ``steps`` steps; the decode trace of TP rank 0, or None when
    none was written within ``timeout_s``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pattern = f"{prefix}-*TP-0*DECODE.trace.json.gz"
    before = set(out_dir.glob(pattern))
    post(
        "/start_profile",
        {
            "output_dir": str(out_dir),
            "num_steps": steps,
            "activities": list(activities),
            "profile_by_stage": True,
            "profile_prefix": prefix,
        },
    )
    run()
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        new = sorted(set(out_dir.glob(pattern)) - before)
        if new:
            size = -1
            while size != new[0].stat().st_size:  # written once the last step ended
                size = new[0].stat().st_size
                time.sleep(1.0)
            return new[0]
        time.sleep(0.5)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="+", type=Path)
    ap.add_argument("--steps", type=int, default=None, help="steps the trace holds, if known")
    ap.add_argument("--graphs-per-step", type=int, default=1)
    args = ap.parse_args()
    for path in args.trace:
        print(report(path.name, analyze(load(path), args.steps, args.graphs_per_step)))


if __name__ == "__main__":
    main()
