# ruff: noqa: B023  (each lambda is timed before the loop moves on)
"""Tuning sweep for the sparse indexer (block scoring + top-k) on one GPU.

    python benchmarks/tune_sparse_scoring.py --out benchmarks/results

Checks every scoring config against the float64 reference (page 128; two at page 16), then
times `block_scores` at batch 64 x 128K over (stages, warps, fp16 dots) x blocks per program, the
blocks-per-program choice at smaller batches and the top-k kernel's warps. Shapes as
bench_sparse_attention.py; timings are CUDA-graph replay medians.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import sys
import time

import torch
from bench_sparse_attention import DI, FP8, HKV, PAGE, TOPK, Pool, sa, tables
from common import time_ms

bs = sys.modules[sa.select_blocks.__module__]
CTX = 131072


def check(pool: Pool, cfgs: list) -> None:
    """Each config's scores against the reference (decode, page 128; two configs at page 16)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    for page in (128, 16):
        batch, ctx = 3, 1500
        slots = batch * 2048
        ik = torch.randn(slots, DI, device="cuda", generator=g, dtype=torch.bfloat16)
        ik8 = torch.empty(slots, DI, device="cuda", dtype=FP8)
        iks = torch.empty(slots, device="cuda")
        sa.index_write(ik, ik8, torch.arange(slots, device="cuda"), iks)
        pt = torch.randperm(slots // page, device="cuda", generator=g).to(torch.int32)
        pt = pt.view(batch, -1)
        seq = torch.tensor([ctx, ctx - 300, 129], dtype=torch.int32, device="cuda")
        iq = torch.randn(batch, HKV, DI, device="cuda", dtype=torch.bfloat16)
        indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        vis = (torch.arange(12)[None, :] <= ((seq.cpu() - 1) // 128)[:, None])[:, None, :]
        for fp8 in (False, True):
            cache, scale = (ik8, iks) if fp8 else (ik, None)
            ref = sa.reference_block_scores(iq, cache, pt, seq, indptr, page, 0.1, scale)
            page_cfgs = cfgs if page == PAGE else [bs.SCORE_CONFIG, (1, 4, False)]
            for cfg, nb in itertools.product(page_cfgs, (1, 3, 16)):
                got = (
                    bs.block_scores(
                        iq,
                        cache,
                        pt,
                        seq,
                        page,
                        0.1,
                        max_seq_len=ctx,
                        index_scale=scale,
                        blocks_per_program=nb,
                        config=cfg,
                    )[..., :12]
                    .cpu()
                    .double()
                )
                v = vis.expand_as(ref)
                err = ((got[v] - ref[v]).norm() / ref[v].norm()).item()
                assert err < 1e-5, f"page {page} fp8 {fp8} cfg {cfg} nb {nb}: rel err {err}"
    print(f"checked {len(cfgs)} scoring configs (page 128; 2 at page 16) x nb 1, 3, 16 x index")


def score_ms(pool, batch, ctx, fp8, nb, cfg, reps_tables=None, old=None) -> float:
    """Median ms of one `block_scores` call (or of `old`'s kernel, an earlier block_select)."""
    pts = reps_tables or tables(pool, batch, ctx, 1)
    iq = torch.randn(batch, HKV, DI, device="cuda", dtype=torch.bfloat16)
    ik, iks = (pool.ik8, pool.iks) if fp8 else (pool.ik, None)
    scores = torch.empty(batch, HKV, ctx // 128, device="cuda")
    seq = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")

    def run():
        for pt in pts:
            if old is None:
                bs.block_scores(
                    iq,
                    ik,
                    pt,
                    seq,
                    PAGE,
                    0.1,
                    max_seq_len=ctx,
                    index_scale=iks,
                    scores=scores,
                    blocks_per_program=nb,
                    config=cfg,
                )
                continue
            old.block_score_kernel[(ctx // 128, 1, batch)](
                iq,
                ik,
                iks if fp8 else ik,
                pt,
                seq,
                seq,
                scores,
                0.1,
                iq.stride(0),
                pt.stride(0),
                scores.stride(0),
                scores.stride(1),
                KV_HEADS=HKV,
                INDEX_DIM=DI,
                BLOCK_D=DI,
                PAGE=PAGE,
                SBLOCK=128,
                BLOCK_M=16,
                DECODE=True,
                FP8=fp8,
                F32_DOT=False,
                NB=1,
                num_warps=4,
            )

    return time_ms(run) / len(pts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument(
        "--old",
        help="an earlier block_select.py (one block per program, NB=1) to time side by side",
    )
    args = ap.parse_args()
    old = None
    if args.old:
        spec = importlib.util.spec_from_file_location("old_block_select", args.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    pool = Pool(64 * CTX + 8 * PAGE * 64)
    cfgs = [(st, w, f16) for f16 in (True, False) for st in (1, 2, 3) for w in (4, 8)]
    check(pool, cfgs)
    res = dict(grid={}, nb={}, topk={})
    cfg_of = {}
    for fp8 in (False, True):
        dt = "fp8" if fp8 else "bf16"
        if old is not None:
            t = score_ms(pool, 64, CTX, fp8, 1, None, old=old)
            res["grid"][f"{dt} old nb1"] = t
            print(f"{dt} b64 128K  earlier kernel: {t:.4f} ms", flush=True)
        for cfg in cfgs if fp8 else [c for c in cfgs if not c[2]]:
            for nb in (1, 4, 8):
                t = score_ms(pool, 64, CTX, fp8, nb, cfg)
                res["grid"][f"{dt} {cfg} nb{nb}"] = t
                cfg_of[f"{dt} {cfg} nb{nb}"] = cfg
                gbs = 64 * CTX * (DI + 4 * fp8) * (1 if fp8 else 2) / t / 1e6
                print(f"{dt} b64 128K cfg {cfg} nb {nb}: {t:.4f} ms {gbs:.0f} GB/s", flush=True)
    best = {}
    for dt in ("bf16", "fp8"):
        k = min(
            (k for k in res["grid"] if k.startswith(dt) and "old" not in k), key=res["grid"].get
        )
        best[dt] = k
    print("best at b64 128K:", {d: (k, round(res["grid"][k], 4)) for d, k in best.items()})
    # blocks per program at other sizes, for the best config of each dtype
    for dt in ("bf16", "fp8"):
        fp8 = dt == "fp8"
        ranked = sorted((k for k in cfg_of if k.startswith(dt)), key=res["grid"].get)
        top = []
        for k in ranked:
            if cfg_of[k] not in top:
                top.append(cfg_of[k])
        for cfg in top[:1]:
            for batch, ctx in ((1, CTX), (4, CTX), (16, CTX), (64, 32768)):
                reps = max(1, min(8, (192 << 20) // (batch * ctx * 132)))
                pts = tables(pool, batch, ctx, reps)
                for nb in (1, 2, 4):
                    t = score_ms(pool, batch, ctx, fp8, nb, cfg, pts)
                    res["nb"][f"{dt} {cfg} b{batch} ctx{ctx // 1024}K nb{nb}"] = t
                    print(f"{dt} {cfg} b{batch} ctx{ctx // 1024}K nb {nb}: {t:.5f} ms", flush=True)
                auto = bs.blocks_per_program_for(ctx // 128, batch, torch.device("cuda"))
                print(f"   heuristic picks nb {auto}")
    # top-k warps
    for batch in (1, 16, 64):
        scores = torch.randn(batch, HKV, CTX // 128, device="cuda")
        seq = torch.full((batch,), CTX, dtype=torch.int32, device="cuda")
        sel = torch.empty(batch, HKV, TOPK, dtype=torch.int32, device="cuda")
        cnt = torch.empty(batch, HKV, dtype=torch.int32, device="cuda")
        ref = None
        for w in (1, 2, 4, 8):

            def run():
                bs.topk_select_kernel[(HKV, batch)](
                    scores,
                    sel,
                    cnt,
                    seq,
                    seq,
                    scores.stride(0),
                    scores.stride(1),
                    sel.stride(0),
                    sel.stride(1),
                    KV_HEADS=HKV,
                    TOPK=TOPK,
                    INIT=1,
                    LOCAL=1,
                    SBLOCK=128,
                    BLOCK_B=CTX // 128,
                    BLOCK_K=TOPK,
                    DECODE=True,
                    num_warps=w,
                )

            run()
            if ref is None:
                ref = sel.clone()
            assert torch.equal(ref, sel), f"top-k warps {w} differs"
            t = time_ms(run)
            res["topk"][f"b{batch} w{w}"] = t
            print(f"topk b{batch} 128K warps {w}: {t:.5f} ms", flush=True)
    res["seconds"] = time.time() - t0
    with open(os.path.join(args.out, "tune_sparse_scoring.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
