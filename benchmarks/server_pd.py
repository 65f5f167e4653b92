"""P/D rows of the server benchmark (`bench_server.py --pd`): a prefill and a decode server on
one GPU, the atom transfer backend between their GPU pools, against a unified server of the same
model. The three start side by side, each pool capped (`--max-total-tokens`) to the workloads'
size, and are measured one at a time.

Per prompt length, batch 1, `reps` requests of fresh random tokens, max_new_tokens 1:
- TTFT: until the decode server answers (the pair) or the unified server does; the median;
- KV bytes per request, write time and GB/s: the prefill's `SGL_ATOM_PD_TRANSFER_LOG` line of
  each request (bytes written by NIXL, time from posting a chunk's writes to their landing).
Requests go to the pair as SGLang's PD router sends them (`sgl_atom.testing.pd`): the router
binary is not carried to the GPU machine.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

DEFAULT_WORKLOADS = "1x1024,1x4096,1x16384"
REPS = 5
# same-node GPU transports first (UCX picks among these)
PAIR_ENV = {
    "UCX_TLS": "cuda_ipc,cuda_copy,self,sm,tcp",
    "SGL_ATOM_PD_TRANSFER_LOG": "1",
    # UCX prints the protocol it picks per transfer size and memory kind into the server log
    "UCX_PROTO_INFO": "y",
}
# issue 16's targets
TARGET_TTFT, TARGET_GBPS_16K, TARGET_GBPS_1K = 1.15, 100.0, 30.0


def transfers(log: str) -> dict[int, tuple[int, int, float]]:
    """room -> (KV bytes, descriptors, write ms) from the prefill's transfer lines."""
    from sgl_atom.disagg.conn import TransferStats

    return {
        room: (stats.nbytes, stats.descriptors, round(stats.seconds * 1e3, 2))
        for room, (stats, _) in TransferStats.logged(log).items()
    }


def summarize(ttfts: list[float], moved: list[tuple[int, int, float]]) -> dict:
    """Median TTFT and, over the requests' transfer lines, median bytes, descriptors, write
    time and the rate of those medians."""
    out: dict = {"ttft_s": statistics.median(ttfts)}
    if moved:
        nbytes = statistics.median(m[0] for m in moved)
        ms = statistics.median(m[2] for m in moved)
        out |= {
            "kv_bytes": int(nbytes),
            "descriptors": int(statistics.median(m[1] for m in moved)),
            "transfer_ms": round(ms, 3),
            "transfer_gbps": round(nbytes / (ms * 1e-3) / 1e9, 2) if ms > 0 else 0.0,
        }
    return out


def pd_table(rows: list[dict]) -> str:
    """The pair beside the unified server of the same run and prompt length."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import format_table

    mine = [r for r in rows if r.get("pd")]
    unified = {(r["run"], r["model"], r["prompt"]): r for r in mine if r["pd"] == "unified"}
    out = []
    for r in sorted(mine, key=lambda r: (r["model"], r["prompt"], r["run"], r["pd"] != "unified")):
        base = unified.get((r["run"], r["model"], r["prompt"]))
        pair = r["pd"] == "pair"
        out.append(
            [
                r["model"],
                f"{r['batch']}x{r['prompt']}",
                r["pd"],
                r["ttft_s"],
                f"{r['ttft_s'] / base['ttft_s']:.2f}" if pair and base else "-",
                f"{r['kv_bytes'] / 2**20:.1f}" if pair and "kv_bytes" in r else "-",
                r.get("descriptors", "-") if pair else "-",
                r.get("transfer_ms", "-") if pair else "-",
                r.get("transfer_gbps", "-") if pair else "-",
                r["run"],
            ]
        )
    return format_table(
        [
            "model",
            "batch x prompt",
            "serving",
            "TTFT s (median)",
            f"vs unified (target <= {TARGET_TTFT} at 16K)",
            "KV MiB / request",
            "descriptors",
            "write ms",
            f"GB/s (target >= {TARGET_GBPS_16K:.0f} at 16K, >= {TARGET_GBPS_1K:.0f} at 1K)",
            "run",
        ],
        out,
    )


def plot(rows: list[dict], path: Path) -> None:
    """TTFT of the pair and the unified server, and the pair's transfer rate, per prompt length
    (newest run of each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latest = {(r["pd"], r["prompt"]): r for r in rows if r.get("pd")}
    prompts = sorted({p for _, p in latest})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, kind in enumerate(("unified", "pair")):
        vals = [latest[(kind, p)]["ttft_s"] if (kind, p) in latest else 0 for p in prompts]
        left.bar([x + 0.4 * (k - 0.5) for x in range(len(prompts))], vals, 0.4, label=kind)
    left.set_xticks(range(len(prompts)), [f"{p // 1024}K" for p in prompts])
    left.set_ylabel("TTFT s (batch 1)")
    left.legend()
    rates = [latest.get(("pair", p), {}).get("transfer_gbps", 0) for p in prompts]
    right.bar(range(len(prompts)), rates)
    right.set_xticks(range(len(prompts)), [f"{p // 1024}K" for p in prompts])
    right.set_ylabel("KV transfer GB/s")
    fig.suptitle("P/D pair on one GPU, atom transfer backend")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
