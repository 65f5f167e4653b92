"""The DSpark draft's GEMMs at a Llama-3-8B draft's shapes, bf16 (``F.linear``) against fp8
(``fp8_weights.fp8_matmul``: per-row activation quantization, then ``torch._scaled_mm``), at 4,
64 and 256 rows (a block of k = 4 rows for batch 1, 16 and 64). ``--mode graph`` (default)
times each call replayed from a CUDA graph, as the draft runs in a server; ``--mode eager``
times it launched from Python, host overhead included. For the down projection (the long K),
fp8 is also timed with K split in 2 and 4 (one ``_scaled_mm`` per part, summed in float32): at a
few rows its 32 output tiles leave most of the SMs idle. The activations' row quantization
is timed alone, and on its two-pass path beside.

    python benchmarks/bench_draft_fp8_gemm.py [--mode graph|eager]
"""

from __future__ import annotations

import argparse

import torch
from common import LLAMA3_8B_GEMMS
from sgl_atom.kernels.row_quant import quant as row_quant
from sgl_atom.kernels.row_quant import quant_rows_fp8

from sgl_atom.speculative.dspark.fp8_weights import Fp8Rows, fp8_matmul, quant_rows

SHAPES = {name: LLAMA3_8B_GEMMS[name] for name in ("lm_head", "gate_up", "down", "qkv")}
ROWS = (4, 64, 256)


def eager(f, n: int = 30) -> float:
    for _ in range(5):
        f()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda.synchronize()
    s.record()
    for _ in range(n):
        f()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n * 1000


def graph(f, n: int = 20) -> float:
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        f()
    for _ in range(3):
        g.replay()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda.synchronize()
    s.record()
    for _ in range(n):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("graph", "eager"), default="graph")
    timed = graph if ap.parse_args().mode == "graph" else eager
    print(torch.cuda.get_device_name(0), flush=True)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        w8 = Fp8Rows.of(w)
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = timed(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            f = timed(lambda x=x, w8=w8: fp8_matmul(x, w8, torch.bfloat16))
            q = timed(lambda x=x: quant_rows(x))
            q2 = two_pass(timed, x)
            split = ""
            if k > 8192:
                for parts in (2, 4):
                    t = timed(lambda x=x, w8=w8, p=parts: split_k(x, w8, p))
                    split += f", split-K {parts} {t:.1f} us x{t / b:.2f}"
            print(f"{name} M={m}: bf16 {b:.1f} us, fp8 {f:.1f} us (quant {q:.1f}, two-pass "
                  f"{q2:.1f}), x{f / b:.2f}{split}", flush=True)  # fmt: skip


def two_pass(timed, x: torch.Tensor) -> float:
    """The row quantization forced onto its chunked two-pass path (every row read twice in
    MAX_BLOCK chunks), beside the one-pass rows it takes up to MAX_ROW columns."""
    keep, row_quant.MAX_ROW = row_quant.MAX_ROW, 0
    try:
        return timed(lambda: quant_rows_fp8(x))
    finally:
        row_quant.MAX_ROW = keep


def split_k(x: torch.Tensor, w: Fp8Rows, parts: int) -> torch.Tensor:
    """fp8_matmul with K in ``parts`` slices: the row scales apply to every slice alike, so the
    scaled partial products sum to the whole."""
    xq, xs = quant_rows(x)
    step = xq.shape[1] // parts
    acc = None
    for i in range(parts):
        ks = slice(i * step, (i + 1) * step)
        part = torch._scaled_mm(xq[:, ks], w.q[:, ks].t(), scale_a=xs,
                                scale_b=w.scale.view(1, -1), out_dtype=torch.bfloat16)  # fmt: skip
        acc = part.float() if acc is None else acc.add_(part)
    return acc.to(torch.bfloat16)


if __name__ == "__main__":
    main()
