"""Where an fp8-KV prefill spends the time a bf16 one does not: one layer's prefill work (the
K/V store, then extend attention) at the server benchmark's attention shape (32 q / 8 KV heads,
head_dim 128, page 16), with the new tokens' own K/V passed to the kernel as the atom backend
passes them (only a cached prefix is read from fp8).

    python3 benchmarks/probe_extend_fp8.py

Rows: a fresh prompt (no prefix), a second chunk over a cached prefix and short extends over a
long one; for each, the bf16 cache, then the fp8 cache under the 16-bit tiling (what
`extend_fwd` takes when the new tokens' K/V are passed) with the cached prefix converted in the
kernel (bits, and the pairs modes: 16-bit words of two e4m3 bytes) or dequantized once into a
bf16 workspace first with the new tokens' rows (the default, planned from the host's lengths
as the backend does); "default tiling" rows take the launcher's choice for the shape (256-row
tiles for long extends), the others 128-row tiles.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from bench_paged_attention import paged  # noqa: E402
from common import device_name, format_table, import_kernels, time_ms  # noqa: E402

pa = import_kernels("paged_attention")
kvq = import_kernels("kv_quant")
HQ, HKV, D, PAGE = 32, 8, 128, 16
# (cached prefix, new tokens)
CASES = [(0, 16384), (0, 4096), (0, 2048), (0, 1024), (8192, 8192), (16384, 2048), (16384, 512)]
CASES += [(16384, 128), (16384, 32)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def main() -> None:
    print(f"{device_name()}: {HQ} q / {HKV} KV heads, d{D}, page {PAGE}, one layer")
    rows = []
    bf16_cfg = pa.extend._config(D, False, cpu=False)
    off = dict(bf16_cfg, prefix_dequant="off")
    for prefix, new in CASES:
        total = prefix + new
        base = None
        # the launcher's own tiling for this shape (no overrides): 256-row tiles for long ones
        auto = pa.extend._config(D, False, False, new * HQ // HKV, -(-total // PAGE) * PAGE)
        for label, fp8, cfg in (
            ("bf16 cache, M128", False, bf16_cfg),
            ("bf16 cache, default tiling", False, {}),
            ("fp8, prefix in kernel: bits", True, dict(off, kv_mode="bits")),
            ("fp8, prefix in kernel: f16pairs", True, dict(off, kv_mode="f16pairs")),
            ("fp8, workspace, default tiling", True, {}),
        ):
            kc, vc, ks, vs, table, lens = paged(1, total, PAGE, fp8, kv_heads=HKV)
            q = torch.randn(new, HQ, D, device="cuda", dtype=torch.bfloat16)
            k_new = torch.randn(new, HKV, D, device="cuda", dtype=torch.bfloat16)
            v_new = torch.randn(new, HKV, D, device="cuda", dtype=torch.bfloat16)
            qo = torch.tensor([0, new], dtype=torch.int32, device="cuda")
            slots = (table[0].long()[:, None] * PAGE + torch.arange(PAGE, device="cuda")).view(-1)
            loc = slots[prefix:total]
            out = torch.empty_like(q)
            kw = dict(out=out, k_scale=ks, v_scale=vs, max_qo_len=new, **cfg)
            tiling = "M{block_m} N{block_n} w{num_warps} s{num_stages}".format(**(cfg or auto))
            tiling += f" {cfg['kv_mode']}" if "kv_mode" in cfg else ""
            if fp8:
                kw.update(k_new=k_new, v_new=v_new)
            else:
                kw.pop("prefix_dequant", None)
            if "workspace" in label:  # planned from the host's lengths, as the backend does
                kw.update(prefix_plan=pa.plan_prefix_dequant(lens, HKV, D, seq_lens_cpu=[total]))

            def store(kc=kc, vc=vc, ks=ks, vs=vs, loc=loc, k_new=k_new, v_new=v_new):
                kvq.store_kv(k_new, v_new, kc, vc, loc, ks, vs)

            def attend(q=q, kc=kc, vc=vc, table=table, lens=lens, qo=qo, kw=kw):
                pa.extend_fwd(q, kc, vc, table, lens, qo, PAGE, D**-0.5, **kw)

            store()
            attend()
            nb = min(new, 256)  # the reference over the first query rows
            ref = pa.reference_extend(
                q[:nb], kc, vc, table, torch.full_like(lens, prefix + nb), qo.clamp(max=nb),
                PAGE, D**-0.5, ks, vs, k_new=k_new[:nb] if fp8 else None,
                v_new=v_new[:nb] if fp8 else None,
            )  # fmt: skip
            err = rel_err(out[:nb], ref)
            st = time_ms(store, graph=False)
            at = time_ms(attend, graph=False)
            base = base or (st + at)
            rows.append([f"{prefix}+{new}", label, tiling, st, at, (st + at) / base, err])
            print(f"  {rows[-1]}", flush=True)
            del kc, vc, ks, vs
            torch.cuda.empty_cache()
    head = ["prefix+new", "cache", "tiling", "store ms", "attend ms", "vs bf16", "rel err"]
    print(format_table(head, rows))


if __name__ == "__main__":
    main()
