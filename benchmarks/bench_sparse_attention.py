# ruff: noqa: B023  (each lambda is timed before the loop moves on)
"""Sparse (MiniMax-M3 style) decode vs dense paged decode on one GPU.

    python benchmarks/bench_sparse_attention.py --out benchmarks/results

Shapes: 64 q / 8 KV heads (GQA 8:1), head_dim 128, index_dim 128, page 128, top-16 blocks of
128 tokens (1 init + 1 local), contexts 32K and 128K, batch 1..64; index keys bf16, fp8 and
packed 4-bit (`--index`; "int4" scores with integer MMAs, the library's default, "int4-f16"
the same cache with fp16 dots: `block_select.INT4_DOT`). The sparse step is
select_blocks (scores + top-k) + sparse_attention_fwd; the baseline is the dense
`paged_attention.decode_fwd` over the whole context. Timing: CUDA-graph replay medians; problems
whose bytes fit in L2 are repeated over disjoint pages in one replay (time divided by the count).
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
from common import copy_bandwidth, device_name, format_table, import_kernels, time_ms

sa = import_kernels("sparse_attention")
pa = import_kernels("paged_attention")
HQ, HKV, D, DI, PAGE, TOPK = 64, 8, 128, 128, 128, 16
FP8 = torch.float8_e4m3fn
L2_SPAN = 192 << 20  # repeat a problem until this many bytes are touched per replay


# bytes per token of each index cache (fp8 and 4-bit: a 4-byte scale beside the keys)
INDEX_BYTES = {"bf16": 2 * DI, "fp8": DI + 4, "int4": DI // 2 + 4, "int4-f16": DI // 2 + 4}


def use_dots(index: str) -> None:
    """The 4-bit dot path that `index` names ("int4-f16": fp16 dots, else integer MMAs)."""
    sa.block_select.INT4_DOT = "f16" if index == "int4-f16" else "i8"


class Pool:
    """One shared paged pool (K, V, index cache bf16, fp8 and 4-bit) big enough for the largest
    case."""

    def __init__(self, slots: int):
        self.k = torch.randn(slots, HKV, D, device="cuda", dtype=torch.bfloat16)
        self.v = torch.randn(slots, HKV, D, device="cuda", dtype=torch.bfloat16)
        self.ik = torch.randn(slots, DI, device="cuda", dtype=torch.bfloat16)
        self.ik8 = torch.empty(slots, DI, device="cuda", dtype=FP8)
        self.iks = torch.empty(slots, device="cuda")
        self.ik4 = torch.empty(slots, DI // 2, device="cuda", dtype=torch.uint8)
        self.ik4s = torch.empty(slots, device="cuda")
        for lo in range(0, slots, 1 << 22):
            hi = min(slots, lo + (1 << 22))
            at = torch.arange(lo, hi, device="cuda")
            sa.index_write(self.ik[lo:hi], self.ik8, at, self.iks)
            sa.index_write(self.ik[lo:hi], self.ik4, at, self.ik4s)
        self.pages = slots // PAGE

    def index(self, kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        caches = {"bf16": (self.ik, None), "fp8": (self.ik8, self.iks)}
        return {**caches, "int4": (self.ik4, self.ik4s), "int4-f16": (self.ik4, self.ik4s)}[kind]


def tables(pool: Pool, batch: int, ctx: int, reps: int) -> list[torch.Tensor]:
    """`reps` page tables over disjoint shuffled pages."""
    per = ctx // PAGE
    perm = torch.randperm(pool.pages, device="cuda")[: reps * batch * per].to(torch.int32)
    return [t.view(batch, per) for t in perm.view(reps, batch * per)]


def measure(
    pool: Pool, batch: int, ctx: int, index: str, cfg: dict, select_only: bool = False
) -> dict:
    """Timings of one shape; cfg[index] = (blocks per scoring program or None for the library's
    choice, scoring config (stages, warps, fp16 dots) or None for its default)."""
    nb, score_cfg = cfg[index]
    use_dots(index)
    sparse_bytes = batch * (ctx * INDEX_BYTES[index] + HKV * TOPK * PAGE * D * 4)
    reps = max(1, min(8, math.ceil(L2_SPAN / sparse_bytes), pool.pages // (batch * ctx // PAGE)))
    pts = tables(pool, batch, ctx, reps)
    seq = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    iq = torch.randn(batch, HKV, DI, device="cuda", dtype=torch.bfloat16)
    ik, iks = pool.index(index)
    scores = torch.empty(batch, HKV, ctx // 128, device="cuda")
    sel = [
        (
            torch.empty(batch, HKV, TOPK, dtype=torch.int32, device="cuda"),
            torch.empty(batch, HKV, dtype=torch.int32, device="cuda"),
        )
        for _ in pts
    ]
    out = torch.empty_like(q)
    splits = sa.num_splits_for(
        batch * HKV, TOPK, torch.cuda.get_device_properties(0).multi_processor_count
    )
    ws = (
        torch.empty(batch, HQ, splits, D, device="cuda"),
        torch.empty(batch, HQ, splits, device="cuda"),
    )

    def select(i):
        sa.select_blocks(
            iq,
            ik,
            pts[i],
            seq,
            PAGE,
            D**-0.5,
            TOPK,
            1,
            1,
            max_seq_len=ctx,
            index_scale=iks,
            scores=scores,
            out=sel[i],
            blocks_per_program=nb,
            config=score_cfg,
        )

    def score(i):
        sa.block_scores(
            iq,
            ik,
            pts[i],
            seq,
            PAGE,
            D**-0.5,
            max_seq_len=ctx,
            index_scale=iks,
            scores=scores,
            blocks_per_program=nb,
            config=score_cfg,
        )

    def attend(i):
        sa.sparse_attention_fwd(
            q,
            pool.k,
            pool.v,
            pts[i],
            seq,
            *sel[i],
            PAGE,
            D**-0.5,
            out=out,
            num_splits=splits,
            workspace=ws,
        )

    def dense(i):
        pa.decode_fwd(q, pool.k, pool.v, pts[i], seq, PAGE, D**-0.5, out=out)

    for i in range(reps):
        select(i)
    t_sel = time_ms(lambda: [select(i) for i in range(reps)]) / reps
    if select_only:
        return dict(t_select=t_sel)
    t_score = time_ms(lambda: [score(i) for i in range(reps)]) / reps
    t_att = time_ms(lambda: [attend(i) for i in range(reps)]) / reps
    t_all = time_ms(lambda: [(select(i), attend(i)) for i in range(reps)]) / reps
    dreps = max(1, min(reps, math.ceil(L2_SPAN / (batch * ctx * HKV * D * 4))))
    t_dense = time_ms(lambda: [dense(i) for i in range(dreps)]) / dreps
    att_bytes = int(sel[0][1].sum()) * PAGE * D * 2 * 2  # K + V rows of the selected blocks, bf16
    return dict(
        batch=batch,
        ctx=ctx,
        index=index,
        splits=splits,
        reps=reps,
        t_select=t_sel,
        t_score=t_score,
        t_attn=t_att,
        t_sparse=t_all,
        t_dense=t_dense,
        att_bytes=att_bytes,
        index_bytes=batch * ctx * INDEX_BYTES[index],
    )


def check(pool: Pool) -> None:
    """The benchmark's own inputs through the references (one small case) before any figure;
    the 4-bit index's block scores against the float64 reference over its own keys."""
    batch, ctx = 2, 2048
    pt = tables(pool, batch, ctx, 1)[0]
    seq = torch.tensor([ctx, ctx - 77], dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    iq = torch.randn(batch, HKV, DI, device="cuda", dtype=torch.bfloat16)
    indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    sel, cnt = sa.select_blocks(iq, pool.ik, pt, seq, PAGE, D**-0.5, TOPK, 1, 1)
    out = sa.sparse_attention_fwd(q, pool.k, pool.v, pt, seq, sel, cnt, PAGE, D**-0.5)
    ref = sa.reference_sparse_attention(q, pool.k, pool.v, pt, seq, indptr, sel, PAGE, D**-0.5)
    err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"sparse attention relative error {err}"
    ik4, ik4s = pool.index("int4")
    want = sa.reference_block_scores(iq, ik4, pt, seq, indptr, PAGE, D**-0.5, ik4s)
    ok = torch.isfinite(want)
    for dots in ("int4", "int4-f16"):
        use_dots(dots)
        got = sa.block_scores(iq, ik4, pt, seq, PAGE, D**-0.5, index_scale=ik4s)
        got = got.cpu()[..., : want.shape[2]].double()
        err = ((got[ok] - want[ok]).norm() / want[ok].norm()).item()
        assert err < 1e-5, f"4-bit index ({dots}) block scores relative error {err}"


# (blocks per program, (stages, warps, fp16 dots)) tried at batch 64 x 128K; None = library choice.
# The first of each list is the earlier kernel's scheme: one block per program, no pipelining,
# bf16 dots (fp8 keys converted to bf16).
TUNE = {
    "bf16": [
        (1, (1, 4, False)),
        (None, (1, 4, False)),
        (None, (2, 4, False)),
        (None, (3, 4, False)),
    ],
    "fp8": [
        (1, (1, 4, False)),
        (None, (2, 4, False)),
        (1, (1, 4, True)),
        (None, (1, 4, True)),
        (None, (2, 4, True)),
        (None, (3, 4, True)),
    ],
    "int4-f16": [
        (1, (1, 4, True)),
        (None, (1, 4, True)),
        (None, (2, 4, True)),
        (None, (3, 4, True)),
    ],
}
# integer MMAs: the two slower schemes of the fp16 list left out; longer runs and 8 warps added
TUNE["int4"] = [
    (None, (2, 4, True)),
    (None, (3, 4, True)),
    (2, (2, 4, True)),
    (8, (2, 4, True)),
    (8, (3, 4, True)),
    (None, (2, 8, True)),
]


def tune(pool: Pool, kinds: list[str]) -> tuple[dict, list]:
    """Scoring (blocks per program, config) per index dtype, by select time at batch 64 x 128K."""
    log = []
    for kind in kinds:
        for cand in TUNE[kind]:
            t = measure(pool, 64, 131072, kind, {kind: cand}, select_only=True)["t_select"]
            log.append(((kind, *cand), t))
    best = {}
    for kind in kinds:
        runs = [(c[1:], t) for c, t in log if c[0] == kind]
        best[kind] = min(runs, key=lambda x: x[1])[0]
    return best, log


def plot(rows: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for ctx in sorted({r["ctx"] for r in rows}):
        for idx in sorted({r["index"] for r in rows}):
            rs = [r for r in rows if r["ctx"] == ctx and r["index"] == idx]
            b = [r["batch"] for r in rs]
            ax[0].plot(
                b,
                [r["t_dense"] / r["t_sparse"] for r in rs],
                "o-",
                label=f"{ctx // 1024}K, {idx} index",
            )
            ax[1].plot(
                b,
                [r["t_select"] / r["t_sparse"] for r in rs],
                "o-",
                label=f"{ctx // 1024}K, {idx} index",
            )
    ax[0].axhline(30, color="gray", ls="--", lw=1)
    ax[0].set(
        xscale="log",
        xlabel="batch",
        ylabel="dense / sparse time",
        title="sparse decode speedup (top-16 blocks)",
    )
    ax[1].set(
        xscale="log",
        xlabel="batch",
        ylabel="indexer share of sparse step",
        title="scoring + selection share",
    )
    for a in ax:
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument(
        "--index",
        default="bf16,fp8,int4,int4-f16",
        help="index-key caches (and 4-bit dots) to time",
    )
    args = ap.parse_args()
    kinds = args.index.split(",")
    if bad := set(kinds) - set(INDEX_BYTES):
        raise SystemExit(f"--index: {sorted(bad)} unknown; give some of {', '.join(INDEX_BYTES)}")
    os.makedirs(args.out, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    copy = copy_bandwidth()
    pool = Pool(max(batches) * max(contexts) + 8 * PAGE * 64)
    check(pool)
    cfg, log = tune(pool, kinds)
    print(
        "scoring tuning (index, blocks/program, (stages, warps, fp16 dots); b64 128K select ms):",
        [(c, round(t, 4)) for c, t in log],
    )
    rows = [measure(pool, b, c, k, cfg) for c in contexts for b in batches for k in kinds]
    table = [
        [
            f"b{r['batch']} ctx{r['ctx'] // 1024}K",
            r["index"],
            r["splits"],
            r["t_select"],
            r["t_score"],
            r["t_attn"],
            r["t_sparse"],
            r["t_dense"],
            r["t_dense"] / r["t_sparse"],
            r["att_bytes"] / r["t_attn"] / 1e6,
            r["att_bytes"] / r["t_attn"] / 1e6 / copy,
            r["index_bytes"] / r["t_score"] / 1e6,
            r["t_select"] / r["t_sparse"],
        ]
        for r in rows
    ]
    head = [
        "shape",
        "index",
        "splits",
        "select ms",
        "score ms",
        "attn ms",
        "sparse ms",
        "dense ms",
        "speedup",
        "attn GB/s",
        "attn frac copy",
        "index GB/s",
        "indexer share",
    ]
    text = (
        f"device: {device_name()}; copy ceiling {copy:.0f} GB/s (read+write); "
        f"{HQ} q / {HKV} kv heads, "
        f"head_dim {D}, index_dim {DI}, page {PAGE}, top-{TOPK} blocks; scoring (blocks/program, "
        f"(stages, warps, fp16 dots)) {cfg} (None: library "
        "choice); attention block_n 64, 4 warps, 2 stages; "
        "select = score + top-k; index GB/s = index bytes / score time\n\n"
        + format_table(head, table)
    )
    with open(os.path.join(args.out, "sparse_attention.json"), "w") as f:
        json.dump(
            dict(copy_gbs=copy, scoring=cfg, tuning=log, rows=rows),
            f,
            indent=1,
        )
    plot(rows, os.path.join(args.out, "sparse_attention.png"))
    print(text)


if __name__ == "__main__":
    main()
