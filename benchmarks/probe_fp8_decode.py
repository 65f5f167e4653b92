"""Where fp8 paged decode spends its time (H200): variants of one decode kernel that change one
stage at a time, timed side by side against the production kernels at 32K context.

    python3 benchmarks/probe_fp8_decode.py [--ncu-target {bf16,fp8}]

Variants (GQA 8:1 over 32 q / 4 KV heads, head_dim 128, page 64, one query token):
  conv  how fp8 K/V become dot operands: "bf16" (Triton's cast, the production path), "f16"
        (one conversion per pair; q cast to fp16), "bits" (integer bit moves: an e4m3 byte
        shifted into fp16 bits is the value times 2^-8, exact; the 2^8 goes into the scales)
  scales  whether the per-token scales are loaded (off gives wrong numbers: timing only)
The production kernels (kernels.paged_attention.decode_fwd, bf16 and fp8) are timed in the same
run. `--ncu-target` launches one production decode for Nsight Compute and exits.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from common import import_kernels, time_ms  # noqa: E402

pa = import_kernels("paged_attention")
kvq = import_kernels("kv_quant")
HQ, HKV, D, PAGE = 32, 4, 128, 64


@triton.jit
def _bits_to_f16(x):
    """e4m3 bytes (as uint8) -> fp16 equal to the e4m3 value times 2^-8: sign to bit 15, the
    exponent and mantissa bits one place down (fp16's 5-bit exponent over e4m3's 4)."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 lo, hi, s, t;
        prmt.b32 lo, $2, 0, 0x1404;
        prmt.b32 hi, $2, 0, 0x3424;
        shr.b32 s, lo, 1;
        and.b32 t, lo, 0x80008000;
        lop3.b32 $0, s, 0x3F803F80, t, 0xEA;
        shr.b32 s, hi, 1;
        and.b32 t, hi, 0x80008000;
        lop3.b32 $1, s, 0x3F803F80, t, 0xEA;
        }
        """,
        constraints="=r,=r,r",
        args=[x],
        dtype=tl.float16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def probe_kernel(
    Q, K, V, KS, VS, PT, SL, OP, LSE, qk_scale, num_splits,
    stride_kt, stride_pt, NQ: tl.constexpr, NKV: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, FP8: tl.constexpr, CONV: tl.constexpr, SCALES: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SL + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    rows = tl.arange(0, BLOCK_M)
    head = kvh * GROUP + rows % GROUP
    row_ok = rows < GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * NQ * HEAD_DIM + head[:, None] * HEAD_DIM + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)  # fmt: skip
    if FP8 and CONV > 0:
        q = q.to(tl.float16)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    pt_row = PT + b * stride_pt
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        page = tl.load(pt_row + offs_n // PAGE)
        slot = page.to(tl.int64) * PAGE + offs_n % PAGE
        kp = K + kvh * HEAD_DIM + slot[:, None] * stride_kt + offs_d[None, :]
        vp = V + kvh * HEAD_DIM + slot[:, None] * stride_kt + offs_d[None, :]
        k = tl.load(kp)
        if FP8:
            if CONV == 0:
                kd = k.to(tl.bfloat16)
            elif CONV == 1:
                kd = k.to(tl.float16)
            else:
                kd = _bits_to_f16(k)
        else:
            kd = k
        s = tl.dot(q, tl.trans(kd))
        if FP8 and SCALES:
            s = s * (tl.load(KS + slot * NKV + kvh) * qk_scale)[None, :]
        else:
            s = s * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vp)
        if FP8 and SCALES:
            p = p * tl.load(VS + slot * NKV + kvh)[None, :]
        if FP8:
            if CONV == 0:
                vd = v.to(tl.bfloat16)
            elif CONV == 1:
                vd = v.to(tl.float16)
            else:
                vd = _bits_to_f16(v)
        else:
            vd = v
        acc = acc * alpha[:, None] + tl.dot(p.to(vd.dtype), vd)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(OP + (b * NQ + head[:, None]) * num_splits * HEAD_DIM + split * HEAD_DIM
             + offs_d[None, :], o, mask=row_ok[:, None])  # fmt: skip
    tl.store(LSE + (b * NQ + head) * num_splits + split, m_i + tl.math.log2(l_i), mask=row_ok)


def setup(batch: int, ctx: int, fp8: bool):
    pages = batch * ctx // PAGE
    slots = pages * PAGE
    k = torch.randn(slots, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ks = vs = None
    if fp8:
        kc = torch.empty(slots, HKV, D, device="cuda", dtype=torch.float8_e4m3fn)
        vc = torch.empty_like(kc)
        ks = torch.empty(slots, HKV, device="cuda", dtype=torch.float32)
        vs = torch.empty_like(ks)
        kvq.store_kv(k, v, kc, vc, torch.arange(slots, device="cuda"), ks, vs)
        k, v = kc, vc
    table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    return q, k, v, ks, vs, table, lens


def run_probe(q, k, v, ks, vs, table, lens, ctx, waves, conv, scales, block_n, warps, stages):
    batch = q.shape[0]
    fp8 = k.dtype == torch.float8_e4m3fn
    splits = pa.decode_num_splits(batch, HKV, ctx, 132, waves)
    op = torch.empty(batch, HQ, splits, D, device="cuda", dtype=torch.float32)
    lse = torch.empty(batch, HQ, splits, device="cuda", dtype=torch.float32)
    if fp8 and conv == 2:  # the bit moves give value * 2^-8: K's 2^8 goes on the scores
        qk = 0.088 * 1.4426950408889634 * 256.0
    else:
        qk = 0.088 * 1.4426950408889634
    ku = k.view(torch.uint8) if fp8 and conv == 2 else k
    vu = v.view(torch.uint8) if fp8 and conv == 2 else v

    def go():
        probe_kernel[(batch, HKV, splits)](
            q, ku, vu, ks if fp8 else k, vs if fp8 else v, table, lens, op, lse, qk, splits,
            k.stride(0), table.stride(0), HQ, HKV,
            GROUP=HQ // HKV, BLOCK_M=16, BLOCK_N=block_n, HEAD_DIM=D, PAGE=PAGE, FP8=fp8,
            CONV=conv, SCALES=scales, num_warps=warps, num_stages=stages,
        )  # fmt: skip

    go()
    # merge the splits in torch for a correctness check against the production kernel
    w = torch.softmax(lse * 0.6931471805599453, dim=-1)
    out = (op * w[..., None]).sum(2)
    if fp8 and conv == 2:
        out = out * 256.0  # V's 2^8
    return time_ms(go), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ncu-target", choices=["bf16", "fp8"])
    args = ap.parse_args()
    if args.ncu_target:
        fp8 = args.ncu_target == "fp8"
        q, k, v, ks, vs, table, lens = setup(8, 32768, fp8)
        for _ in range(3):
            pa.decode_fwd(q, k, v, table, lens, PAGE, 0.088, k_scale=ks, v_scale=vs,
                          max_context=32768)  # fmt: skip
        torch.cuda.synchronize()
        return
    print(f"device: {torch.cuda.get_device_name()}; 32 q / 4 kv heads, d128, page {PAGE}")
    for batch in (8, 32):
        ctx = 32768
        data = {f: setup(batch, ctx, f) for f in (False, True)}
        prod = {}
        for f in (False, True):
            q, k, v, ks, vs, table, lens = data[f]

            def prod_call(q=q, k=k, v=v, ks=ks, vs=vs, table=table, lens=lens, ctx=ctx):
                return pa.decode_fwd(q, k, v, table, lens, PAGE, 0.088, k_scale=ks, v_scale=vs,
                                     max_context=ctx)  # fmt: skip

            prod[f] = time_ms(prod_call)
            prod[(f, "out")] = prod_call().float()
        kvb = {f: batch * ctx * HKV * D * 2 * (1 if f else 2) for f in (False, True)}
        print(f"\nbatch {batch} ctx {ctx}: production bf16 {prod[False]:.4f} ms "
              f"({kvb[False] / prod[False] / 1e6:.0f} GB/s), fp8 {prod[True]:.4f} ms "
              f"({kvb[True] / prod[True] / 1e6:.0f} GB/s), "
              f"fp8 x{prod[False] / prod[True]:.2f}")  # fmt: skip
        variants = [(False, 0, 1, 64, 4, 3)]
        for conv in (0, 1, 2):
            for scales in (1, 0):
                for bn, st in ((64, 3), (64, 5), (128, 2), (128, 4), (256, 2)):
                    variants.append((True, conv, scales, bn, 4, st))
        for conv in (0, 1, 2):
            for waves in (4.0, 8.0):
                variants.append((True, conv, 1, 128, 4, 2, waves))
            variants.append((True, conv, 1, 128, 8, 3))
            variants.append((True, conv, 1, 64, 2, 3))
        for var in variants:
            f, conv, scales, bn, warps, st, *rest = var
            waves = rest[0] if rest else 2.0
            q, k, v, ks, vs, table, lens = data[f]
            try:
                ms, out = run_probe(q, k, v, ks, vs, table, lens, ctx, waves, conv, scales, bn,
                                    warps, st)  # fmt: skip
            except Exception as e:  # noqa: BLE001 - a variant that does not compile
                print(f"  {'fp8' if f else 'bf16'} conv{conv} scales{scales} N{bn} s{st}: "
                      f"failed {type(e).__name__}: {str(e)[-300:]}")  # fmt: skip
                continue
            err = (out - prod[(f, "out")]).abs().max().item()
            name = ("fp8 " + ("bf16", "f16", "bits")[conv]) if f else "bf16"
            print(f"  {name:9s} scales{scales} N{bn} w{warps} s{st} waves{waves}: {ms:.4f} ms "
                  f"({kvb[f] / ms / 1e6:.0f} GB/s; x{prod[False] / ms:.2f} vs production bf16)"
                  f"  max|diff| vs production {err:.3g}")  # fmt: skip


if __name__ == "__main__":
    main()
