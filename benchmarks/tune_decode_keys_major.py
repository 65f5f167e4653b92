"""Paged decode at the server benchmark's shapes (Llama-3-8B attention: 32 q / 8 KV heads,
head_dim 128, page 16): the q-rows-lead kernel against the keys-major one (the key tile as the
first dot operand, `kernels.paged_attention.common.attend_tile_keys_major`), bf16 and fp8 KV,
over tilings.

    python3 benchmarks/tune_decode_keys_major.py [--quick]

Each variant is first checked against the float64 reference on the timed inputs' first
sequences (relative error printed; a variant over 1e-2 is reported and not timed). Timing is
CUDA-graph replay (common.time_ms); GB/s counts K + V (+ fp8 scales) bytes read; "of copy" is
that over the device copy rate measured in the same run.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from bench_paged_attention import kv_bytes, paged  # noqa: E402
from common import copy_bandwidth, device_name, format_table, import_kernels, time_ms  # noqa: E402

pa = import_kernels("paged_attention")
HQ, HKV, D, PAGE = 32, 8, 128, 16
SHAPES = [(64, 4096), (16, 16384), (128, 2048), (8, 32768), (1, 16384)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def variants(fp8: bool, quick: bool):
    base = [dict()]  # the launcher's defaults
    km = (1, 2)
    if fp8:
        tiles = [(128, 4, 3), (128, 4, 2), (128, 8, 3), (256, 8, 2), (256, 8, 3)]
    else:
        tiles = [(64, 4, 4), (128, 4, 3), (128, 8, 3)]
    if quick:
        tiles = tiles[:3]
    for k, (bn, w, s) in itertools.product(km, tiles):
        base.append(dict(keys_major=k, block_n=bn, num_warps=w, num_stages=s))
    for bn, w, s in tiles[1:]:
        base.append(dict(keys_major=0, block_n=bn, num_warps=w, num_stages=s))
    return base


def name(cfg: dict) -> str:
    if not cfg:
        return "default"
    return "km{keys_major} bn{block_n} w{num_warps} s{num_stages}".format(**cfg)


def run(batch: int, ctx: int, fp8: bool, copy: float, quick: bool, rows: list) -> None:
    k, v, ks, vs, table, lens = paged(batch, ctx, PAGE, fp8, kv_heads=HKV)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    nb = min(batch, 2)
    ref = pa.reference_decode(q[:nb], k, v, table[:nb], lens[:nb], PAGE, D**-0.5, ks, vs)
    base_ms = None
    for cfg in variants(fp8, quick):
        try:
            out = pa.decode_fwd(q, k, v, table, lens, PAGE, D**-0.5, k_scale=ks, v_scale=vs, **cfg)
            err = rel_err(out[:nb], ref)
            if err > 1e-2:
                print(f"  {name(cfg)}: rel err {err:.2e}, not timed", flush=True)
                continue
            args = (q, k, v, table, lens, PAGE, D**-0.5)
            ms = time_ms(lambda a=args, c=cfg: pa.decode_fwd(*a, k_scale=ks, v_scale=vs, **c))
        except Exception as e:  # a tiling that does not compile (shared memory, registers)
            print(f"  {name(cfg)}: failed ({e!r:.160})", flush=True)
            continue
        base_ms = base_ms or ms
        gbs = kv_bytes(batch, ctx, fp8, kv_heads=HKV) / ms / 1e6
        kv = "fp8" if fp8 else "bf16"
        print(f"  {kv} b{batch} ctx{ctx} {name(cfg)}: {ms:.4f} ms {gbs:.0f} GB/s "
              f"({gbs / copy:.2f} of copy) x{base_ms / ms:.2f} vs default, err {err:.1e}",
              flush=True)  # fmt: skip
        rows.append([kv, f"b{batch} x {ctx}", name(cfg), ms, gbs, gbs / copy, base_ms / ms, err])
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="three tilings per kind")
    args = ap.parse_args()
    copy = copy_bandwidth()
    print(f"{device_name()}: copy {copy:.0f} GB/s; {HQ} q / {HKV} KV heads, d{D}, page {PAGE}")
    rows: list = []
    for (batch, ctx), fp8 in itertools.product(SHAPES, (False, True)):
        run(batch, ctx, fp8, copy, args.quick, rows)
    head = ["kv", "shape", "variant", "ms", "GB/s", "of copy", "vs default", "rel err"]
    print(format_table(head, rows))


if __name__ == "__main__":
    main()
