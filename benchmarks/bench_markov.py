"""The DSpark draft's Markov head (k block positions, each a bias GEMM, an add and an argmax
over the vocabulary) fused into one kernel per position against the unfused torch ops, side by
side.

    python3 benchmarks/bench_markov.py --out benchmarks/results

Llama-3's vocabulary (128256), rank 256, bf16 heads and base logits, k = 4, batch 1..64: the
whole refinement of one draft pass (``markov_refine``), as the draft's CUDA graph runs it; the
fused kernels also with w2 as e4m3fn rows and a scale per row (a draft served with
``--speculative-draft-model-quantization fp8``). GB/s counts the bytes the fused kernels must
move (w2 once per position, the base logits, the rows of w1); the copy ceiling is measured in
the same run. Timing: CUDA-graph replay medians.
Writes markov.{md,json,png} into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from common import copy_bandwidth, device_name, format_table, time_ms  # noqa: E402

VOCAB, RANK, K = 128256, 256, 4
FUSED = "SGL_ATOM_DSPARK_FUSED_MARKOV"


def refine_ms(batch: int, fused: bool, fp8_w2: bool = False) -> float:
    from sgl_atom.kernels.row_quant import reference_quant_rows_fp8

    from sgl_atom.speculative.dspark.markov import markov_refine

    g = torch.Generator(device="cuda").manual_seed(batch)
    base = torch.randn(batch, K, VOCAB, device="cuda", generator=g).bfloat16()
    w1, w2 = (torch.randn(VOCAB, RANK, device="cuda", generator=g).bfloat16() for _ in "12")
    scale = None
    if fp8_w2:
        w2, scale = reference_quant_rows_fp8(w2)
        scale = scale.view(-1)
    anchor = torch.randint(0, VOCAB, (batch,), device="cuda", generator=g)
    os.environ[FUSED] = "1" if fused else "0"
    try:
        return time_ms(lambda: markov_refine(base, anchor, w1, w2, w2_scale=scale))
    finally:
        os.environ.pop(FUSED, None)


def plot(rows: list[list], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [r[0] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(batches, [r[1] for r in rows], "o-", label="torch: mm + add + argmax")
    ax.plot(batches, [r[2] for r in rows], "s-", label="fused kernel")
    ax.plot(batches, [r[6] for r in rows], "^-", label="fused kernel, fp8 w2")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel(f"ms per draft pass (k={K})")
    ax.set_title(f"DSpark Markov head, vocab {VOCAB}, rank {RANK}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--batches", default="1,4,16,32,64")
    args = ap.parse_args()
    copy = copy_bandwidth()
    print(f"[bench_markov] {device_name()}, copy {copy:.0f} GB/s")
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        torch_ms, fused_ms = refine_ms(batch, False), refine_ms(batch, True)
        fp8_ms = refine_ms(batch, True, fp8_w2=True)
        rest = batch * VOCAB * 2 + batch * RANK * 2  # the base logits, the rows of w1
        gbs = K * (VOCAB * RANK * 2 + rest) / fused_ms / 1e6
        gbs8 = K * (VOCAB * (RANK + 4) + rest) / fp8_ms / 1e6
        rows.append([batch, torch_ms, fused_ms, torch_ms / fused_ms, gbs, gbs / copy, fp8_ms,
                     fp8_ms / fused_ms, gbs8 / copy])  # fmt: skip
        print(f"[bench_markov] batch {batch}: torch {torch_ms:.4f} ms, fused {fused_ms:.4f} ms, "
              f"fused fp8 w2 {fp8_ms:.4f} ms")  # fmt: skip
    header = ["batch", "torch ms", "fused ms", "speedup", "fused GB/s", "of copy",
              "fused fp8-w2 ms", "fp8-w2 vs bf16", "fp8-w2 of copy"]  # fmt: skip
    table = format_table(header, rows)
    cmd = "python3 benchmarks/bench_markov.py " + " ".join(sys.argv[1:])
    date = time.strftime("%Y-%m-%d")
    head = f"# DSpark Markov head\n\n{device_name()}, {date}, copy {copy:.0f} GB/s"
    text = f"{head}\n\n`{cmd}`\n\n{table}\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "markov.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "markov.json"), "w") as f:
        meta = {"device": device_name(), "date": date, "command": cmd, "copy_gbs": copy}
        json.dump({**meta, "header": header, "rows": rows}, f)
    try:
        plot(rows, os.path.join(args.out, "markov.png"))
    except ImportError as e:
        print(f"[bench_markov] no plot: {e}")
    print(table)


if __name__ == "__main__":
    main()
