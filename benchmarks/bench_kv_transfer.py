# ruff: noqa: B023  (each lambda is timed before the loop moves on)
"""Head-cut pack/unpack (P/D transfer staging) on one GPU against the measured copy ceiling.

    python benchmarks/bench_kv_transfer.py --out benchmarks/results

One request of 128K tokens in a pool of twice that, pages shuffled. Regions: bf16 KV
[slots, 8, 128], fp8 KV (same bytes / 2), fp32 scales [slots, 8], index key [slots, 128] (whole
copy). GB/s counts bytes read + written (2 x staged bytes), like the copy ceiling.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from common import copy_bandwidth, device_name, format_table, import_kernels, time_ms

kt = import_kernels("kv_transfer")
TOKENS, HEADS, D = 131072, 8, 128
LAYOUTS = [
    ("tokmajor-p1", 1, None),
    ("tokmajor-p16", 16, None),
    ("tokmajor-p128", 128, None),
    ("headmajor-p128", 128, 1),
    ("page16-of-128", 128, 8),
]


def region(page: int, dtype: torch.dtype, unit: tuple) -> torch.Tensor:
    shape = (2 * TOKENS, HEADS, *unit)
    return (
        torch.randint(
            0,
            256,
            (torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size(),),
            dtype=torch.uint8,
            device="cuda",
        )
        .view(dtype)
        .view(shape)
    )


def case(name, page, runs, dtype, unit, head_count, copy) -> list:
    hs = min(2, HEADS - head_count)  # a cut that starts inside the run
    src, dst = region(page, dtype, unit), region(page, dtype, unit)
    n = TOKENS // page
    pages = torch.randperm(2 * TOKENS // page, device="cuda")[:n].to(torch.int32)
    dst_pages = torch.randperm(2 * TOKENS // page, device="cuda")[:n].to(torch.int32)
    layout = kt.RunLayout.of(src, page, runs)
    staging = torch.empty(layout.staging_bytes(n, head_count), dtype=torch.uint8, device="cuda")
    out = kt.pack_heads(src, pages, hs, head_count, staging, page_size=page, runs_per_page=runs)
    assert torch.equal(out, kt.reference_pack_heads(src, pages, hs, head_count, layout)), name
    t_pack = time_ms(
        lambda: kt.pack_heads(
            src, pages, hs, head_count, staging, page_size=page, runs_per_page=runs
        )
    )
    t_unpack = time_ms(
        lambda: kt.unpack_heads(
            staging, dst, dst_pages, hs, head_count, page_size=page, runs_per_page=runs
        )
    )
    moved = 2 * staging.numel()
    return [
        name,
        f"{HEADS}->{head_count} heads",
        staging.numel() / 2**20,
        t_pack,
        moved / t_pack / 1e6,
        moved / t_pack / 1e6 / copy,
        t_unpack,
        moved / t_unpack / 1e6,
        moved / t_unpack / 1e6 / copy,
    ]


def whole(copy) -> list:
    src = torch.randn(2 * TOKENS, D, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    pages = torch.randperm(2 * TOKENS // 128, device="cuda")[: TOKENS // 128].to(torch.int32)
    staging = torch.empty(TOKENS * D * 2, dtype=torch.uint8, device="cuda")
    out = kt.pack_pages(src, pages, staging, page_size=128)
    ref = src.view(-1, 128 * D)[pages.long()].reshape(-1).view(torch.uint8)
    assert torch.equal(out, ref), "pack_pages"
    t_pack = time_ms(lambda: kt.pack_pages(src, pages, staging, page_size=128))
    t_unpack = time_ms(lambda: kt.unpack_pages(staging, dst, pages, page_size=128))
    moved = 2 * staging.numel()
    return [
        "index key p128 (whole)",
        "replicated",
        staging.numel() / 2**20,
        t_pack,
        moved / t_pack / 1e6,
        moved / t_pack / 1e6 / copy,
        t_unpack,
        moved / t_unpack / 1e6,
        moved / t_unpack / 1e6 / copy,
    ]


def plot(rows: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    labels = [f"{r[0]}\n{r[1]}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r[5] for r in rows], 0.4, label="pack")
    ax.bar([i + 0.2 for i in x], [r[8] for r in rows], 0.4, label="unpack")
    ax.axhline(0.8, color="gray", ls="--", lw=1)
    ax.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=7)
    ax.set(ylabel="fraction of copy bandwidth", title="head-cut pack/unpack, 128K-token request")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    copy = copy_bandwidth()
    rows = []
    for name, page, runs in LAYOUTS:
        for hc in (2, 4, 8):
            rows.append(case(f"bf16 {name}", page, runs, torch.bfloat16, (D,), hc, copy))
    for name, page, runs in LAYOUTS[2:]:
        rows.append(case(f"fp8 {name}", page, runs, torch.float8_e4m3fn, (D,), 2, copy))
        rows.append(case(f"fp32 scale {name}", page, runs, torch.float32, (), 2, copy))
    rows.append(whole(copy))
    head = [
        "region",
        "cut",
        "staged MiB",
        "pack ms",
        "pack GB/s",
        "pack frac",
        "unpack ms",
        "unpack GB/s",
        "unpack frac",
    ]
    with open(os.path.join(args.out, "kv_transfer.json"), "w") as f:
        json.dump(dict(copy_gbs=copy, rows=rows), f, indent=1)
    plot(rows, os.path.join(args.out, "kv_transfer.png"))
    print(
        f"device: {device_name()}; copy ceiling {copy:.0f} GB/s (read+write); "
        f"request {TOKENS} tokens, "
        f"{HEADS} heads x {D}; GB/s = 2 x staged bytes / time\n"
    )
    print(format_table(head, rows))


if __name__ == "__main__":
    main()
