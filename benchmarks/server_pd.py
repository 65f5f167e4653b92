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
# the P/D targets
TARGET_TTFT, TARGET_GBPS_16K, TARGET_GBPS_1K = 1.15, 100.0, 30.0


def transfers(log: str) -> dict[int, tuple[int, int, float, float]]:
    """room -> (KV bytes, descriptors, write ms, of which posting ms) from the prefill's
    transfer lines."""
    from sgl_atom.disagg.conn import TransferStats

    return {
        room: (
            stats.nbytes,
            stats.descriptors,
            round(stats.seconds * 1e3, 2),
            round(stats.posting * 1e3, 2),
        )
        for room, (stats, _) in TransferStats.logged(log).items()
    }


def summarize(ttfts: list[float], moved: list[tuple[int, int, float, float]]) -> dict:
    """Median TTFT and, over the requests' transfer lines, median bytes, descriptors, write
    time, posting time and the rate of the bytes' and write time's medians."""
    out: dict = {"ttft_s": statistics.median(ttfts)}
    if moved:
        nbytes = statistics.median(m[0] for m in moved)
        ms = statistics.median(m[2] for m in moved)
        out |= {
            "kv_bytes": int(nbytes),
            "descriptors": int(statistics.median(m[1] for m in moved)),
            "transfer_ms": round(ms, 3),
            "posting_ms": round(statistics.median(m[3] for m in moved), 3),
            "transfer_gbps": round(nbytes / (ms * 1e-3) / 1e9, 2) if ms > 0 else 0.0,
        }
    return out


def role(kind: str, variant: str) -> str:
    """The server name of a pair's ``kind`` (prefill, decode) for ``variant``."""
    return f"{kind}-{variant}" if variant else kind


def parse_variants(spec: str) -> dict[str, dict[str, str]]:
    """``--pd-variants``: ``NAME:KEY=VALUE KEY=VALUE;NAME2:...`` -> name -> environment that
    each pair of that name adds to PAIR_ENV (assignments apart by spaces: values such as
    UCX_TLS's hold commas); an empty spec is the one pair with PAIR_ENV. Names are what the
    rows and the table call the pairs."""
    out: dict[str, dict[str, str]] = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, assigns = part.partition(":")
        name = name.strip()
        if not name or not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"--pd-variants: {part!r} needs a name of letters, digits, - or _")
        if name in out:
            raise ValueError(f"--pd-variants: {name!r} is given twice")
        env: dict[str, str] = {}
        for kv in assigns.split():
            key, eq, value = kv.partition("=")
            if not eq or not key:
                raise ValueError(f"--pd-variants {name}: {kv!r} is not KEY=VALUE")
            env[key.strip()] = value.strip()
        out[name] = env
    return out or {"": {}}


def pd_table(rows: list[dict]) -> str:
    """The pair beside the unified server of the same run and prompt length."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import format_table

    mine = [r for r in rows if r.get("pd")]
    unified = {(r["run"], r["model"], r["prompt"]): r for r in mine if r["pd"] == "unified"}
    out = []

    def order(r: dict) -> tuple:
        return r["model"], r["prompt"], r["run"], r["pd"] != "unified", r.get("pd_variant", "")

    for r in sorted(mine, key=order):
        base = unified.get((r["run"], r["model"], r["prompt"]))
        pair = r["pd"] == "pair"
        out.append(
            [
                r["model"],
                f"{r['batch']}x{r['prompt']}",
                f"{r['pd']} ({r['pd_variant']})" if r.get("pd_variant") else r["pd"],
                r["ttft_s"],
                f"{r['ttft_s'] / base['ttft_s']:.2f}" if pair and base else "-",
                f"{r['kv_bytes'] / 2**20:.1f}" if pair and "kv_bytes" in r else "-",
                r.get("descriptors", "-") if pair else "-",
                r.get("transfer_ms", "-") if pair else "-",
                r.get("posting_ms", "-") if pair else "-",
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
            "of it posting ms",
            f"GB/s (target >= {TARGET_GBPS_16K:.0f} at 16K, >= {TARGET_GBPS_1K:.0f} at 1K)",
            "run",
        ],
        out,
    )


def plot(rows: list[dict], path: Path) -> None:
    """TTFT of each pair and the unified server, and each pair's transfer rate, per prompt length
    (newest run of each; one bar per pair variant)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latest = {(r["pd"], r.get("pd_variant", ""), r["prompt"]): r for r in rows if r.get("pd")}
    prompts = sorted({p for _, _, p in latest})
    kinds = sorted({(k, v) for k, v, _ in latest}, key=lambda kv: (kv[0] != "unified", kv[1]))
    pairs = [kv for kv in kinds if kv[0] == "pair"]
    width = 0.8 / max(1, len(kinds))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, (kind, variant) in enumerate(kinds):
        vals = [latest.get((kind, variant, p), {}).get("ttft_s", 0) for p in prompts]
        xs = [x + width * (k - (len(kinds) - 1) / 2) for x in range(len(prompts))]
        left.bar(xs, vals, width, label=f"{kind} ({variant})" if variant else kind)
    left.set_xticks(range(len(prompts)), [f"{p // 1024}K" for p in prompts])
    left.set_ylabel("TTFT s (batch 1)")
    left.legend()
    width = 0.8 / max(1, len(pairs))
    for k, (kind, variant) in enumerate(pairs):
        rates = [latest.get((kind, variant, p), {}).get("transfer_gbps", 0) for p in prompts]
        xs = [x + width * (k - (len(pairs) - 1) / 2) for x in range(len(prompts))]
        right.bar(xs, rates, width, label=variant or "pair")
    right.set_xticks(range(len(prompts)), [f"{p // 1024}K" for p in prompts])
    right.set_ylabel("KV transfer GB/s")
    if len(pairs) > 1:
        right.legend()
    fig.suptitle("P/D pair on one GPU, atom transfer backend")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
