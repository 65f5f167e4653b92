"""Block scoring over a packed 4-bit index cache: its two dot kinds (fp16 dots of the nibbles
made fp16, integer MMAs over the nibbles as stored: `block_select.INT4_DOT`) and scoring tilings,
side by side with the fp8 index's default, at batch 64 x 128K (the sparse kernel target's shape),
on one GPU.

    python3 benchmarks/probe_int4_scoring.py     (benchmarks/results/probe_int4_scoring.log)

select_blocks (score + top-k) per (dots, blocks per program, pipeline stages, warps); the pool
and timing are bench_sparse_attention.py's (CUDA-graph replay medians).
"""

from __future__ import annotations

import itertools

import bench_sparse_attention as bench


def main() -> None:
    pool = bench.Pool(64 * 131072 + 8 * bench.PAGE * 64)
    runs = [("fp8", "-", None, 2, 4)]
    runs += [("int4", *c) for c in itertools.product(("f16", "i8"), (None, 8), (2, 3), (4, 8))]
    for kind, dots, nb, stages, warps in runs:
        if kind == "int4":
            bench.sa.block_select.INT4_DOT = dots
        cfg = {kind: (nb, (stages, warps, True))}
        t = bench.measure(pool, 64, 131072, kind, cfg, select_only=True)["t_select"]
        print(f"{kind} {dots} nb{nb} s{stages} w{warps}: select {t:.4f} ms", flush=True)


if __name__ == "__main__":
    main()
