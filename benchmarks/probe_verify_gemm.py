"""The target model's GEMMs at a DSpark verify's row counts (Llama-3-8B shapes): cuBLAS through
``F.linear`` (what SGLang's bf16 linear layers call) at 64 rows (a plain decode of 64 requests),
256, 320 (64 requests x k + 1 = 5 verify rows) and 384, beside a Triton GEMM over a few tilings
at the same rows (``--persistent`` adds a persistent one: TMA descriptors, one program per SM
walking output tiles smaller than cuBLAS's, so its last pass over the SMs leaves less idle, and
each tiling again with that last partial pass split along K over the programs it leaves idle), and
cuBLAS again under other settings torch offers (``--blas``: cuBLASLt as the backend, bf16
reduced-precision reductions off) and, with ``--lt-algos N``, each of the first N candidate
algorithms cuBLASLt's heuristic offers for the shape (``cublaslt_algos.py``), the fastest of
them against cuBLAS's own pick. Each call replayed from a CUDA graph, over enough copies of the
weight that none is still in L2 when it is read again; TFLOP/s counts the useful products only
(2 M N K), so the tile rows a kernel computes past M show as a lower rate. A probe: it prints
figures, it changes nothing the server runs.

    python benchmarks/probe_verify_gemm.py [--rows 64,256,320,384] [--blas cublaslt,no-rr]
                                           [--no-triton] [--persistent] [--lt-algos 16]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from common import LLAMA3_8B_GEMMS, device_name, format_table, matmul_rate, time_ms

# (block_m, block_n, block_k, num_warps, num_stages)
TILINGS = ((64, 128, 64, 4, 4), (64, 256, 64, 8, 3), (64, 256, 64, 4, 4), (128, 128, 64, 8, 4),
           (128, 256, 64, 8, 3), (64, 128, 128, 4, 3))  # fmt: skip


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # y[M, N] = x[M, K] @ w[N, K]^T; the M tiles of one N tile run next to each other so the
    # weight tile is read from HBM once and from L2 by the others
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = pid % num_m, pid // num_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x = x_ptr + rm[:, None] * K + rk[None, :]
    w = w_ptr + rn[:, None] * K + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(0, K, BLOCK_K):
        a = tl.load(x, mask=rm[:, None] < M, other=0.0)
        b = tl.load(w, mask=rn[:, None] < N, other=0.0)
        acc = tl.dot(a, b.T, acc)
        x += BLOCK_K
        w += BLOCK_K
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))  # fmt: skip


def triton_linear(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, tiling) -> None:
    bm, bn, bk, warps, stages = tiling
    m, k = x.shape
    n = w.shape[0]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _linear_kernel[grid](x, w, y, m, n, k, bm, bn, bk, num_warps=warps, num_stages=stages)


# (block_m, block_n, block_k, num_warps, num_stages) of the persistent kernel; smaller tiles than
# cuBLAS's 128 x 160 leave less of the last pass over the SMs idle. Each is timed as it is and,
# where the tiles do not fill whole passes, with its last partial pass split along K (below).
PERSISTENT_TILINGS = ((64, 128, 64, 4, 3), (64, 128, 128, 4, 3), (64, 256, 64, 4, 3),
                      (64, 256, 64, 4, 4), (64, 256, 64, 8, 3), (128, 128, 64, 8, 3),
                      (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4))  # fmt: skip


@triton.jit
def _tile_dot(xd, wd, pm, pn, k_lo, k_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):  # fmt: skip
    # one output tile's products over K blocks [k_lo, k_hi), float32
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kk in range(k_lo, k_hi):
        a = xd.load([pm * BLOCK_M, kk * BLOCK_K])
        b = wd.load([pn * BLOCK_N, kk * BLOCK_K])
        acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def _persistent_linear_kernel(
    x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROGRAMS: tl.constexpr,
    SPLIT: tl.constexpr,
):  # fmt: skip
    # y[M, N] = x[M, K] @ w[N, K]^T through TMA descriptors (rows past M read as zeros and are not
    # stored); program p takes output tiles p, p + PROGRAMS, ... with the M tiles of one N tile
    # next to each other, so the weight tile comes from HBM once and from L2 for the others.
    # SPLIT > 1: the tiles of the last partial pass (tiles % PROGRAMS of them) are each cut into
    # SPLIT slices of K, one slice per program, so that pass is as long as 1 / SPLIT of a tile;
    # a slice stores its float32 partial, and the tile's last slice to finish (a counter per
    # tile, reset by it for the next call) adds the SPLIT partials in slice order and stores y.
    xd = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1],
                                   block_shape=[BLOCK_M, BLOCK_K])  # fmt: skip
    wd = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1],
                                   block_shape=[BLOCK_N, BLOCK_K])  # fmt: skip
    yd = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[N, 1],
                                   block_shape=[BLOCK_M, BLOCK_N])  # fmt: skip
    num_m = tl.cdiv(M, BLOCK_M)
    tiles = num_m * tl.cdiv(N, BLOCK_N)
    k_iters = tl.cdiv(K, BLOCK_K)
    whole = tiles - tiles % PROGRAMS if SPLIT > 1 else tiles
    pid = tl.program_id(0)
    for t in tl.range(pid, whole, PROGRAMS, flatten=True):
        pm, pn = t % num_m, t // num_m
        acc = _tile_dot(xd, wd, pm, pn, 0, k_iters, BLOCK_M, BLOCK_N, BLOCK_K)
        yd.store([pm * BLOCK_M, pn * BLOCK_N], acc.to(y_ptr.dtype.element_ty))
    if SPLIT > 1:
        if pid < (tiles - whole) * SPLIT:
            slot, s = pid // SPLIT, pid % SPLIT
            t = whole + slot
            pm, pn = t % num_m, t // num_m
            per = tl.cdiv(k_iters, SPLIT)
            acc = _tile_dot(xd, wd, pm, pn, s * per, tl.minimum(s * per + per, k_iters),
                            BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
            tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            parts = part_ptr + slot * SPLIT * BLOCK_M * BLOCK_N + tile
            tl.store(parts + s * BLOCK_M * BLOCK_N, acc)
            tl.debug_barrier()  # every thread's partial stored before the counter moves
            if tl.atomic_add(count_ptr + slot, 1, sem="acq_rel") == SPLIT - 1:
                acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                for j in range(SPLIT):
                    acc += tl.load(parts + j * BLOCK_M * BLOCK_N, cache_modifier=".cg")
                yd.store([pm * BLOCK_M, pn * BLOCK_N], acc.to(y_ptr.dtype.element_ty))
                tl.atomic_xchg(count_ptr + slot, 0)


def last_pass(tiles: int, programs: int) -> int:
    """How many tiles the last pass of ``programs`` programs over ``tiles`` tiles holds (0: the
    last of several passes is whole)."""
    return tiles % programs if tiles > programs else tiles


def tail_split(tiles: int, programs: int) -> int:
    """How many K slices each tile of the last partial pass is cut into (1: none): as many as
    fit the programs that pass would otherwise leave idle."""
    tail = last_pass(tiles, programs)
    return max(1, programs // tail) if tail else 1


def persistent_split(m: int, n: int, tiling, device: torch.device) -> int:
    """The K slices ``persistent_linear`` cuts each tile of its last partial pass into."""
    bm, bn, *_, split_tail = tiling
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    return tail_split(tiles, _sm_count(device)) if split_tail else 1


_split_scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def persistent_linear(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, tiling) -> None:
    """``tiling``: (block_m, block_n, block_k, num_warps, num_stages, split_tail)."""
    bm, bn, bk, warps, stages, split_tail = tiling
    m, k = x.shape
    n = w.shape[0]
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = persistent_split(m, n, tiling, x.device)
    programs = _sm_count(x.device) if split > 1 else min(_sm_count(x.device), tiles)
    key = (m, n, bm, bn, split, x.device)
    if key not in _split_scratch:  # partials and counters (zero; every call leaves them zero)
        slots = max(1, last_pass(tiles, programs))
        _split_scratch[key] = (
            torch.empty(slots * split * bm * bn, dtype=torch.float32, device=x.device),
            torch.zeros(slots, dtype=torch.int32, device=x.device),
        )
    parts, counts = _split_scratch[key]
    _persistent_linear_kernel[(programs,)](x, w, y, parts, counts, m, n, k, bm, bn, bk, programs,
                                           split, num_warps=warps, num_stages=stages)  # fmt: skip


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # the Triton interpreter on CPU: a few programs, several tiles each
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _descriptor_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory Triton asks for when a kernel builds TMA descriptors on the device."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


# torch's settings for bf16 F.linear that may change the kernel cuBLAS picks (default: neither)
BLAS_SETTINGS = ("cublaslt", "no-rr")


def blas_setting(name: str) -> None:
    """Sets one of ``BLAS_SETTINGS`` ("default" restores torch's defaults)."""
    torch.backends.cuda.preferred_blas_library("cublaslt" if name == "cublaslt" else "cublas")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = name != "no-rr"


def per_weight_ms(call, ws: list[torch.Tensor]) -> float:
    """ms per call of ``call(w)``, timed over one call per weight copy in turn."""
    return time_ms(lambda: [call(v) for v in ws]) / len(ws)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="64,256,320,384")
    ap.add_argument("--blas", default="", help=f"comma list of {BLAS_SETTINGS}, each timed too")
    ap.add_argument("--no-triton", action="store_true", help="cuBLAS only")
    ap.add_argument("--persistent", action="store_true",
                    help="time the persistent TMA kernel's tilings too")  # fmt: skip
    ap.add_argument(
        "--lt-algos",
        type=int,
        default=0,
        help="time the first N of cuBLASLt's candidate algorithms per shape",
    )
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    settings = [b for b in args.blas.split(",") if b]
    for b in settings:
        if b not in BLAS_SETTINGS:
            ap.error(f"--blas: {b!r} is not one of {BLAS_SETTINGS}")
    variants = [] if args.no_triton else [(triton_linear, t) for t in TILINGS]
    if args.persistent:
        triton.set_allocator(_descriptor_scratch)
        variants += [(persistent_linear, (*t, split)) for t in PERSISTENT_TILINGS
                     for split in (False, True)]  # fmt: skip
    peak = matmul_rate()
    print(f"{device_name()}: bf16 matmul 8192^3 {peak:.0f} TFLOP/s")
    table, lt_table = [], []
    # per row count: a target layer's four GEMMs (qkv, o, gate/up, down) summed, ms, by what
    # ran each one; "cuBLAS" first, then each alternative taken where it is faster
    layer_ms: dict[int, dict[str, float]] = {m: {} for m in rows}

    def add_layer(m: int, name: str, what: str, ms: float) -> None:
        if name != "lm_head":
            layer_ms[m][what] = layer_ms[m].get(what, 0.0) + ms

    for name, (n, k) in LLAMA3_8B_GEMMS.items():
        # enough weight copies that one replay reads ~256 MB: none stays in L2 for the next call
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
              for _ in range(max(1, (256 << 20) // (2 * n * k)))]  # fmt: skip
        w = ws[0]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, w)
            flop = 2 * m * n * k
            row = [name, m, n, k]
            ms = per_weight_ms(lambda v, x=x: F.linear(x, v), ws)
            row += [f"{ms * 1e3:.1f}", f"{flop / ms / 1e9:.0f}"]
            add_layer(m, name, "cuBLAS", ms)
            if args.lt_algos:
                lt_ms = lt_candidates(name, x, w, ws, ref, ms, args.lt_algos, lt_table)
                add_layer(m, name, "the fastest cuBLASLt candidate per GEMM", min(ms, lt_ms))
            for b in settings:
                blas_setting(b)
                err = (F.linear(x, w).float() - ref.float()).abs().max().item()
                b_ms = per_weight_ms(lambda v, x=x: F.linear(x, v), ws)
                blas_setting("default")
                row += [f"{b_ms * 1e3:.1f}" + ("" if err < 0.05 else f" (max error {err:.2g})")]
            best = None
            for fn, t in variants:
                y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                if fn is persistent_linear and t[-1]:
                    split = persistent_split(m, n, t, x.device)
                    if split == 1:  # whole passes, or too few idle programs: timed unsplit
                        continue
                    t = (*t[:-1], f"split {split}")
                t = (fn.__name__, *t)
                try:
                    fn(x, w, y, t[1:])
                    err = (y.float() - ref.float()).abs().max().item()
                    if not err < 0.05:
                        print(f"  {name} m={m} tiling {t}: max error {err}, skipped")
                        continue
                    t_ms = per_weight_ms(lambda v, x=x, y=y, f=fn, t=t: f(x, v, y, t[1:]), ws)
                except Exception as e:  # a tiling this card cannot compile (shared memory)
                    print(f"  {name} m={m} tiling {t}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                print(f"  {name} m={m} {t}: {t_ms * 1e3:.1f} us", flush=True)
                if best is None or t_ms < best[0]:
                    best = (t_ms, t)
            if best:
                row += [f"{best[0] * 1e3:.1f}", f"{flop / best[0] / 1e9:.0f}", str(best[1]),
                        f"{ms / best[0]:.2f}"]  # fmt: skip
            else:
                row += ["-"] * 4
            if variants:
                add_layer(m, name, "the faster of cuBLAS and the best Triton kernel per GEMM",
                          min(ms, best[0]) if best else ms)  # fmt: skip
            table.append(row)
            print(" | ".join(str(c) for c in row), flush=True)
    print()
    print(format_table(["gemm", "rows", "N", "K", "cuBLAS us", "cuBLAS TFLOP/s"]
                       + [f"{b} us" for b in settings]
                       + ["Triton us", "Triton TFLOP/s",
                          "Triton kernel, tiling (bm,bn,bk,warps,stages)", "cuBLAS/Triton"],
                       table))  # fmt: skip
    if args.lt_algos:
        print()
        print(format_table(["gemm", "rows", "candidates", "F.linear us", "candidate 0 us",
                            "best candidate us", "best index", "best config", "F.linear/best"],
                           lt_table))  # fmt: skip
    for m, sums in layer_ms.items():
        base = sums.pop("cuBLAS")
        for what, best in sums.items():
            print(
                f"a target layer (qkv + o + gate/up + down) at {m} rows: cuBLAS (F.linear) "
                f"{base * 1e3:.1f} us, {what} {best * 1e3:.1f} us (x{base / best:.3f}), "
                f"x 32 layers {base * 32:.2f} -> {best * 32:.2f} ms"
            )


def lt_candidates(
    name: str,
    x: torch.Tensor,
    w: torch.Tensor,
    ws: list[torch.Tensor],
    ref: torch.Tensor,
    linear_ms: float,
    count: int,
    table: list[list[object]],
) -> float:
    """Times each of cuBLASLt's first ``count`` candidates for x @ w.T (poisoned output, checked
    against F.linear first); adds a row to ``table``; returns the fastest candidate's ms."""
    from cublaslt_algos import LtLinear

    m, k = x.shape
    lt = LtLinear(m, w.shape[0], k, count)
    y = torch.empty_like(ref)
    times = []
    for i in range(len(lt.algos)):
        y.fill_(float("nan"))
        lt(x, w, y, i)
        err = (y.float() - ref.float()).abs().max().item()
        if not err < 0.05:
            print(f"  {name} m={m} candidate {i}: max error {err}, skipped")
            continue
        times.append((per_weight_ms(lambda v, i=i: lt(x, v, y, i), ws), i))
    if not times:
        table.append([name, m, len(lt.algos), f"{linear_ms * 1e3:.1f}", "-", "-", "-", "-", "-"])
        return linear_ms
    best_ms, best = min(times)
    first = next((t for t, i in times if i == 0), None)
    table.append([name, m, len(lt.algos), f"{linear_ms * 1e3:.1f}",
                  "-" if first is None else f"{first * 1e3:.1f}", f"{best_ms * 1e3:.1f}", best,
                  " ".join(f"{key}={v}" for key, v in lt.config(best).items()),
                  f"{linear_ms / best_ms:.3f}"])  # fmt: skip
    print(
        f"  {name} m={m}: {len(times)} candidates, F.linear {linear_ms * 1e3:.1f} us, "
        f"best #{best} {best_ms * 1e3:.1f} us",
        flush=True,
    )
    return best_ms


if __name__ == "__main__":
    main()
