# ruff: noqa: B023  (each lambda is timed before the loop moves on)
"""The dense-kernel targets still short of their baselines, each beside its baseline in one run:

- extend (prefill) bf16 at 8K causal against torch SDPA on the same shape, each SDPA backend
  timed on its own (which one torch picks by default shows as the equal time);
- decode bf16 at batch 1 (8K-128K) against SDPA's GQA decode, over split waves and tilings;
- the fp8 K/V store against the copy rate, over a wider tiling sweep than the kernel benchmark.

    python3 benchmarks/probe_kernel_gaps.py [--only extend,decode1,store]
    python3 benchmarks/probe_kernel_gaps.py --ncu   # one launch of each pick, for Nsight Compute

Timing as `bench_paged_attention.py`: CUDA-graph replays for decode, do_bench for the rest.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_paged_attention import HQ, D, paged, time_sdpa_decode  # noqa: E402
from common import (  # noqa: E402
    copy_bandwidth,
    device_name,
    format_table,
    import_kernels,
    matmul_rate,
    time_ms,
)
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

pa = import_kernels("paged_attention")
kvq = import_kernels("kv_quant")
N = 8192
EXTEND_CFGS = [  # (block_m, block_n, num_warps, num_stages)
    (128, 128, 8, 2),
    (128, 128, 8, 3),
    (128, 64, 8, 3),
    (128, 64, 4, 3),
    (128, 64, 4, 4),
    (64, 128, 4, 3),
    (64, 64, 4, 4),
    (256, 64, 8, 2),
    (256, 128, 8, 2),
]
SDPA_BACKENDS = {
    "default": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}
STORE_CFGS = [  # (block_t, num_warps, heads per program)
    (16, 4, 8),
    (8, 4, 8),
    (4, 4, 8),
    (8, 2, 8),
    (16, 8, 8),
    (32, 8, 8),
    (64, 8, 8),
    (16, 4, 4),
    (32, 4, 2),
    (4, 2, 8),
    (2, 1, 8),
]


def extend_rows(hkv: int, mm: float, ncu: bool) -> list[list]:
    k, v, _, _, table, lens = paged(1, N, 16, False, kv_heads=hkv)
    q = torch.randn(N, HQ, D, device="cuda", dtype=torch.bfloat16)
    qo = torch.tensor([0, N], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    flops = 4 * HQ * D * N * (N + 1) / 2

    def ext(cfg):
        bm, bn, w, s = cfg
        return lambda: pa.extend_fwd(
            q, k, v, table, lens, qo, 16, D**-0.5, out=out, max_qo_len=N, block_m=bm,
            block_n=bn, num_warps=w, num_stages=s,
        )  # fmt: skip

    qs = q.view(1, N, HQ, D).transpose(1, 2)
    kk = torch.randn(1, HQ, N, D, device="cuda", dtype=torch.bfloat16)

    def sdpa(backend):
        if backend is None:
            return lambda: F.scaled_dot_product_attention(qs, kk, kk, is_causal=True)

        def run():
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(qs, kk, kk, is_causal=True)

        return run

    if ncu:  # one launch each of the default tiling and torch's default SDPA
        ext(EXTEND_CFGS[0])()
        sdpa(None)()
        torch.cuda.synchronize()
        return []
    rows, base = [], {}
    for name, backend in SDPA_BACKENDS.items():
        try:
            ms = time_ms(sdpa(backend), graph=False)
        except RuntimeError as e:
            print(f"  SDPA {name}: unavailable ({str(e)[:120]})", flush=True)
            continue
        base[name] = ms
        rows.append([f"extend {hkv} kv heads", f"SDPA {name}", ms, flops / ms / 1e9, "-"])
        print(f"  {rows[-1]}", flush=True)
    best_sdpa = min(base.values())
    for cfg in EXTEND_CFGS:
        try:
            ms = time_ms(ext(cfg), graph=False)
        except Exception as e:  # a tiling can run out of shared memory
            print(f"  extend {cfg}: failed ({str(e)[:160]})", flush=True)
            continue
        tf = flops / ms / 1e9
        rows.append([f"extend {hkv} kv heads", "M{} N{} w{} s{}".format(*cfg), ms, tf,
                     f"{best_sdpa / ms:.3f}x best SDPA, {tf / mm:.2f} of matmul"])  # fmt: skip
        print(f"  {rows[-1]}", flush=True)
    return rows


def decode1_rows(ncu: bool) -> list[list]:
    hkv = 4
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for ctx in (8192, 32768, 131072):
        k, v, _, _, table, lens = paged(1, ctx, 64, False, kv_heads=hkv)
        q = torch.randn(1, HQ, D, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        sdpa = None if ncu else time_sdpa_decode(1, ctx)
        if sdpa is not None:
            rows.append([f"decode b1 ctx{ctx}", "SDPA", sdpa, "-", "-"])
        for bn, w, s in ((64, 4, 4), (32, 4, 4), (128, 4, 3), (64, 8, 3)):
            for waves in (1.0, 2.0, 4.0, 8.0):
                splits = pa.decode_num_splits(1, hkv, ctx, sms, waves)
                ws = pa.decode_workspace(1, HQ, D, splits, "cuda")

                def fn():
                    pa.decode_fwd(q, k, v, table, lens, 64, D**-0.5, out=out, workspace=ws,
                                  block_n=bn, num_warps=w, num_stages=s)  # fmt: skip

                if ncu:
                    fn()
                    break
                ms = time_ms(fn)
                nbytes = 2 * ctx * hkv * D * 2
                rows.append([f"decode b1 ctx{ctx}", f"bn{bn} w{w} s{s} waves{waves:g} "
                             f"({splits} splits)", ms, nbytes / ms / 1e6,
                             f"{sdpa / ms:.3f}x SDPA"])  # fmt: skip
                print(f"  {rows[-1]}", flush=True)
            if ncu:
                break
    return rows


def store_rows(copy: float, ncu: bool) -> list[list]:
    tokens, heads = 256 * 1024, 8
    k, v = (torch.randn(tokens, heads, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kc, vc = (torch.empty(tokens, heads, D, device="cuda", dtype=torch.float8_e4m3fn)
              for _ in range(2))  # fmt: skip
    ks, vs = (torch.empty(tokens, heads, device="cuda") for _ in range(2))
    loc = torch.randperm(tokens, device="cuda")
    nbytes = 2 * tokens * heads * (D * 3 + 4) + tokens * 8
    if ncu:
        kvq.store_kv(k, v, kc, vc, loc, ks, vs)
        torch.cuda.synchronize()
        return []
    rows = []
    for bt, w, h in STORE_CFGS:
        ms = time_ms(lambda: kvq.store_kv(k, v, kc, vc, loc, ks, vs, bt, w, heads_per_program=h),
                     graph=False)  # fmt: skip
        gbs = nbytes / ms / 1e6
        rows.append(
            ["store fp8 256K tok", f"T{bt} w{w} H{h}", ms, gbs, f"{gbs / copy:.3f} of copy"]
        )
        print(f"  {rows[-1]}", flush=True)
    sorted_loc = torch.arange(tokens, device="cuda")
    ms = time_ms(lambda: kvq.store_kv(k, v, kc, vc, sorted_loc, ks, vs), graph=False)
    gbs = nbytes / ms / 1e6
    rows.append(
        ["store fp8 256K tok", "default, slots in order", ms, gbs, f"{gbs / copy:.3f} of copy"]
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="extend,decode1,store")
    ap.add_argument("--ncu", action="store_true", help="one launch of each, for Nsight Compute")
    args = ap.parse_args()
    only = set(args.only.split(","))
    rows = []
    copy = mm = 0.0
    if not args.ncu:
        copy, mm = copy_bandwidth(), matmul_rate()
        print(f"{device_name()}: copy {copy:.0f} GB/s (read + write), bf16 matmul {mm:.0f} TFLOP/s")
    if "extend" in only:
        for hkv in (4, 8):
            rows += extend_rows(hkv, mm, args.ncu)
    if "decode1" in only:
        rows += decode1_rows(args.ncu)
    if "store" in only:
        rows += store_rows(copy, args.ncu)
    if rows:
        head = ["case", "variant", "ms", "TFLOP/s or GB/s", "vs baseline"]
        print(format_table(head, rows))


if __name__ == "__main__":
    main()
