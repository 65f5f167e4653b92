"""Sweep of fp8 vs bf16 paged decode at 32K context (GQA 8:1, head_dim 128, page 64): every
fp8 KV mode (how fp8 K/V meet q in the dots, kernels.paged_attention.common.KV_MODES) x tiling x
split waves.

    python3 benchmarks/tune_fp8_decode.py

Prints, per batch, the default bf16 time and every fp8 variant's time and its speed-up over bf16.
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


MODES = ("bf16", "f16", "bits")
TILINGS = ((128, 4, 2), (128, 4, 3), (64, 4, 3))
WAVES = (2.0, 4.0)


def run(batch: int, ctx: int = 32768) -> None:
    q, kc, vc, table, lens, _, _ = setup(batch, ctx, torch.bfloat16)
    bf16 = time_ms(lambda: pa.decode_fwd(q, kc, vc, table, lens, 64, 0.088, max_context=ctx))
    print(f"batch {batch} ctx {ctx}: bf16 default {bf16:.4f} ms")
    del kc, vc
    q, kc, vc, table, lens, ks, vs = setup(batch, ctx, torch.float8_e4m3fn)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for mode, (bn, warps, stages), waves in itertools.product(MODES, TILINGS, WAVES):
        splits = pa.decode_num_splits(batch, 4, ctx, sms, waves)
        tiling = dict(kv_mode=mode, block_n=bn, num_warps=warps, num_stages=stages)
        args = (q, kc, vc, table, lens, 64, 0.088)
        kw = dict(k_scale=ks, v_scale=vs, max_context=ctx, num_splits=splits, **tiling)
        try:
            ms = time_ms(lambda a=args, k=kw: pa.decode_fwd(*a, **k))
        except Exception as e:  # a tiling that does not compile (shared memory)
            print(f"  fp8 {mode} bn{bn} w{warps} s{stages} waves{waves}: failed ({e!r:.200})")
            continue
        print(
            f"  fp8 {mode:5s} bn{bn} w{warps} s{stages} waves{waves} (splits {splits}): "
            f"{ms:.4f} ms  x{bf16 / ms:.2f} vs bf16"
        )


if __name__ == "__main__":
    for b in (1, 8, 32):
        run(b)
