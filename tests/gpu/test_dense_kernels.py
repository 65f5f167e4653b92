"""Dense atom kernels on CUDA at realistic sizes (same checks as tests/unit/kernels)."""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "unit", "kernels")
)
from helpers import assert_close_rel, poisoned, rel_err  # noqa: E402
from paged_inputs import FP8, indptr, paged_kv, queries  # noqa: E402
from sgl_atom.kernels import kv_quant as kvq  # noqa: E402
from sgl_atom.kernels import paged_attention as pa  # noqa: E402

DEV = "cuda"
TOL = 2e-2
DTYPES = [torch.bfloat16, FP8]


def _name(dt):
    return "fp8" if dt == FP8 else "bf16"


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("tokens", [4097, 64, 1])  # a prefill chunk (all heads per program), decode
def test_store_kv(dtype, tokens):
    heads, d, slots = 8, 128, 9000
    k, v = (torch.randn(tokens, heads, d, device=DEV).bfloat16() for _ in range(2))
    loc = torch.randperm(slots, device=DEV)[:tokens]
    got = [poisoned((slots, heads, d), dtype, DEV) for _ in range(2)]
    got += (
        [poisoned((slots, heads), torch.float32, DEV) for _ in range(2)]
        if dtype == FP8
        else [None, None]
    )
    want = [t.clone() if t is not None else None for t in got]
    kvq.store_kv(k, v, *got[:2], loc, *got[2:])
    kvq.reference_store_kv(k, v, *want[:2], loc, *want[2:])
    if dtype != FP8:
        for g, w in zip(got, want, strict=True):
            if g is not None:
                assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
        return
    for g, w in zip(got[2:], want[2:], strict=True):  # scales: exact
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    for g, w in zip(got[:2], want[:2], strict=True):  # bytes: exact (the kernel rounds as torch)
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("ps", [1, 16, 64, 128], ids=lambda p: f"ps{p}")
@pytest.mark.parametrize(
    "hq,hkv,d", [(32, 4, 128), (8, 8, 64), (16, 4, 256)], ids=["gqa8-d128", "gqa1-d64", "gqa4-d256"]
)
def test_decode(dtype, ps, hq, hkv, d):
    lens = [8191, 1, 3000, 16384, 77, 5000, 129, 2048]
    kc, vc, ks, vs, table, sl = paged_kv(lens, hkv, d, ps, dtype, DEV)
    q = queries(len(lens), hq, d, DEV)
    out = pa.decode_fwd(
        q,
        kc,
        vc,
        table,
        sl,
        ps,
        d**-0.5,
        out=poisoned(q.shape, q.dtype, DEV),
        k_scale=ks,
        v_scale=vs,
    )
    assert_close_rel(out, pa.reference_decode(q, kc, vc, table, sl, ps, d**-0.5, ks, vs), TOL)


@pytest.mark.parametrize("v_gain", [0.05, 0.005], ids=["v-x0.05", "v-x0.005"])
@pytest.mark.parametrize("op", ["decode", "extend"])
def test_fp16_q_fp8_kv_small_v_long_context(op, v_gain):
    """fp16 q (--dtype float16) over fp8 K/V at 32K context with small V values: the V scale
    must not push p * v_scale into fp16's subnormals (it multiplies the tile's p @ V instead)."""
    ps, hq, hkv, d = 16, 32, 8, 128
    lens = [32768, 20000]
    kc, vc, ks, vs, table, sl = paged_kv(lens, hkv, d, ps, FP8, DEV, seed=21)
    vs = vs * v_gain
    new = [1, 1] if op == "decode" else [64, 9]
    q = queries(sum(new), hq, d, DEV, seed=22).half()
    out = poisoned(q.shape, q.dtype, DEV)
    if op == "decode":
        pa.decode_fwd(q, kc, vc, table, sl, ps, d**-0.5, out=out, k_scale=ks, v_scale=vs)
        ref = pa.reference_decode(q, kc, vc, table, sl, ps, d**-0.5, ks, vs)
    else:
        qo = indptr(new, DEV)
        pa.extend_fwd(q, kc, vc, table, sl, qo, ps, d**-0.5, out=out, k_scale=ks, v_scale=vs)
        ref = pa.reference_extend(q, kc, vc, table, sl, qo, ps, d**-0.5, ks, vs)
    assert_close_rel(out, ref, TOL)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("ps", [1, 64], ids=lambda p: f"ps{p}")
@pytest.mark.parametrize(
    "hq,hkv,d", [(32, 4, 128), (16, 4, 256), (8, 8, 64)], ids=["gqa8-d128", "gqa4-d256", "gqa1-d64"]
)
def test_extend(dtype, ps, hq, hkv, d):
    lens, new = [2048, 1500, 700, 33], [2048, 300, 1, 33]
    kc, vc, ks, vs, table, sl = paged_kv(lens, hkv, d, ps, dtype, DEV)
    q = queries(sum(new), hq, d, DEV)
    qo = indptr(new, DEV)
    out = pa.extend_fwd(
        q,
        kc,
        vc,
        table,
        sl,
        qo,
        ps,
        d**-0.5,
        out=poisoned(q.shape, q.dtype, DEV),
        k_scale=ks,
        v_scale=vs,
    )
    assert_close_rel(out, pa.reference_extend(q, kc, vc, table, sl, qo, ps, d**-0.5, ks, vs), TOL)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("num_draft", [2, 8], ids=lambda n: f"draft{n}")
def test_verify(dtype, num_draft):
    lens = [9000, 40, 3000]
    kc, vc, ks, vs, table, sl = paged_kv(lens, 4, 128, 16, dtype, DEV)
    q = queries(len(lens) * num_draft, 32, 128, DEV)
    out = pa.verify_fwd(
        q,
        kc,
        vc,
        table,
        sl,
        16,
        128**-0.5,
        num_draft,
        out=poisoned(q.shape, q.dtype, DEV),
        k_scale=ks,
        v_scale=vs,
    )
    assert_close_rel(out, pa.reference_verify(q, kc, vc, table, sl, 16, 128**-0.5, ks, vs), TOL)


@pytest.mark.parametrize("kv_mode", ["pairs", "f16pairs"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "block"])
@pytest.mark.parametrize("num_draft", [5, 8], ids=lambda n: f"draft{n}")
def test_verify_fp8_pairs_modes(kv_mode, causal, num_draft):
    """Target verify (and a block drafter's non-causal pass) over fp8 K/V read as 16-bit
    words, at the server's head shape, split 1 and 3 ways, against float64."""
    lens = [4096, 40, 3000]
    kc, vc, ks, vs, table, sl = paged_kv(lens, 8, 128, 16, FP8, DEV, seed=num_draft)
    q = queries(len(lens) * num_draft, 32, 128, DEV, seed=41)
    if causal:
        ref = pa.reference_verify(q, kc, vc, table, sl, 16, 128**-0.5, ks, vs)
    else:  # each row a decode over its whole sequence
        rows = torch.arange(len(lens), device=DEV).repeat_interleave(num_draft)
        ref = pa.reference_decode(q, kc, vc, table[rows].contiguous(), sl[rows].contiguous(), 16,
                                  128**-0.5, ks, vs)  # fmt: skip
    for splits in (1, 3):
        out = pa.verify_fwd(q, kc, vc, table, sl, 16, 128**-0.5, num_draft, causal=causal,
                            out=poisoned(q.shape, q.dtype, DEV), k_scale=ks, v_scale=vs,
                            num_splits=splits, kv_mode=kv_mode)  # fmt: skip
        assert_close_rel(out, ref, TUNED_TOL, f"splits {splits}")


def test_decode_cuda_graph_replay():
    """Capture once with a static workspace and fixed splits; replay with new lengths and data."""
    lens = [4000, 100, 9000, 1]
    kc, vc, ks, vs, table, sl = paged_kv(lens, 4, 128, 64, FP8, DEV)
    q = queries(4, 32, 128, DEV)
    ws = pa.decode_workspace(4, 32, 128, 32, DEV)
    out = torch.empty_like(q)
    run = lambda: pa.decode_fwd(
        q,
        kc,
        vc,
        table,
        sl,
        64,
        128**-0.5,
        out=out,
        k_scale=ks,  # noqa: E731
        v_scale=vs,
        workspace=ws,
    )
    run()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    sl.copy_(torch.tensor([17, 8999, 64, 2500], dtype=torch.int32))
    q.copy_(queries(4, 32, 128, DEV, seed=9))
    out.fill_(float("nan"))
    g.replay()
    assert_close_rel(out, pa.reference_decode(q, kc, vc, table, sl, 64, 128**-0.5, ks, vs), TOL)


TUNED_TOL = 1e-2  # bf16 dot operands (q, p) on the GPU; half the older kernels' bound


TILINGS = {  # what benchmarks/tune_decode.py sweeps (and a tuning file may pick): block_n,
    # warps, stages, register cap, fp8 kv_mode (None: the launcher's, "bits" for a bf16 q)
    "bf16": [(64, 4, 4, None, None), (64, 4, 4, 96, None), (128, 4, 3, None, None)],
    "fp8": [(128, 4, 3, reg, None) for reg in (None, 128)]
    + [
        (bn, 4, 3 if bn == 128 else 4, reg, mode)
        for mode in ("pairs", "f16pairs")
        for bn, reg in ((64, None), (128, None), (128, 128))
    ],
}


@pytest.mark.parametrize(
    "kv,tiling",
    [(kv, t) for kv, ts in TILINGS.items() for t in ts],
    ids=lambda v: v if isinstance(v, str) else "bn{} w{} s{} r{} {}".format(*v),
)
def test_decode_tunings(kv, tiling, report):
    """Every tiling the decode tuning sweep may pick, at the server's shape (32 q / 8 KV heads,
    page 16), split 1..8 ways, against float64."""
    block_n, warps, stages, maxnreg, kv_mode = tiling
    dtype = FP8 if kv == "fp8" else torch.bfloat16
    lens = [4096, 1, 16384, 4095, 129, 2049, 7, 30000]
    kc, vc, ks, vs, table, sl = paged_kv(lens, 8, 128, 16, dtype, DEV, seed=block_n + stages)
    q = queries(len(lens), 32, 128, DEV, seed=warps)
    ref = pa.reference_decode(q, kc, vc, table, sl, 16, 128**-0.5, ks, vs)
    for splits in (1, 3, 8):
        out = pa.decode_fwd(
            q, kc, vc, table, sl, 16, 128**-0.5, out=poisoned(q.shape, q.dtype, DEV),
            k_scale=ks, v_scale=vs, num_splits=splits, block_n=block_n, num_warps=warps,
            num_stages=stages, maxnreg=maxnreg, kv_mode=kv_mode,
        )  # fmt: skip
        assert_close_rel(out, ref, TUNED_TOL, f"splits {splits}")
    err = rel_err(out, ref)
    tiling = f"bn{block_n} w{warps} s{stages} r{maxnreg} {kv_mode}"
    report(f"GPU decode {kv} {tiling}: rel err {err:.1e}")


@pytest.mark.parametrize("batch", [1, 16, 64])
def test_markov_refine_on_device_matches_float64(batch):
    """The DSpark Markov head at Llama-3's vocab and rank 256 with bf16 weights: the float32
    bias GEMM on the device (no float32 copy of the head) gives float64's logits to float32
    rounding, and float64's tokens wherever its top-2 gap is clear of that rounding."""
    from sgl_atom.speculative.dspark.markov import markov_refine, markov_step_logits

    vocab, rank, k = 128256, 256, 4
    g = torch.Generator(device=DEV).manual_seed(batch)
    base = torch.randn(batch, k, vocab, device=DEV, generator=g).bfloat16()
    w1, w2 = (torch.randn(vocab, rank, device=DEV, generator=g).bfloat16() * 0.1 for _ in "12")
    anchor = torch.randint(0, vocab, (batch,), device=DEV, generator=g)
    tokens, logits = markov_refine(base, anchor, w1, w2, return_logits=True)
    prev = anchor.long()
    for j in range(k):
        want = base[:, j].double() + w1[prev].double() @ w2.double().T
        assert rel_err(logits[:, j].double(), want) < 1e-5
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-4
        assert torch.equal(tokens[clear, j], want.argmax(-1)[clear])
        prev = tokens[:, j]
    one = markov_step_logits(base[:, 0], anchor, w1, w2)
    assert one.dtype == torch.float32 and torch.equal(one, logits[:, 0])


@pytest.mark.parametrize("batch", [1, 16, 64])
def test_fused_markov_refine_matches_float64(batch):
    """The fused Markov step (the served path on CUDA) at Llama-3's vocab and rank 256: each
    pick is a float64 maximum to float32 rounding, float64's argmax wherever the top-2 gap is
    clear of it, and the unfused torch path's token there too."""
    from sgl_atom.speculative.dspark.markov import fused_step, markov_refine

    vocab, rank, k = 128256, 256, 4
    g = torch.Generator(device=DEV).manual_seed(100 + batch)
    base = torch.randn(batch, k, vocab, device=DEV, generator=g).bfloat16()
    w1, w2 = (torch.randn(vocab, rank, device=DEV, generator=g).bfloat16() * 0.1 for _ in "12")
    anchor = torch.randint(0, vocab, (batch,), device=DEV, generator=g)
    assert fused_step(base, w1, w2)
    tokens = markov_refine(base, anchor, w1, w2)
    _, torch_logits = markov_refine(base, anchor, w1, w2, return_logits=True)
    prev = anchor.long()
    for j in range(k):
        want = base[:, j].double() + w1[prev].double() @ w2.double().T
        picked = want.gather(1, tokens[:, j : j + 1]).squeeze(1)
        top2 = want.topk(2, dim=-1).values
        assert torch.all(picked >= top2[:, 0] - 1e-4)
        clear = (top2[:, 0] - top2[:, 1]) > 1e-4
        assert torch.equal(tokens[clear, j], want.argmax(-1)[clear])
        if j == 0:  # later steps' torch logits follow the torch path's own picks
            assert torch.equal(tokens[clear, 0], torch_logits[clear, 0].argmax(-1))
        prev = tokens[:, j]


def _committed_verify_tilings() -> list[tuple[str, dict]]:
    from sgl_atom.attention import decode_tuning as dt

    out = []
    for file in sorted(dt.TUNED_DIR.glob("*.json")):
        for kv in dt.KV_KINDS:
            tuning, _ = dt.load(kv, "", str(file), "verify")
            out.append((f"{file.stem}-{kv}", dict(kv=kv, **tuning.kernel_kwargs())))
    return out


VERIFY_TILINGS = _committed_verify_tilings()


@pytest.mark.parametrize("num_draft", [5, 8], ids=lambda n: f"draft{n}")
@pytest.mark.parametrize("label,tiling", VERIFY_TILINGS, ids=[t[0] for t in VERIFY_TILINGS])
def test_committed_verify_tilings(label, tiling, num_draft, report):
    """The target-verify tiling of each committed tuning file (what the atom backend launches
    for verify on that device), at the server's shape (32 q / 8 KV heads, page 16), split 1..8
    ways, against float64."""
    tiling = dict(tiling)
    dtype = FP8 if tiling.pop("kv") == "fp8" else torch.bfloat16
    lens = [4096, num_draft, 9000, 130]
    kc, vc, ks, vs, table, sl = paged_kv(lens, 8, 128, 16, dtype, DEV, seed=num_draft)
    q = queries(len(lens) * num_draft, 32, 128, DEV, seed=num_draft + 1)
    ref = pa.reference_verify(q, kc, vc, table, sl, 16, 128**-0.5, ks, vs)
    for splits in (1, 3, 8):
        out = pa.verify_fwd(
            q, kc, vc, table, sl, 16, 128**-0.5, num_draft, out=poisoned(q.shape, q.dtype, DEV),
            k_scale=ks, v_scale=vs, num_splits=splits, **tiling,
        )  # fmt: skip
        assert_close_rel(out, ref, TUNED_TOL, f"splits {splits}")
    err = rel_err(out, ref)
    report(f"GPU verify {label} {tiling or 'defaults'} draft {num_draft}: rel err {err:.1e}")


@pytest.mark.parametrize("label,tiling", VERIFY_TILINGS, ids=[t[0] for t in VERIFY_TILINGS])
def test_committed_verify_tilings_as_the_draft_block(label, tiling, report):
    """The same tilings as the DSpark draft launches them for its block attention
    (``AtomDSparkDraftModel.block_tiling``): non-causal, k = 4 block rows, a page-size-1 table
    over shuffled slots, 32 q / 8 KV heads, split 1..8 ways, against float64."""
    tiling = dict(tiling)
    dtype = FP8 if tiling.pop("kv") == "fp8" else torch.bfloat16
    lens, block = [4096, 4, 3001], 4
    kc, vc, ks, vs, table, sl = paged_kv(lens, 8, 128, 16, dtype, DEV, seed=7)
    # the same rows through a page-size-1 table, as the draft's block_page_table builds it
    slots = table.long()[:, :, None] * 16 + torch.arange(16, device=DEV)
    table1 = slots.reshape(len(lens), -1).to(torch.int32).contiguous()
    q = queries(len(lens) * block, 32, 128, DEV, seed=8)
    rows = torch.arange(len(lens), device=DEV).repeat_interleave(block)
    ref = pa.reference_decode(q, kc, vc, table1[rows].contiguous(), sl[rows].contiguous(), 1,
                              128**-0.5, ks, vs)  # fmt: skip
    for splits in (1, 3, 8):
        out = pa.verify_fwd(
            q, kc, vc, table1, sl, 1, 128**-0.5, block, out=poisoned(q.shape, q.dtype, DEV),
            k_scale=ks, v_scale=vs, num_splits=splits, causal=False, **tiling,
        )  # fmt: skip
        assert_close_rel(out, ref, TUNED_TOL, f"splits {splits}")
    err = rel_err(out, ref)
    report(f"GPU draft block {label} {tiling or 'defaults'}: rel err {err:.1e}")


@pytest.mark.parametrize(
    "kv_mode,with_new,prefix_dequant",
    [(m, w, "off") for m in ("bits", "pairs", "f16pairs") for w in (False, True)]
    + [("bits", True, "auto")],
    ids=lambda v: {False: "cache-only", True: "k_new"}.get(v, v) if isinstance(v, bool) else v,
)
def test_extend_fp8_modes(kv_mode, with_new, prefix_dequant):
    """Extend over an fp8 cache in each mode the prefix can be read in, with and without the
    new tokens' own K/V (the atom backend passes them), and with the prefix dequantized into a
    bf16 workspace first, at the server's head shape, against float64 (the reference reads the
    same 16-bit new rows when they are passed)."""
    ps, hq, hkv, d = 16, 32, 8, 128
    lens, new = [4096, 1500, 700, 33], [1024, 300, 1, 33]
    kc, vc, ks, vs, table, sl = paged_kv(lens, hkv, d, ps, FP8, DEV, seed=31)
    q, qo = queries(sum(new), hq, d, DEV, seed=32), indptr(new, DEV)
    kw = {}
    if with_new:
        g = torch.Generator(device=DEV).manual_seed(33)
        kw = {
            n: torch.randn(sum(new), hkv, d, device=DEV, generator=g).bfloat16()
            for n in ("k_new", "v_new")
        }
        kw["prefix_dequant"] = prefix_dequant
    out = pa.extend_fwd(q, kc, vc, table, sl, qo, ps, d**-0.5, out=poisoned(q.shape, q.dtype, DEV),
                        k_scale=ks, v_scale=vs, kv_mode=kv_mode, **kw)  # fmt: skip
    kw.pop("prefix_dequant", None)
    ref = pa.reference_extend(q, kc, vc, table, sl, qo, ps, d**-0.5, ks, vs, **kw)
    assert_close_rel(out, ref, TUNED_TOL)
