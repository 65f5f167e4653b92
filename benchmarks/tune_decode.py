"""Paged decode at the server benchmark's shapes (Llama-3-8B attention: 32 q / 8 KV heads,
head_dim 128, page 16), bf16 and fp8 KV, over tilings and split plans.

    python3 benchmarks/tune_decode.py [--quick] [--write-config FILE]

Each variant is first checked against the float64 reference on the timed inputs' first
sequences (relative error printed; a variant over 1e-2 is reported and not timed). Timing is
CUDA-graph replay (common.time_ms); GB/s counts K + V (+ fp8 scales) bytes read; "of copy" is
that over the device copy rate measured in the same run. Each variant also carries its split
plan (`waves`: programs per SM that `decode_num_splits` aims for, over the server's 32K context
bound as a captured graph plans it). `--write-config` writes, per KV kind, the variant with the
best geometric-mean speedup over the default across all shapes as a decode tuning file
(`sgl_atom/attention/decode_tuning.py`), which the atom backend reads.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from bench_paged_attention import kv_bytes, paged  # noqa: E402
from common import copy_bandwidth, device_name, format_table, import_kernels, time_ms  # noqa: E402

pa = import_kernels("paged_attention")
HQ, HKV, D, PAGE = 32, 8, 128, 16
SHAPES = [(64, 4096), (16, 16384), (128, 2048), (8, 32768), (1, 16384)]
GRAPH_CONTEXT = 32768  # the split plan of a captured graph is made for the context bound
DEFAULTS = {  # the launcher's built-in choice (16 query rows: GQA 4), as a tuning entry
    kv: dict(pa.decode._config(D, 16, kv == "fp8", cpu=False), waves=2.0) for kv in ("bf16", "fp8")
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def variants(fp8: bool, quick: bool) -> list[dict]:
    """The default first, then tiling x split waves.

    A tiling is (block_n, warps, stages, register cap, fp8 kv_mode). Nsight Compute on the
    H200 (benchmarks/results/ncu_decode_summary.txt) found the "bits" kernel issue-bound, the
    8-bit key tile read out of shared memory byte by byte to be laid out for the MMA; the
    "pairs" modes read K/V as 16-bit words (two e4m3 bytes each) and convert them by bit moves
    ("pairs") or by the hardware's e4m3x2 -> f16x2 ("f16pairs", fp16 dots). The "bits" tilings
    stay as the baseline (the H200 file's choice: bn128 s3 under a 128-register cap). Deeper
    pipelines (5+ stages) and the "f16" cast were slower (tune_decode_stages_regs.log,
    tune_decode_regs_f16.log) and are left out."""
    default = DEFAULTS["fp8" if fp8 else "bf16"]
    if fp8:
        tiles = [(128, 4, 3, reg, "bits") for reg in (None, 128)]
        for mode in ("pairs", "f16pairs"):
            tiles += [(64, 4, 4, None, mode), (128, 4, 3, None, mode), (128, 4, 3, 128, mode)]
    else:
        tiles = [(64, 4, 4, None, None), (64, 4, 4, 96, None), (128, 4, 3, None, None)]
    if quick:
        tiles = tiles[:3]
    out = [dict(default)]
    for (bn, w, s, reg, mode), waves in itertools.product(tiles, (2.0, 4.0)):
        cfg = dict(block_n=bn, num_warps=w, num_stages=s, waves=waves)
        if reg:
            cfg["maxnreg"] = reg
        if mode and mode != "bits":  # "bits" is the launcher's default for a bf16 model
            cfg["kv_mode"] = mode
        if cfg != default:
            out.append(cfg)
    return out


def name(cfg: dict) -> str:
    reg = f" r{cfg['maxnreg']}" if cfg.get("maxnreg") else ""
    mode = f" {cfg['kv_mode']}" if cfg.get("kv_mode") else ""
    tiling = "bn{block_n} w{num_warps} s{num_stages}".format(**cfg)
    return tiling + reg + mode + f" waves{cfg['waves']:g}"


def run(batch: int, ctx: int, fp8: bool, copy: float, quick: bool, rows: list, speed: dict):
    k, v, ks, vs, table, lens = paged(batch, ctx, PAGE, fp8, kv_heads=HKV)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    nb = min(batch, 2)
    ref = pa.reference_decode(q[:nb], k, v, table[:nb], lens[:nb], PAGE, D**-0.5, ks, vs)
    base_ms = None
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for cfg in variants(fp8, quick):
        kw = {key: val for key, val in cfg.items() if key != "waves"}
        kw["num_splits"] = pa.decode_num_splits(batch, HKV, GRAPH_CONTEXT, sms, cfg["waves"])
        try:
            out = pa.decode_fwd(q, k, v, table, lens, PAGE, D**-0.5, k_scale=ks, v_scale=vs, **kw)
            err = rel_err(out[:nb], ref)
            if err > 1e-2:
                print(f"  {name(cfg)}: rel err {err:.2e}, not timed", flush=True)
                continue
            args = (q, k, v, table, lens, PAGE, D**-0.5)
            ms = time_ms(lambda a=args, c=kw: pa.decode_fwd(*a, k_scale=ks, v_scale=vs, **c))
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
        speed.setdefault((kv, name(cfg)), (cfg, {}))[1][(batch, ctx)] = base_ms / ms
    torch.cuda.empty_cache()


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values))


def best(speed: dict, kv: str) -> tuple[dict, float]:
    """The variant of `kv` with the best geometric-mean speedup over the default, among those
    timed at every shape (the default itself scores 1.0)."""
    scored = []
    for (k, _), (cfg, by_shape) in speed.items():
        if k == kv and len(by_shape) == len(SHAPES):
            scored.append((geomean(by_shape.values()), cfg))
    score, cfg = max(scored, key=lambda t: t[0])
    return cfg, score


def write_config(path: str, speed: dict, argv: list[str]) -> None:
    decode = {}
    for kv in ("bf16", "fp8"):
        cfg, score = best(speed, kv)
        decode[kv] = cfg
        print(f"best {kv}: {name(cfg)} (geomean x{score:.3f} vs default over {len(SHAPES)} shapes)")
    update = {
        "date": datetime.date.today().isoformat(),
        "command": "python3 benchmarks/tune_decode.py " + " ".join(argv),
        "shapes": [f"{b}x{c}" for b, c in SHAPES],
        "decode": decode,
    }
    merge_tuning(path, torch.cuda.get_device_name(0), update, stale=("note",))
    print(f"decode tuning written to {path}")


def merge_tuning(path: str, device: str, update: dict, stale: tuple[str, ...] = ()) -> None:
    """Write ``update``'s entries into the decode tuning file at ``path``, keeping the others
    (a decode sweep keeps the file's verify tiling, a verify sweep its decode one) but for
    ``stale`` (the replaced picks' notes); refuse a file of another device. A new file holds
    ``update`` alone."""
    doc = {}
    if os.path.exists(path):
        with open(path) as f:
            doc = json.load(f)
        if doc.get("device", device) != device:
            raise SystemExit(
                f"--write-config {path}: a tuning file of {doc['device']!r}, not {device!r}"
            )
    doc = {"device": device, **{k: v for k, v in doc.items() if k not in stale}, **update}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def sweep(run_fn, shapes, quick: bool, head: list[str]) -> dict:
    """``run_fn(batch, ctx, fp8, copy, quick, rows, speed)`` at every shape, bf16 then fp8 KV,
    after the device copy rate; prints the table of ``rows`` and returns ``speed``."""
    copy = copy_bandwidth()
    print(f"{device_name()}: copy {copy:.0f} GB/s; {HQ} q / {HKV} KV heads, d{D}, page {PAGE}")
    rows: list = []
    speed: dict = {}
    for (batch, ctx), fp8 in itertools.product(shapes, (False, True)):
        run_fn(batch, ctx, fp8, copy, quick, rows, speed)
    print(format_table(head, rows))
    return speed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="three tilings per kind")
    ap.add_argument("--write-config", default="", help="write the best variants as a tuning file")
    args = ap.parse_args()
    head = ["kv", "shape", "variant", "ms", "GB/s", "of copy", "vs default", "rel err"]
    speed = sweep(run, SHAPES, args.quick, head)
    if args.write_config:
        write_config(args.write_config, speed, sys.argv[1:])


if __name__ == "__main__":
    main()
