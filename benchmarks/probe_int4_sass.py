"""The block-scoring kernel's instructions on Hopper for each index cache and 4-bit dot path, read
without a GPU: compiled ahead of time for sm_90 (Triton's compiler and bundled ptxas) at the
sparse benchmark's decode shape (8 KV heads, index_dim 128, page 128, 4 blocks per program).

    python benchmarks/probe_int4_sass.py          (benchmarks/results/probe_int4_sass.log)

One row per variant: registers, spills, shared memory, SASS instructions in all and in the block
loop (one 128-key block per iteration), the loop's by class (MMA, the conversions, shared-memory
traffic) and the MMAs' kind. The 4-bit fp16 path converts
each key nibble into an fp16 MMA operand; the integer path masks the nibbles into int8 operands.
A static proxy for the work per key of an instruction-bound scan: the H200 times the paths with
benchmarks/probe_int4_scoring.py. The Triton here is this machine's (the CPU venv pins 3.8, the
H200 image has 3.6).
"""

from __future__ import annotations

import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import triton  # noqa: E402
from common import format_table, import_kernels  # noqa: E402
from kernel_resources import ptxas_report, sass_text  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

KERNEL = import_kernels("sparse_attention.block_select").block_score_kernel
STRIDES = ["stride_iqt", "stride_pt", "stride_st", "stride_sh"]
CLASSES = {  # SASS opcode prefixes counted per class
    "MMA": ("HMMA", "IMMA", "HGMMA", "IGMMA"),
    "convert": ("PRMT", "HADD2", "HFMA2", "F2FP", "I2F", "LOP3", "SHF"),
    "smem": ("LDS", "STS", "LDSM", "LDGSTS"),
}


def compile_score(index: str, dots: str, warps: int = 4, stages: int = 2):
    int4, fp8 = index == "int4", index == "fp8"
    ik = {"int4": "*u8", "fp8": "*fp8e4nv", "bf16": "*bf16"}[index]
    sig = {"IQ": "*bf16", "IK": ik, "IKS": "*fp32", "PT": "*i32", "SL": "*i32", "QO": "*i32"}
    sig |= {"S": "*fp32", "scale": "fp32", "nb": "i32"} | {s: "i32" for s in STRIDES}
    const = dict(KV_HEADS=8, INDEX_DIM=128, ROW_W=64 if int4 else 128, BLOCK_D=64 if int4 else 128)
    const |= dict(PAGE=128, SBLOCK=128, BLOCK_M=16, DECODE=True, SCALED=int4 or fp8, INT4=int4)
    const |= dict(F32_DOT=False, F16_DOT=fp8, I8_DOT=int4 and dots == "i8", STAGES=stages)
    sig |= {name: "constexpr" for name in const}
    where = {(KERNEL.arg_names.index(k),): v for k, v in const.items()}
    # the JIT's specializations at this shape: 16-byte aligned pointers, strides a multiple of 16
    div16 = [n for n, t in sig.items() if t.startswith("*")] + STRIDES
    attrs = {(KERNEL.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn=KERNEL, signature=sig, constexprs=where, attrs=attrs)
    options = {"num_warps": warps, "num_stages": stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def sass(cubin: bytes) -> tuple[collections.Counter, collections.Counter]:
    """Opcode counts of the whole kernel and of its block loop (the longest backward branch's
    span: one 128-key block per iteration)."""
    out = sass_text(cubin)
    code = re.findall(
        r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", out, re.M
    )
    labels = {
        m[1]: int(m[2], 16)
        for m in re.finditer(r"^\.L_x_(\d+):\s*\n\s+/\*([0-9a-f]+)\*/", out, re.M)
    }
    loops = []
    for a, op, rest in code:  # a branch target is an address or a label
        m = re.search(r"0x([0-9a-f]+)|\.L_x_(\d+)", rest) if op.startswith("BRA") else None
        target = (int(m[1], 16) if m[1] else labels.get(m[2])) if m else None
        if target is not None and target < int(a, 16):
            loops.append((target, int(a, 16)))
    lo, hi = max(loops, key=lambda span: span[1] - span[0], default=(0, -1))
    whole = collections.Counter(op.split(".")[0] for _, op, _ in code)
    loop = collections.Counter(op.split(".")[0] for a, op, _ in code if lo <= int(a, 16) <= hi)
    return whole, loop


def main() -> None:
    rows = []
    for index, dots in (("fp8", "f16"), ("int4", "f16"), ("int4", "i8")):
        k = compile_score(index, dots)
        regs, spill = ptxas_report(k.asm["ptx"])
        whole, ops = sass(k.asm["cubin"])
        by = {c: sum(n for op, n in ops.items() if op.startswith(p)) for c, p in CLASSES.items()}
        mma = sorted({op for op in ops if op.startswith(CLASSES["MMA"])})
        common = " ".join(f"{o} {n}" for o, n in ops.most_common(6))
        rows.append([index, dots if index == "int4" else "-", regs, spill, k.metadata.shared,
                     sum(whole.values()), sum(ops.values()), by["MMA"], "/".join(mma),
                     by["convert"], by["smem"], common])  # fmt: skip
    head = ["index", "4-bit dots", "regs", "spill B", "smem B", "SASS instr", "loop instr"]
    head += ["loop MMA", "MMA kind", "loop convert (PRMT HADD2 HFMA2 F2FP I2F LOP3 SHF)"]
    head += ["loop smem (LDS STS LDSM LDGSTS)", "loop's most frequent"]
    print(
        f"block scoring on sm_90 (Triton {triton.__version__}): decode, 8 KV heads (16-row tile),"
    )
    print("index_dim 128, page 128, 2 stages, 4 warps")
    print(format_table(head, rows))


if __name__ == "__main__":
    main()
