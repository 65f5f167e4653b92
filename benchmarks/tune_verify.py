# ruff: noqa: B023  (each lambda is timed before the loop moves on)
"""Target-verify attention at the DSpark benchmark's shapes (Llama-3-8B attention: 32 q / 8 KV
heads, head_dim 128, page 16, 4K context), against a plain decode step of the same batch.

    python3 benchmarks/tune_verify.py [--quick] [--write-config FILE]

A verify step reads the same K/V bytes as a decode step; only the query rows per KV head grow
(GQA 4 x 5 draft tokens = 20 rows for k=4, 32 for k=7). Each tiling is first checked against
the float64 reference on the timed inputs' first sequences (a variant over 1e-2 relative error
is reported and not timed); timing is CUDA-graph replay (common.time_ms) with the split plan a
captured graph uses (32K context bound). "vs decode" is the decode kernel's time (the device's
committed decode tuning) over the variant's, same batch and context. ``--write-config`` adds
the best tiling per KV kind (geometric mean over all shapes and draft counts) as the "verify"
entry of a decode tuning file (sgl_atom/attention/decode_tuning.py).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from bench_paged_attention import kv_bytes, paged  # noqa: E402
from common import import_kernels, time_ms  # noqa: E402
from tune_decode import (  # noqa: E402
    GRAPH_CONTEXT,
    HKV,
    HQ,
    PAGE,
    D,
    geomean,
    merge_tuning,
    rel_err,
    sweep,
)

pa = import_kernels("paged_attention")
SHAPES = [(1, 4096), (16, 4096), (64, 4096)]
NUM_DRAFT = (5, 8)  # k = 4 and k = 7 draft tokens plus the verified one


def decode_tuning(fp8: bool) -> dict:
    """The decode tiling the atom backend launches on this device for the KV kind (its
    committed tuning file), as kernel keyword arguments plus ``waves``."""
    from sgl_atom.attention import decode_tuning as dt

    tuning, _ = dt.load("fp8" if fp8 else "bf16", torch.cuda.get_device_name(0))
    return dict(tuning.kernel_kwargs(), waves=tuning.waves)


def variants(fp8: bool, quick: bool) -> list[dict]:
    """The launcher's default (split waves 2 and 4), then tilings at waves 2."""
    tiles = [(64, 4, 4), (64, 4, 3), (64, 8, 4), (64, 8, 3), (32, 4, 3), (32, 4, 4), (128, 4, 3),
             (128, 8, 3), (128, 8, 2)]  # fmt: skip
    if quick:
        tiles = tiles[:3]
    out = [dict(waves=2.0), dict(waves=4.0)]
    for bn, w, s in tiles:
        cfg = dict(block_n=bn, num_warps=w, num_stages=s, waves=2.0)
        if fp8 and bn == 128 and w == 4:
            out.append(dict(cfg, maxnreg=128))
        out.append(cfg)
    if fp8 and not quick:  # the decode's H200 choice: the cache read as 16-bit words
        for bn, w, s in ((128, 4, 3), (64, 4, 4)):
            cfg = dict(block_n=bn, num_warps=w, num_stages=s, waves=2.0, kv_mode="f16pairs")
            out += [cfg, dict(cfg, maxnreg=128)]
    if not quick:
        out += occupancy_variants(fp8)
    return out


def occupancy_variants(fp8: bool) -> list[dict]:
    """bf16 tilings that keep 96-128 KB of K/V loading per SM at the verify tile (20-32 query
    rows), as the decode tilings that read at 0.85-0.87 of copy do: uncapped, a 4-warp verify
    tile takes 190-200 registers on sm_90 and so runs two programs per SM
    (``kernel_resources.py --verify``). bn64 s2 takes 141 (three per SM) and compiles under a
    128-register cap without spills (four). fp8's 16-bit-word tile capped to four per SM is
    already among the variants above."""
    if fp8:
        return []
    cfg = dict(block_n=64, num_warps=4, num_stages=2, waves=2.0)
    return [cfg, dict(cfg, maxnreg=128)]


def name(cfg: dict) -> str:
    if "block_n" not in cfg:
        return f"default waves{cfg['waves']:g}"
    reg = f" r{cfg['maxnreg']}" if cfg.get("maxnreg") else ""
    mode = f" {cfg['kv_mode']}" if cfg.get("kv_mode") else ""
    tiling = "bn{block_n} w{num_warps} s{num_stages}".format(**cfg)
    return tiling + reg + mode + f" waves{cfg['waves']:g}"


def splits(batch: int, waves: float) -> int:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return pa.decode_num_splits(batch, HKV, GRAPH_CONTEXT, sms, waves)


def run(batch, ctx, fp8, copy, quick, rows, speed):
    k, v, ks, vs, table, lens = paged(batch, ctx, PAGE, fp8, kv_heads=HKV)
    kv = "fp8" if fp8 else "bf16"
    dcfg = decode_tuning(fp8)
    dkw = {key: val for key, val in dcfg.items() if key != "waves"}
    q1 = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    dec_ms = time_ms(lambda: pa.decode_fwd(q1, k, v, table, lens, PAGE, D**-0.5, k_scale=ks,
                                           v_scale=vs, num_splits=splits(batch, dcfg["waves"]),
                                           **dkw))  # fmt: skip
    gbs = kv_bytes(batch, ctx, fp8, kv_heads=HKV) / dec_ms / 1e6
    print(f"  {kv} b{batch} ctx{ctx} decode: {dec_ms:.4f} ms {gbs:.0f} GB/s", flush=True)
    rows.append([kv, f"b{batch} x {ctx}", 1, "decode (tuned)", dec_ms, gbs / copy, 1.0, 0.0])
    nb = min(batch, 2)
    for nd in NUM_DRAFT:
        q = torch.randn(batch * nd, HQ, D, device="cuda", dtype=torch.bfloat16)
        ref = pa.reference_verify(q[: nb * nd], k, v, table[:nb], lens[:nb], PAGE, D**-0.5, ks, vs)
        for cfg in variants(fp8, quick):
            kw = {key: val for key, val in cfg.items() if key != "waves"}
            kw["num_splits"] = splits(batch, cfg["waves"])
            args = (q, k, v, table, lens, PAGE, D**-0.5, nd)
            try:
                out = pa.verify_fwd(*args, k_scale=ks, v_scale=vs, **kw)
                err = rel_err(out[: nb * nd], ref)
                if err > 1e-2:
                    print(f"  {name(cfg)}: rel err {err:.2e}, not timed", flush=True)
                    continue
                ms = time_ms(lambda: pa.verify_fwd(*args, k_scale=ks, v_scale=vs, **kw))
            except Exception as e:  # a tiling that does not compile
                print(f"  {name(cfg)}: failed ({e!r:.160})", flush=True)
                continue
            gbs = kv_bytes(batch, ctx, fp8, kv_heads=HKV) / ms / 1e6
            print(f"  {kv} b{batch} ctx{ctx} n{nd} {name(cfg)}: {ms:.4f} ms "
                  f"({gbs / copy:.2f} of copy) x{ms / dec_ms:.2f} of decode, err {err:.1e}",
                  flush=True)  # fmt: skip
            rows.append([kv, f"b{batch} x {ctx}", nd, name(cfg), ms, gbs / copy, ms / dec_ms, err])
            speed.setdefault((kv, name(cfg)), (cfg, {}))[1][(batch, ctx, nd)] = ms / dec_ms
    torch.cuda.empty_cache()


def best(speed: dict, kv: str) -> tuple[dict, float]:
    """The variant of ``kv`` with the lowest geometric mean of verify/decode time, among those
    timed at every shape and draft count."""
    want = len(SHAPES) * len(NUM_DRAFT)
    scored = [
        (geomean(by.values()), cfg)
        for (k, _), (cfg, by) in speed.items()
        if k == kv and len(by) == want
    ]
    return min(scored, key=lambda t: t[0])[::-1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="three tilings")
    ap.add_argument("--write-config", default="", help="add the best tilings as 'verify' entries")
    args = ap.parse_args()
    head = ["kv", "shape", "tokens", "variant", "ms", "of copy", "x decode", "rel err"]
    speed = sweep(run, SHAPES, args.quick, head)
    picks = {}
    for kv in ("bf16", "fp8"):
        cfg, score = best(speed, kv)
        base = geomean(speed[(kv, name(dict(waves=2.0)))][1].values())
        print(f"best {kv} verify: {name(cfg)}: geomean x{score:.3f} of decode "
              f"(launcher default x{base:.3f})")  # fmt: skip
        picks[kv] = cfg
    if args.write_config:
        write_verify(args.write_config, picks, torch.cuda.get_device_name(0), sys.argv[1:])
        print(f"verify tuning written to {args.write_config}")


def write_verify(path: str, picks: dict, device: str, argv: list[str]) -> None:
    """Put ``picks`` as the "verify" entry of the decode tuning file at ``path``, keeping its
    other entries (its "decode" one above all: a file without it cannot serve)."""
    update = {
        "verify_date": datetime.date.today().isoformat(),
        "verify_command": "python3 benchmarks/tune_verify.py " + " ".join(argv),
        "verify": picks,
    }
    merge_tuning(path, device, update, stale=("verify_note",))


if __name__ == "__main__":
    main()
