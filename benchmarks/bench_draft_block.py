# ruff: noqa: B023  (each lambda is timed before the loop moves on)
"""The DSpark draft's block attention at the 8B benchmark's shapes, with the launcher's default
tiling and with the device's target-verify tiling (its tuning file's "verify" entry), against a
decode step of the same batch.

    python3 benchmarks/bench_draft_block.py [--out DIR]   (draft_block.{md,json,png} in DIR)

The draft attends as ``AtomDSparkDraftModel`` does: the verify kernel with ``causal=False``,
k = 4 block rows per request (16 query rows per KV head at 32 q / 8 KV heads, head_dim 128), a
page-size-1 table over the request's context rows and its block, the split plan of the draft
pass (``decode_num_splits`` over the pool's capacity, the tiling's waves). Each variant is first
checked against the float64 reference on the first two sequences; timing is CUDA-graph replay.
"vs decode" is the decode kernel's time (the device's committed decode tiling, page 16) over
the variant's, same batch, context and KV kind.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from bench_paged_attention import kv_bytes, paged  # noqa: E402
from common import copy_bandwidth, device_name, format_table, import_kernels, time_ms  # noqa: E402
from tune_decode import GRAPH_CONTEXT, HKV, HQ, PAGE, D, rel_err  # noqa: E402

pa = import_kernels("paged_attention")
SHAPES = [(1, 4096), (16, 4096), (64, 4096)]
BLOCK = 4  # the draft's k
POOL_SLOTS = 1 << 20  # the draft pool's capacity: its split plan is made for it


def load_tuning(kv: str, section: str):
    """(tiling, the file it came from) as the server resolves it on this device."""
    from sgl_atom import envs
    from sgl_atom.attention import decode_tuning as dt

    path = envs.SGL_ATOM_DECODE_TUNING.get()
    return dt.load(kv, torch.cuda.get_device_name(0), path, section)


def tuning(kv: str, section: str):
    return load_tuning(kv, section)[0]


def run(batch: int, ctx: int, fp8: bool, rows: list, copy: float) -> None:
    kv = "fp8" if fp8 else "bf16"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dec = tuning(kv, "decode")
    k, v, ks, vs, table, lens = paged(batch, ctx, PAGE, fp8, kv_heads=HKV)
    q1 = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    dsplits = pa.decode_num_splits(batch, HKV, GRAPH_CONTEXT, sms, dec.waves)
    dec_ms = time_ms(lambda: pa.decode_fwd(q1, k, v, table, lens, PAGE, D**-0.5, k_scale=ks,
                                           v_scale=vs, num_splits=dsplits,
                                           **dec.kernel_kwargs()))  # fmt: skip
    rows.append([kv, f"b{batch} x {ctx}", "decode, page 16 (tuned)", dec_ms, 1.0, "-"])
    # the draft's view: the same rows through a page-size-1 table (context then block)
    slots = (table.long()[:, :, None] * PAGE + torch.arange(PAGE, device="cuda")).view(batch, -1)
    table1 = slots.to(torch.int32).contiguous()
    q = torch.randn(batch * BLOCK, HQ, D, device="cuda", dtype=torch.bfloat16)
    nb = min(batch, 2)
    rep = torch.arange(nb, device="cuda").repeat_interleave(BLOCK)
    ref = pa.reference_decode(q[: nb * BLOCK], k, v, table1[rep].contiguous(),
                              lens[rep].contiguous(), 1, D**-0.5, ks, vs)  # fmt: skip
    from sgl_atom.attention.decode_tuning import DecodeTuning

    default = DecodeTuning()  # the launcher's defaults
    for label, t in (("launcher default", default), ("device verify tiling", tuning(kv, "verify"))):
        kw = t.kernel_kwargs()
        kw["num_splits"] = pa.decode_num_splits(batch, HKV, POOL_SLOTS, sms, t.waves)
        args = (q, k, v, table1, lens, 1, D**-0.5, BLOCK)
        out = pa.verify_fwd(*args, k_scale=ks, v_scale=vs, causal=False, **kw)
        err = rel_err(out[: nb * BLOCK], ref)
        ms = time_ms(lambda: pa.verify_fwd(*args, k_scale=ks, v_scale=vs, causal=False, **kw))
        gbs = kv_bytes(batch, ctx, fp8, kv_heads=HKV) / ms / 1e6
        desc = f"draft block, page 1, {label}" + (f" ({t.describe()})" if t != default else "")
        rows.append([kv, f"b{batch} x {ctx}", desc, ms, ms / dec_ms, f"{err:.1e}"])
        print(f"  {kv} b{batch}: {desc}: {ms:.4f} ms ({gbs / copy:.2f} of copy) "
              f"x{ms / dec_ms:.2f} of decode, err {err:.1e}", flush=True)  # fmt: skip
    torch.cuda.empty_cache()


def plot(rows: list, path: str) -> None:
    """Per KV kind and batch: each draft variant's time over the decode step's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r[0], r[1]) for r in rows}, key=lambda g: (g[0], int(g[1][1:].split()[0])))
    labels = ["launcher default", "device verify tiling"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, label in enumerate(labels):
        vals = [
            next((r[4] for r in rows if (r[0], r[1]) == g and label in r[2]), 0) for g in groups
        ]
        xs = [j + (i - 0.5) * 0.38 for j in range(len(groups))]
        ax.bar(xs, vals, width=0.38, label=label)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(groups)), [f"{kv}\n{shape}" for kv, shape in groups])
    ax.set_ylabel("time / decode step (same batch, context, KV)")
    ax.set_title(f"DSpark draft block attention, k = {BLOCK}, page 1, non-causal")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="", help="write draft_block.{md,json,png} here")
    args = ap.parse_args()
    copy = copy_bandwidth()
    when = datetime.date.today().isoformat()
    source = load_tuning("bf16", "decode")[1]
    head = f"{device_name()}, {when}, copy {copy:.0f} GB/s, tilings from {source}"
    print(head, flush=True)
    rows: list = []
    for fp8 in (False, True):
        for batch, ctx in SHAPES:
            run(batch, ctx, fp8, rows, copy)
    header = ["KV", "batch x context", "kernel", "ms", "vs decode", "rel err vs float64"]
    table = format_table(header, [[*r[:3], f"{r[3]:.4f}", f"x{r[4]:.2f}", r[5]] for r in rows])
    cmd = "python3 benchmarks/bench_draft_block.py " + " ".join(sys.argv[1:])
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        md = f"# DSpark draft block attention\n\n{head}\n\n`{cmd.strip()}`\n\n{table}\n"
        with open(os.path.join(args.out, "draft_block.md"), "w") as f:
            f.write(md)
        with open(os.path.join(args.out, "draft_block.json"), "w") as f:
            json.dump(dict(device=device_name(), date=when, command=cmd.strip(), copy_gbs=copy,
                           header=header, rows=rows), f, indent=1)  # fmt: skip
        try:
            plot(rows, os.path.join(args.out, "draft_block.png"))
        except ImportError as e:
            print(f"[bench_draft_block] no plot: {e}")


if __name__ == "__main__":
    main()
