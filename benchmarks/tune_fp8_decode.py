"""Tiling sweep of fp8 vs bf16 paged decode at 32K context (GQA 8:1, head_dim 128, page 64).

    python3 benchmarks/tune_fp8_decode.py

Prints, per batch, the best bf16 time and every fp8 tiling's time and its speed-up over bf16.
"""

from __future__ import annotations

import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from common import import_kernels, time_ms  # noqa: E402

pa = import_kernels("paged_attention")
kvq = import_kernels("kv_quant")


def setup(batch: int, ctx: int, dtype, page: int = 64, kv_heads: int = 4, q_heads: int = 32):
    pages = batch * ctx // page
    slots = pages * page
    k = torch.randn(slots, kv_heads, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    if dtype == torch.float8_e4m3fn:
        kc = torch.empty(slots, kv_heads, 128, device="cuda", dtype=dtype)
        vc = torch.empty_like(kc)
        ks = torch.empty(slots, kv_heads, device="cuda", dtype=torch.float32)
        vs = torch.empty_like(ks)
        kvq.store_kv(k, v, kc, vc, torch.arange(slots, device="cuda"), ks, vs)
    else:
        kc, vc, ks, vs = k, v, None, None
    table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, q_heads, 128, device="cuda", dtype=torch.bfloat16)
    return q, kc, vc, table, lens, ks, vs


def run(batch: int, ctx: int = 32768) -> None:
    q, kc, vc, table, lens, _, _ = setup(batch, ctx, torch.bfloat16)
    bf16 = time_ms(lambda: pa.decode_fwd(q, kc, vc, table, lens, 64, 0.088, max_context=ctx))
    print(f"batch {batch} ctx {ctx}: bf16 default {bf16:.4f} ms")
    del kc, vc
    q, kc, vc, table, lens, ks, vs = setup(batch, ctx, torch.float8_e4m3fn)
    for bn, warps, stages in itertools.product((64, 128, 256), (4, 8), (2, 3, 4)):
        tiling = dict(block_n=bn, num_warps=warps, num_stages=stages)
        args = (q, kc, vc, table, lens, 64, 0.088)
        kw = dict(k_scale=ks, v_scale=vs, max_context=ctx, **tiling)
        try:
            ms = time_ms(lambda a=args, k=kw: pa.decode_fwd(*a, **k))
        except Exception as e:  # a tiling that does not compile (shared memory)
            print(f"  fp8 bn{bn} w{warps} s{stages}: failed ({type(e).__name__})")
            continue
        print(f"  fp8 bn{bn} w{warps} s{stages}: {ms:.4f} ms  x{bf16 / ms:.2f} vs bf16")


if __name__ == "__main__":
    for b in (8, 32):
        run(b)
