# ruff: noqa: B023  (each lambda is timed before the loop moves on)
"""Benchmark of the dense atom kernels on one GPU: KV store, decode, extend (prefill).

    python benchmarks/bench_paged_attention.py --out benchmarks/results

Measures the two ceilings in the same run (copy bandwidth, bf16 8K matmul), tunes a few block
configurations on representative shapes, then writes a markdown table, JSON and a PNG.
Baseline: torch SDPA on the same K/V held contiguous (K/V heads repeated to the query heads).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from common import copy_bandwidth, device_name, format_table, import_kernels, matmul_rate, time_ms

pa = import_kernels("paged_attention")
kvq = import_kernels("kv_quant")
HQ, HKV, D = 32, 4, 128
FP8 = torch.float8_e4m3fn


def paged(batch, ctx, page, fp8, kv_heads=HKV):
    """Pages of all sequences in shuffled order; returns caches, scales, table, lens."""
    pages = batch * (ctx // page)
    shape = (pages * page, kv_heads, D)
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    ks = vs = None
    if fp8:
        kc, vc = (torch.empty(shape, dtype=FP8, device="cuda") for _ in range(2))
        ks, vs = (torch.empty(shape[:2], device="cuda") for _ in range(2))
        loc = torch.arange(shape[0], device="cuda")
        kvq.store_kv(k, v, kc, vc, loc, ks, vs)
        k, v = kc, vc
    table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, ctx // page)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return k, v, ks, vs, table, lens


def kv_bytes(batch, ctx, fp8, kv_heads=HKV):
    per = kv_heads * D * (1 if fp8 else 2) + (kv_heads * 4 if fp8 else 0)
    return 2 * batch * ctx * per


def time_decode(batch, ctx, page, fp8, waves=2.0, **tuning):
    k, v, ks, vs, table, lens = paged(batch, ctx, page, fp8)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    splits = pa.decode_num_splits(
        batch, HKV, ctx, torch.cuda.get_device_properties(0).multi_processor_count, waves
    )
    ws = pa.decode_workspace(batch, HQ, D, splits, "cuda")
    out = torch.empty_like(q)
    ms = time_ms(
        lambda: pa.decode_fwd(
            q,
            k,
            v,
            table,
            lens,
            page,
            D**-0.5,
            out=out,
            k_scale=ks,
            v_scale=vs,
            workspace=ws,
            **tuning,
        )
    )
    return ms, splits


def time_sdpa_decode(batch, ctx):
    k = torch.randn(batch, HKV, ctx, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    return ms


def bench_store(copy_gbs, log):
    rows = []
    tokens = 256 * 1024
    for fp8 in (False, True):
        k, v = (torch.randn(tokens, 8, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        dt = FP8 if fp8 else torch.bfloat16
        kc, vc = (torch.empty(tokens, 8, D, device="cuda", dtype=dt) for _ in range(2))
        ks, vs = (torch.empty(tokens, 8, device="cuda") for _ in range(2)) if fp8 else (None, None)
        loc = torch.randperm(tokens, device="cuda")
        nbytes = (
            2 * tokens * 8 * D * (2 + (1 if fp8 else 2))
            + (2 * tokens * 8 * 4 if fp8 else 0)
            + tokens * 8
        )
        # (name, quant, configs (block_t, num_warps, heads per program)); fp8 "div" is the old one
        variants = [("bf16", None, STORE_TUNE)]
        if fp8:
            variants = [("fp8 div (old)", "div", [(32, 4, 1)]), ("fp8", "fast", STORE_TUNE)]
        for name, quant, cfgs in variants:
            best = None
            for bt, nw, hp in cfgs:
                ms = time_ms(
                    lambda: kvq.store_kv(
                        k, v, kc, vc, loc, ks, vs, bt, nw, quant=quant, heads_per_program=hp
                    ),
                    graph=False,
                )
                log(f"store {name} T{bt} w{nw} H{hp}: {ms:.4f} ms")
                best = min(best or (ms, bt, nw, hp), (ms, bt, nw, hp))
            ms, bt, nw, hp = best
            gbs = nbytes / ms / 1e6
            row = [f"store_kv {name}", f"{tokens} tok x 8 kvh x {D}", f"T{bt} w{nw} H{hp}"]
            rows.append(row + [ms, gbs, gbs / copy_gbs, "-", "-"])
    return rows


STORE_TUNE = [(8, 4, 1), (16, 4, 1), (32, 4, 1), (64, 8, 1), (16, 4, 8), (32, 4, 8), (32, 8, 8)]


DECODE_TUNE = [
    dict(block_n=bn, num_warps=w, num_stages=s)
    for bn, w, s in (
        (32, 4, 2),
        (64, 4, 2),
        (64, 4, 3),
        (64, 4, 4),
        (128, 4, 2),
        (64, 8, 3),
        (128, 8, 3),
    )
]


# fp8: K/V moved into bf16 bits (kv_mode "bits", the default), converted to fp16 ("f16"), or
# cast to bf16 as before ("bf16"): common.KV_MODES
DECODE_TUNE_FP8 = (
    [dict(kv_mode="bf16", block_n=128, num_warps=4, num_stages=2)]
    + [dict(kv_mode="f16", block_n=128, num_warps=4, num_stages=2)]
    + [
        dict(kv_mode="bits", block_n=bn, num_warps=w, num_stages=s)
        for bn, w, s in ((64, 4, 3), (64, 4, 5), (128, 4, 2), (128, 4, 3), (128, 4, 4), (256, 4, 2))
    ]
)
FP8_OLD = dict(kv_mode="bf16", block_n=128, num_warps=4, num_stages=2)


def tune_decode(log):
    """Best tuning per kv dtype on three shapes (sum of times), then the best split waves."""
    picks = {}
    for fp8 in (False, True):
        shapes = ((1, 32768), (32, 32768), (8, 8192))
        scores = []
        for cfg in DECODE_TUNE_FP8 if fp8 else DECODE_TUNE:
            try:
                t = sum(time_decode(b, c, 64, fp8, **cfg)[0] for b, c in shapes)
            except Exception as e:  # a config can run out of shared memory
                log(f"decode cfg {cfg} fp8={fp8} failed: {e!r:.300}")
                continue
            scores.append((t, cfg))
            log(f"decode tune fp8={fp8} {cfg}: {t:.4f} ms (sum)")
        cfg = min(scores, key=lambda x: x[0])[1] if scores else {}
        waves = min(
            (
                sum(
                    time_decode(b, c, 64, fp8, waves=w, **cfg)[0]
                    for b, c in ((1, 32768), (1, 131072), (8, 8192))
                ),
                w,
            )
            for w in (1.0, 2.0, 4.0, 8.0)
        )[1]
        picks[fp8] = dict(cfg=cfg, waves=waves)
        log(f"decode pick fp8={fp8}: {picks[fp8]}")
    return picks


def bench_decode(copy_gbs, picks, log):
    rows, points = [], []
    for batch in (1, 8, 32, 64):
        for ctx in (1024, 8192, 32768, 131072):
            sdpa = time_sdpa_decode(batch, ctx)
            res = {}
            for name, page, fp8 in (
                ("bf16", 64, False),
                ("bf16-ps16", 16, False),
                ("fp8", 64, True),
                ("fp8-bf16cast (old)", 64, True),
            ):
                if name in ("bf16-ps16", "fp8-bf16cast (old)") and ctx != 32768:
                    continue
                p = picks[fp8]
                if "old" in name:  # the previous fp8 default: bf16 cast, 2 waves
                    res[name] = time_decode(batch, ctx, page, fp8, waves=2.0, **FP8_OLD)
                else:
                    res[name] = time_decode(batch, ctx, page, fp8, waves=p["waves"], **p["cfg"])
            for name, (ms, splits) in res.items():
                gbs = kv_bytes(batch, ctx, name.startswith("fp8")) / ms / 1e6
                rows.append(
                    [
                        f"decode {name}",
                        f"b{batch} ctx{ctx // 1024}K",
                        f"splits {splits}",
                        ms,
                        gbs,
                        gbs / copy_gbs,
                        sdpa,
                        sdpa / ms,
                    ]
                )
            points.append(
                dict(batch=batch, ctx=ctx, sdpa=sdpa, **{k: v[0] for k, v in res.items()})
            )
            log(
                f"decode b{batch} ctx{ctx}: sdpa {sdpa:.4f} "
                + " ".join(f"{k} {v[0]:.4f}" for k, v in res.items())
            )
    return rows, points


EXTEND_TUNE = [
    dict(block_m=m, block_n=n, num_warps=w, num_stages=s)
    for m, n, w, s in (
        (128, 64, 8, 3),
        (128, 64, 4, 3),
        (128, 128, 8, 2),
        (128, 128, 8, 3),
        (64, 64, 4, 3),
        (64, 128, 4, 2),
        (128, 32, 4, 3),
        (256, 64, 8, 2),
    )
]


def bench_extend(mm_tflops, log):
    rows = []
    n = 8192
    for label, fp8, mode in (
        ("bf16", False, None),
        ("fp8", True, "bits"),
        ("fp8-bf16cast (old)", True, "bf16"),
    ):
        k, v, ks, vs, table, lens = paged(1, n, 64, fp8)
        q = torch.randn(n, HQ, D, device="cuda", dtype=torch.bfloat16)
        qo = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        best = None
        for cfg in EXTEND_TUNE:
            try:
                ms = time_ms(
                    lambda: pa.extend_fwd(
                        q,
                        k,
                        v,
                        table,
                        lens,
                        qo,
                        64,
                        D**-0.5,
                        out=out,
                        k_scale=ks,
                        v_scale=vs,
                        max_qo_len=n,
                        kv_mode=mode,
                        **cfg,
                    ),
                    graph=False,
                )
            except Exception as e:
                log(f"extend cfg {cfg} failed: {e!r:.300}")
                continue
            log(f"extend {label} {cfg}: {ms:.3f} ms")
            best = min(best or (ms, cfg), (ms, cfg), key=lambda x: x[0])
        ms, cfg = best
        qs = q.view(1, n, HQ, D).transpose(1, 2)
        kk = torch.randn(1, HQ, n, D, device="cuda", dtype=torch.bfloat16)
        sdpa = time_ms(
            lambda: F.scaled_dot_product_attention(qs, kk, kk, is_causal=True), graph=False
        )
        flops = 4 * HQ * D * n * (n + 1) / 2
        tf = flops / ms / 1e9
        rows.append(
            [
                f"extend {label}",
                f"prefill {n} causal",
                f"M{cfg['block_m']} N{cfg['block_n']} w{cfg['num_warps']} s{cfg['num_stages']}",
                ms,
                tf,
                tf / mm_tflops,
                sdpa,
                sdpa / ms,
            ]
        )
    return rows


def plot(points, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4), sharey=False)
    for ax, batch in zip(axes, (1, 8, 32, 64), strict=True):
        pts = [p for p in points if p["batch"] == batch]
        x = [p["ctx"] // 1024 for p in pts]
        for key, style in (("sdpa", "k--o"), ("bf16", "b-o"), ("fp8", "r-o")):
            ax.plot(
                x,
                [p[key] for p in pts],
                style,
                label=key if key != "sdpa" else "SDPA contiguous bf16",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"decode batch {batch} (32q/4kv, d128, page 64)")
        ax.set_xlabel("context (K tokens)")
        ax.set_ylabel("ms")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def sweep(log):
    """Variants side by side (fp8 store arithmetic, fp8 decode dot modes and tiles), with checks:
    store bytes against torch's cast, decode outputs against the bf16-cast mode."""
    tokens = 256 * 1024
    k, v = (torch.randn(tokens, 8, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    loc = torch.randperm(tokens, device="cuda")
    want = [torch.empty(tokens, 8, D, device="cuda", dtype=FP8) for _ in range(2)]
    want += [torch.empty(tokens, 8, device="cuda") for _ in range(2)]
    kvq.reference_store_kv(k, v, *want[:2], loc, *want[2:])
    for quant in ("div", "rcp", "fast"):
        got = [torch.empty_like(w) for w in want]
        for g in got:
            g.view(torch.uint8).fill_(0x55)
        kvq.store_kv(k, v, *got[:2], loc, *got[2:], quant=quant)
        bad = sum(
            int((g.view(torch.uint8) != w.view(torch.uint8)).sum())
            for g, w in zip(got, want, strict=True)
        )
        for bt, nw in ((16, 4), (32, 4), (64, 4), (32, 8), (64, 8), (128, 8)):
            ms = time_ms(
                lambda: kvq.store_kv(
                    k, v, *got[:2], loc, *got[2:], block_t=bt, num_warps=nw, quant=quant
                ),
                graph=False,
            )
            log(f"store fp8 quant={quant} T{bt} w{nw}: {ms:.4f} ms, bytes differing {bad}")
    cfgs = [(64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 8, 2), (256, 4, 2), (256, 8, 2)]
    for batch in (8, 32, 1):
        ctx = 32768
        kf, vf, ks, vs, table, lens = paged(batch, ctx, 64, True)
        kb, vb, _, _, tb, _ = paged(batch, ctx, 64, False)
        q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
        sms = torch.cuda.get_device_properties(0).multi_processor_count

        def run(fp8, waves=2.0, **cfg):
            splits = pa.decode_num_splits(batch, HKV, ctx, sms, waves)
            ws = pa.decode_workspace(batch, HQ, D, splits, "cuda")
            out = torch.empty_like(q)
            kk, vv, tt = (kf, vf, table) if fp8 else (kb, vb, tb)
            fn = lambda: pa.decode_fwd(
                q,
                kk,
                vv,
                tt,
                lens,
                64,
                D**-0.5,
                out=out,
                k_scale=ks if fp8 else None,
                v_scale=vs if fp8 else None,
                workspace=ws,
                **cfg,
            )
            return time_ms(fn), fn()

        bf16_ms, _ = run(False, block_n=64, num_warps=4, num_stages=4)
        base_ms, base = run(True, kv_mode="bf16", block_n=128, num_warps=4, num_stages=2)
        log(f"b{batch} 32K: bf16 {bf16_ms:.4f} ms; fp8 old (bf16 cast) {base_ms:.4f} ms")
        variants = [("f16", c, 2.0) for c in cfgs] + [("f16", (128, 4, 2), 4.0)]
        variants += [("fp8", (128, 4, 2), 2.0), ("bf16", (64, 4, 2), 2.0)]
        for mode, (bn, nw, st), waves in variants:
            try:
                ms, o = run(True, waves, kv_mode=mode, block_n=bn, num_warps=nw, num_stages=st)
            except Exception as e:
                log(f"b{batch} fp8 {mode} N{bn} w{nw} s{st} failed: {e!r:.200}")
                continue
            err = ((o.double() - base.double()).norm() / base.double().norm()).item()
            log(
                f"b{batch} 32K fp8 {mode} N{bn} w{nw} s{st} waves{waves}: {ms:.4f} ms, "
                f"x{bf16_ms / ms:.2f} of bf16, rel diff vs old {err:.1e}"
            )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--sweep", action="store_true", help="only time the variants side by side")
    args = ap.parse_args()
    if args.sweep:
        with open(os.path.join(args.out, "paged_attention_sweep.log"), "w") as f:

            def log(msg):
                print(msg, flush=True)
                f.write(msg + "\n")

            sweep(log)
        return
    os.makedirs(args.out, exist_ok=True)
    logf = open(os.path.join(args.out, "paged_attention.log"), "w")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")

    t0 = time.time()
    copy_gbs, mm = copy_bandwidth(), matmul_rate()
    log(f"{device_name()}: copy {copy_gbs:.0f} GB/s (read+write), bf16 8K matmul {mm:.0f} TFLOP/s")
    rows, points, picks = [], [], {}

    def emit():
        header = [
            "op",
            "shape",
            "config",
            "ms",
            "GB/s or TFLOP/s",
            "frac of ceiling",
            "SDPA ms",
            "speedup vs SDPA",
        ]
        head = (
            f"device: {device_name()}; ceilings measured in this run: "
            f"copy {copy_gbs:.0f} GB/s (read+write), bf16 8192^3 matmul {mm:.0f} TFLOP/s. "
            f"decode: 32 q / 4 kv heads, head_dim 128; GB/s counts K+V bytes (+ fp8 scales) "
            f"read. extend: TFLOP/s = 4*Hq*D*n(n+1)/2 / time.\n"
            f"decode picks: {json.dumps({('fp8' if k else 'bf16'): v for k, v in picks.items()})}"
            "\n\n"
        )
        text = head + format_table(header, rows)
        with open(os.path.join(args.out, "paged_attention.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(args.out, "paged_attention.json"), "w") as f:
            json.dump(
                dict(
                    copy_gbs=copy_gbs,
                    matmul_tflops=mm,
                    decode=points,
                    rows=rows,
                    picks={str(k): v for k, v in picks.items()},
                ),
                f,
                indent=1,
                default=str,
            )
        return text

    rows += bench_store(copy_gbs, log)
    emit()
    rows += bench_extend(mm, log)
    emit()
    picks.update(tune_decode(log))
    drows, pts = bench_decode(copy_gbs, picks, log)
    rows += drows
    points += pts
    text = emit()
    plot(points, os.path.join(args.out, "paged_attention.png"))
    log(f"total {time.time() - t0:.0f} s")
    print(text)


if __name__ == "__main__":
    main()
