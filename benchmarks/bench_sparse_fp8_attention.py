"""Sparse attention over fp8 K/V: the e4m3 bytes moved into bf16 bits (kv_mode "bits", the
default with a bf16 q) against the bf16 cast (kv_mode "bf16"), side by side, and the bf16 cache.

    python3 benchmarks/bench_sparse_fp8_attention.py --out benchmarks/results

Shapes as bench_sparse_attention.py: 64 q / 8 KV heads, head_dim 128, page 128, top-16 blocks of
128 tokens per (token, KV head) chosen at random over a 128K context, batch 1..64; the attention
part only (sparse_attention_fwd with its split merge). GB/s counts the selected K+V bytes (+ the
fp8 scales). Timing: CUDA-graph replay medians; the copy ceiling is measured in the same run.
Writes sparse_fp8_attention.{md,json,png} into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from common import (  # noqa: E402
    copy_bandwidth,
    device_name,
    format_table,
    import_kernels,
    time_ms,
)

sa = import_kernels("sparse_attention")
kvq = import_kernels("kv_quant")
HQ, HKV, D, PAGE, TOPK, CTX = 64, 8, 128, 128, 16, 131072


def plot(rows: list[list], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("bf16 cache", "fp8 bits", "fp8 bf16cast (old)"):
        rs = [r for r in rows if r[1] == name]
        ax.plot([r[0] for r in rs], [r[4] for r in rs], "o-", label=name)
    ax.set(xscale="log", xlabel="batch", ylabel="fraction of copy rate",
           title="sparse attention part, 128K, top-16 blocks")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    copy = copy_bandwidth()
    head = (f"{device_name()}: copy {copy:.0f} GB/s (read+write); {HQ} q / {HKV} kv heads, d{D}, "
            f"page {PAGE}, top-{TOPK} blocks of 128 over {CTX // 1024}K")  # fmt: skip
    print(head)
    rows = []
    for batch in (1, 8, 64):
        slots = batch * CTX
        k = torch.randn(slots, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        k8 = torch.empty(slots, HKV, D, device="cuda", dtype=torch.float8_e4m3fn)
        v8 = torch.empty_like(k8)
        ks = torch.empty(slots, HKV, device="cuda")
        vs = torch.empty_like(ks)
        kvq.store_kv(k, v, k8, v8, torch.arange(slots, device="cuda"), ks, vs)
        pages = CTX // PAGE
        table = torch.randperm(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages)
        seq = torch.full((batch,), CTX, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
        sel = torch.stack(
            [torch.randperm(CTX // 128, device="cuda")[:TOPK].sort().values
             for _ in range(batch * HKV)]
        ).to(torch.int32).view(batch, HKV, TOPK)  # fmt: skip
        cnt = torch.full((batch, HKV), TOPK, dtype=torch.int32, device="cuda")
        outs, times = {}, {}
        for name, kc, vc, scales, mode in (
            ("bf16 cache", k, v, (None, None), None),
            ("fp8 bits", k8, v8, (ks, vs), "bits"),
            ("fp8 bf16cast (old)", k8, v8, (ks, vs), "bf16"),
        ):

            def run(kc=kc, vc=vc, scales=scales, mode=mode, q=q, t=table, n=seq, s=sel, c=cnt):
                return sa.sparse_attention_fwd(q, kc, vc, t, n, s, c, PAGE, D**-0.5,
                                               k_scale=scales[0], v_scale=scales[1],
                                               kv_mode=mode)  # fmt: skip

            outs[name] = run().float()
            times[name] = time_ms(run)
        err = (outs["fp8 bits"] - outs["fp8 bf16cast (old)"]).abs().max().item()
        for name, ms in times.items():
            per_token = 2 * D * (1 if "fp8" in name else 2) + (8 if "fp8" in name else 0)
            gbs = batch * HKV * TOPK * 128 * per_token / ms / 1e6
            speedup = times["fp8 bf16cast (old)"] / ms
            rows.append([batch, name, ms, gbs, gbs / copy, speedup, err if "bits" in name else "-"])
            print(f"  b{batch:<3d} {name:19s} {ms:.4f} ms  {gbs:7.0f} GB/s  {gbs / copy:.2f} of "
                  f"copy  x{speedup:.2f} vs old fp8")  # fmt: skip
        print(f"  b{batch} max |bits - cast| {err:.3g}")
        del k, v, k8, v8, ks, vs
        torch.cuda.empty_cache()
    header = ["batch", "KV", "ms", "GB/s", "frac of copy", "x vs fp8 cast", "max |bits - cast|"]
    table = format_table(header, rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sparse_fp8_attention.md"), "w") as f:
        f.write(f"{head}\n\n{table}\n")
    with open(os.path.join(args.out, "sparse_fp8_attention.json"), "w") as f:
        json.dump(dict(copy_gbs=copy, rows=rows), f, indent=1, default=str)
    plot(rows, os.path.join(args.out, "sparse_fp8_attention.png"))
    print(table)


if __name__ == "__main__":
    main()
