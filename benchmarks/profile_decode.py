"""One paged decode at a server shape, launched a few times, for Nsight Compute to read.

    ncu --clock-control none --kernel-name regex:decode_fwd_kernel --launch-skip 2 \
        --launch-count 1 --set full --import-source yes -o OUT \
        python3 benchmarks/profile_decode.py --kv fp8 [--batch 64 --ctx 4096]

`bash benchmarks/gpu_call.sh ncu-decode` profiles bf16 and fp8 at b64 x 4K (32 q / 8 KV heads,
head_dim 128, page 16: the Llama-3-8B step of the server benchmark) and writes each report's
details and its per-instruction (SASS) stall samples as text. The question it answers: why the
fp8 kernel takes the bf16 kernel's time for half the bytes (benchmarks/results/tune_decode.log).
The launch is the atom backend's: the decode tuning it would load on this device
(SGL_ATOM_DECODE_TUNING, else the committed file) and its split plan for a 32K-context graph.
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from bench_paged_attention import HQ, D, paged  # noqa: E402
from common import import_kernels  # noqa: E402
from tune_decode import GRAPH_CONTEXT, HKV  # noqa: E402

from sgl_atom import envs  # noqa: E402
from sgl_atom.attention import decode_tuning  # noqa: E402

pa = import_kernels("paged_attention")


def opcode_table(path: str, top: int = 14) -> str:
    """Per SASS opcode of one `ncu --page source --print-source sass --csv` export: its share
    of the warp-stall samples and of the executed instructions, most stalled first."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f)]
    head = next(r for r in rows if "Source" in r and "Instructions Executed" in r)
    src, stall = head.index("Source"), head.index("Warp Stall Sampling (All Samples)")
    done = head.index("Instructions Executed")
    execs, stalls = collections.Counter(), collections.Counter()
    for r in rows[rows.index(head) + 1 :]:
        words = r[src].split() if len(r) > done else []
        words = words[1:] if words and words[0].startswith("@") else words  # predicate
        if not words:
            continue
        op = words[0].split(".")[0]
        try:
            execs[op] += int(r[done].replace(",", ""))
            stalls[op] += int(r[stall].replace(",", ""))
        except ValueError:
            continue
    n_exec, n_stall = sum(execs.values()), max(sum(stalls.values()), 1)
    lines = [f"{path}: {n_exec:,} warp instructions executed, {n_stall:,} stall samples"]
    lines += ["| opcode | stall samples | instructions |", "|---|---|---|"]
    for op, n in stalls.most_common(top):
        lines.append(f"| {op} | {n / n_stall:.1%} | {execs[op] / max(n_exec, 1):.1%} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--summarize", nargs="+", metavar="SASS_CSV",
                    help="print the opcode table of these ncu SASS exports and exit")  # fmt: skip
    ap.add_argument("--kv", choices=("bf16", "fp8"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--launches", type=int, default=4)
    args = ap.parse_args()
    if args.summarize:
        print("\n\n".join(opcode_table(p) for p in args.summarize))
        return
    if not args.kv:
        ap.error("--kv is required (or --summarize)")
    k, v, ks, vs, table, lens = paged(args.batch, args.ctx, 16, args.kv == "fp8", kv_heads=HKV)
    q = torch.randn(args.batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    device = torch.cuda.get_device_name(0)
    tuning, source = decode_tuning.load(args.kv, device, envs.SGL_ATOM_DECODE_TUNING.get())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = pa.decode_num_splits(args.batch, HKV, GRAPH_CONTEXT, sms, tuning.waves)
    kw = dict(out=out, k_scale=ks, v_scale=vs, num_splits=splits, **tuning.kernel_kwargs())
    for _ in range(args.launches):
        pa.decode_fwd(q, k, v, table, lens, 16, D**-0.5, **kw)
    torch.cuda.synchronize()
    print(f"decode {args.kv} b{args.batch} x {args.ctx}: {args.launches} launches, "
          f"{tuning.describe()}, {splits} splits, from {source}")  # fmt: skip


if __name__ == "__main__":
    main()
