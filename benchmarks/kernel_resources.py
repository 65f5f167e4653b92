"""What the paged decode kernel costs in registers, spills and shared memory on Hopper, and
which of its loads Triton software-pipelines, read without a GPU: the kernel is compiled ahead
of time for sm_90 (Triton's own compiler and its bundled ptxas), on any machine.

    python benchmarks/kernel_resources.py [--maxnreg 128,168] [--verify]

One row per variant (bf16 and fp8 KV at the server's shape: 32 q / 8 KV heads, head_dim 128,
page 16, the launcher's tilings and a few others): registers per thread, spill bytes, shared
memory, the programs an SM can hold (by its 65,536 registers and 228 KB of shared memory), and
how many K/V tiles Triton's pipeliner buffers ahead of the one in use (the leading dimension of
the K tile's shared-memory buffer in the TTGIR; 0 when the load is not pipelined at all).
With ``--verify`` the rows are the target-verify tile instead (5 query tokens per sequence, 20
rows of a GQA group in a 32-row tile, `verify_fwd`) at the tilings `tune_verify.py` times.
The compile carries the specializations Triton's JIT makes at the server's shape (16-byte
aligned pointers, strides divisible by 16): without them every element is a separate load.
The Triton here is the one this machine has (the CPU venv pins 3.8; the H200 image has 3.6):
check a conclusion against the device's own compile before leaning on it.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import triton  # noqa: E402
from common import format_table, import_kernels  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

decode = import_kernels("paged_attention.decode")
KV_MODES = import_kernels("paged_attention.common").KV_MODES
KERNEL = decode.decode_fwd_kernel
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
STRIDES = ["stride_qt", "stride_qh", "stride_kt", "stride_vt", "stride_st", "stride_pt"]
STRIDES += ["stride_opt", "stride_oph", "stride_ops", "stride_lt", "stride_lh"]
VARIANTS = [  # (kv, block_n, num_warps, num_stages, fp8 kv_mode)
    ("bf16", 64, 4, 4, "-"),
    ("fp8", 128, 4, 3, "bits"),
    ("fp8", 128, 4, 3, "f16"),
    ("fp8", 128, 4, 3, "bf16"),
    ("fp8", 64, 4, 4, "bits"),
    ("fp8", 64, 4, 4, "f16"),
    ("fp8", 128, 4, 5, "bits"),
    ("fp8", 128, 4, 3, "pairs"),
    ("fp8", 128, 4, 3, "f16pairs"),
    ("fp8", 64, 4, 4, "f16pairs"),
]
VERIFY_VARIANTS = [  # (kv, block_n, num_warps, num_stages, fp8 kv_mode, maxnreg)
    ("bf16", 64, 4, 4, "-", None),
    ("bf16", 128, 4, 3, "-", None),
    ("bf16", 32, 4, 3, "-", None),
    ("bf16", 64, 8, 3, "-", None),
    ("bf16", 64, 4, 2, "-", None),
    ("bf16", 64, 4, 2, "-", 128),
    ("fp8", 128, 4, 3, "bits", None),
    ("fp8", 128, 4, 3, "f16pairs", None),
    ("fp8", 128, 4, 3, "f16pairs", 128),
    ("fp8", 64, 4, 2, "f16pairs", 168),
    ("fp8", 32, 4, 2, "f16pairs", 128),
]
VERIFY_TOKENS, VERIFY_ROWS = 5, 32  # k = 4 drafts + 1, x GQA 4 = 20 rows in a 32-row tile
PAIRS = ("pairs", "f16pairs")  # the kernel reads the fp8 cache as 16-bit words


def compile_decode(
    kv: str,
    block_n: int,
    warps: int,
    stages: int,
    maxnreg: int | None,
    mode: str = "bits",
    num_q: int = 1,
    block_m: int = 16,
):
    fp8 = kv == "fp8"
    kv_t = ("*i16" if mode in PAIRS else "*fp8e4nv") if fp8 else "*bf16"
    sig = {"Q": "*bf16", "K": kv_t, "V": kv_t, "KS": "*fp32", "VS": "*fp32", "PT": "*i32"}
    sig |= {"SL": "*i32", "OP": "*fp32", "LSE": "*fp32", "qk_scale": "fp32", "num_splits": "i32"}
    sig |= {name: "i32" for name in STRIDES}
    const = dict(GROUP=4, NUM_Q=num_q, PAGE=16, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=128)
    kv_mode = KV_MODES[mode] if fp8 else 0
    const |= dict(FP8=fp8, KV_MODE=kv_mode, DOT_F32=False, CAUSAL=True)
    sig |= {name: "constexpr" for name in const}
    where = {(KERNEL.arg_names.index(k),): v for k, v in const.items()}
    options = {"num_warps": warps, "num_stages": stages}
    if maxnreg:
        options["maxnreg"] = maxnreg
    # what Triton's JIT specializes on at the server's shape: every pointer 16-byte aligned (torch
    # allocations), every stride but the scales' (kv_heads = 8) a multiple of 16
    div16 = [n for n, t in sig.items() if t.startswith("*")]
    div16 += [s for s in STRIDES if s != "stride_st"]
    attrs = {(KERNEL.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn=KERNEL, signature=sig, constexprs=where, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


SMEM_PER_SM = 228 * 1024


def kv_buffers(ttgir: str, block_n: int) -> int:
    """Tiles of K the pipeliner keeps in flight: the leading dim of its [n, block_n, d] buffer
    (d 64 for the pairs modes' 16-bit words)."""
    found = re.findall(rf"memdesc<(\d+)x{block_n}x(?:128x(?:f8E4M3FN|bf16)|64xi16)", ttgir)
    return max(map(int, found), default=0)


def sass_text(cubin: bytes) -> str:
    """The kernel's SASS listing (Triton's bundled cuobjdump)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        cmd = [os.path.join(BIN, "cuobjdump"), "-sass", path]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def sass_instructions(cubin: bytes) -> int:
    """Instructions in the kernel's SASS (cuobjdump), both loops and the prologue: a static
    proxy for the issue-bound fp8 kernel's work per key at equal block_n."""
    return len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+\S", sass_text(cubin), flags=re.M))


def ptxas_report(ptx: str) -> tuple[int, int]:
    """(registers per thread, spill store bytes) from ptxas -v on the kernel's PTX."""
    ptxas = os.path.join(BIN, "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        cmd = [ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", out).group(1))
    spill = re.search(r"(\d+) bytes spill stores", out)
    return regs, int(spill.group(1)) if spill else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--maxnreg", default="", help="also compile with these register caps")
    ap.add_argument("--verify", action="store_true", help="the target-verify tile instead")
    args = ap.parse_args()
    caps = [None] + [int(c) for c in args.maxnreg.split(",") if c]
    todo = [(*v, c) for v in VARIANTS for c in caps]
    shape = dict(num_q=1, block_m=16)
    if args.verify:
        todo, shape = VERIFY_VARIANTS, dict(num_q=VERIFY_TOKENS, block_m=VERIFY_ROWS)
    rows = []
    for kv, bn, warps, stages, mode, cap in todo:
        k = compile_decode(kv, bn, warps, stages, cap, mode, **shape)
        regs, spill = ptxas_report(k.asm["ptx"])
        by_regs = min(64, 65536 // (regs * 32)) // warps
        programs = min(by_regs, SMEM_PER_SM // max(k.metadata.shared, 1))
        ahead = kv_buffers(k.asm["ttgir"], bn)
        # K and V tiles the SM's programs have loading at once: the memory parallelism of a
        # bandwidth-bound scan (128 KB for the decode tiling that reads at 0.87 of copy)
        flight = programs * ahead * bn * 128 * (1 if kv == "fp8" else 2) * 2 // 1024
        rows.append([kv, f"bn{bn} w{warps} s{stages}", mode, cap or "-", regs, spill,
                     k.metadata.shared, programs, ahead, flight,
                     sass_instructions(k.asm["cubin"])])  # fmt: skip
    head = ["kv", "tiling", "kv_mode", "maxnreg", "regs", "spill B", "smem B", "programs/SM"]
    head += ["K/V ahead", "K/V KB in flight/SM", "SASS instr"]
    what = "target verify of 5 tokens (20-row tile)" if args.verify else "paged decode"
    print(f"{what} on sm_90 (Triton {triton.__version__}), 32 q / 8 KV heads, d128, page 16")
    print(format_table(head, rows))


if __name__ == "__main__":
    main()
