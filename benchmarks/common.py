"""Shared benchmark helpers: import shim, timing, and the two ceilings measured in each run.

Usage from a benchmark script run as `python benchmarks/bench_x.py`:

    from common import import_kernels, time_ms, copy_bandwidth, matmul_rate
    pa = import_kernels("paged_attention")  # sgl_atom.kernels.* when installed, else kernels.*
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A Llama-3-8B layer's GEMMs and its LM head, (N, K) of ``F.linear(x[M, K], w[N, K])``: the 8B
# target's shapes, and a DSpark draft's of the same width
LLAMA3_8B_GEMMS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                   "down": (4096, 14336), "lm_head": (128256, 4096)}  # fmt: skip


def import_kernels(family: str):
    """`sgl_atom.kernels.<family>` when sgl_atom is installed, else `kernels.<family>` from here."""
    try:
        return importlib.import_module(f"sgl_atom.kernels.{family}")
    except ImportError:
        if REPO_ROOT not in sys.path:
            sys.path.insert(0, REPO_ROOT)
        return importlib.import_module(f"kernels.{family}")


def time_ms(fn: Callable[[], object], graph: bool = True, rep: int = 100) -> float:
    """Median ms per call of `fn`: replays of one CUDA graph of back-to-back calls (about 10 ms
    of them) when `graph` (no launch gaps; Triton's do_bench_cudagraph), else Triton's
    do_bench over `rep` ms (one launch per call, L2 flushed between calls)."""
    import triton.testing

    if not graph:
        return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")
    fn()  # compile outside the timing (do_bench_cudagraph warms up with one call)
    return triton.testing.do_bench_cudagraph(fn, rep=min(rep, 10), return_mode="median")


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy rate in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), graph=False)
    return 2 * nbytes / ms / 1e6


def matmul_rate(n: int = 8192) -> float:
    """bf16 n×n×n matmul rate in TFLOP/s on random data."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda: a @ b, graph=False)
    return 2 * n**3 / ms / 1e9


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def format_table(header: list[str], rows: list[list[object]]) -> str:
    """A fixed-width markdown table (the last thing a benchmark prints)."""
    cells = [header] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])
