"""Paged attention launchers against the float64 torch reference (bf16 and fp8 KV)."""

import pytest
import torch
from helpers import assert_close_rel, device, poisoned, rel_err
from paged_inputs import FP8, indptr, paged_kv, queries
from sgl_atom.kernels import paged_attention as pa

DEV = device()
TOL = 5e-3  # bf16 rounding (q, probabilities; fp32 dots on CPU) with fp32 accumulation

# (page_size, q_heads, kv_heads, head_dim, kv dtype): GQA 1/4/8, every supported head_dim/page
CASES = [
    (1, 2, 2, 64, torch.bfloat16),
    (16, 8, 2, 128, FP8),
    (64, 8, 1, 64, torch.bfloat16),
    (128, 8, 2, 256, FP8),
    (16, 16, 2, 64, torch.bfloat16),
]


def _id(c):
    ps, hq, hkv, d, dt = c
    return f"ps{ps}-gqa{hq // hkv}-d{d}-{'fp8' if dt == FP8 else 'bf16'}"


def _out(q):
    return poisoned(q.shape, q.dtype, DEV)


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize(
    "lens,splits",
    [([63, 1, 130], None), ([200, 17], 5), ([300, 2, 77], 1)],
    ids=["ragged", "splits5", "one-split"],
)
def test_decode(case, lens, splits):
    ps, hq, hkv, d, dt = case
    kc, vc, ks, vs, table, sl = paged_kv(lens, hkv, d, ps, dt, DEV, seed=ps + d)
    q = queries(len(lens), hq, d, DEV)
    out = pa.decode_fwd(
        q, kc, vc, table, sl, ps, d**-0.5, out=_out(q), k_scale=ks, v_scale=vs, num_splits=splits
    )
    ref = pa.reference_decode(q, kc, vc, table, sl, ps, d**-0.5, ks, vs)
    assert_close_rel(out, ref, TOL)


@pytest.mark.parametrize("splits", [1, 3], ids=lambda n: f"splits{n}")
def test_decode_sequence_of_no_keys_reads_zero(splits):
    """A row of length 0 (a padded row of a captured batch) comes out zero, unsplit or split,
    its neighbours as the reference has them: the merge never reads a partial that no program
    wrote (the workspace is poisoned)."""
    kc, vc, ks, vs, table, sl = paged_kv([40, 0, 300], 2, 64, 16, FP8, DEV, seed=5)
    q = queries(3, 8, 64, DEV, seed=6)
    ws = (
        poisoned((3, 8, splits, 64), torch.float32, DEV),
        poisoned((3, 8, splits), torch.float32, DEV),
    )
    out = pa.decode_fwd(q, kc, vc, table, sl, 16, 0.125, out=_out(q), k_scale=ks, v_scale=vs,
                        workspace=ws)  # fmt: skip
    assert torch.equal(out[1].float(), torch.zeros_like(out[1], dtype=torch.float32))
    live = torch.tensor([0, 2], device=DEV)
    ref = pa.reference_decode(q[live], kc, vc, table[live], sl[live], 16, 0.125, ks, vs)
    assert_close_rel(out[live], ref, TOL)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_tolerance_catches_a_dropped_newest_key(case):
    """The tolerance is tight enough that a kernel ignoring each sequence's newest key (the
    token just stored) fails every decode case."""
    ps, hq, hkv, d, dt = case
    lens = [63, 2, 130]
    kc, vc, ks, vs, table, sl = paged_kv(lens, hkv, d, ps, dt, DEV, seed=ps + d + 7)
    q = queries(len(lens), hq, d, DEV, seed=8)
    ref = pa.reference_decode(q, kc, vc, table, sl, ps, d**-0.5, ks, vs)
    dropped = pa.decode_fwd(q, kc, vc, table, sl - 1, ps, d**-0.5, out=_out(q), k_scale=ks,
                            v_scale=vs)  # fmt: skip
    assert rel_err(dropped, ref) > TOL


def test_decode_static_workspace_reused():
    """A graph-style call: one workspace with more splits than needed, reused across batches."""
    ws = pa.decode_workspace(4, 8, 64, 8, DEV)
    for seed, lens in enumerate([[5, 90, 33, 1], [64, 2]]):
        kc, vc, ks, vs, table, sl = paged_kv(lens, 2, 64, 16, torch.bfloat16, DEV, seed=seed)
        q = queries(len(lens), 8, 64, DEV, seed=seed)
        ws[0].fill_(float("nan"))
        ws[1].fill_(float("nan"))
        out = pa.decode_fwd(q, kc, vc, table, sl, 16, 0.125, out=_out(q), workspace=ws)
        assert_close_rel(out, pa.reference_decode(q, kc, vc, table, sl, 16, 0.125), TOL)


@pytest.mark.parametrize("case", CASES[:4], ids=_id)
def test_extend(case):
    ps, hq, hkv, d, dt = case
    lens, new = [63, 9, 90], [63, 1, 40]  # pure prefill, one token, extend after a prefix
    kc, vc, ks, vs, table, sl = paged_kv(lens, hkv, d, ps, dt, DEV, seed=ps)
    q = queries(sum(new), hq, d, DEV)
    qo = indptr(new, DEV)
    out = pa.extend_fwd(q, kc, vc, table, sl, qo, ps, d**-0.5, out=_out(q), k_scale=ks, v_scale=vs)
    ref = pa.reference_extend(q, kc, vc, table, sl, qo, ps, d**-0.5, ks, vs)
    assert_close_rel(out, ref, TOL)


def _new_rows_of(cache, table, lens, new, page_size):
    """Slots of each sequence's new tokens (its last ``new[b]`` positions), in q's row order."""
    out = []
    for b, (n, m) in enumerate(zip(lens.tolist(), new, strict=True)):
        pos = torch.arange(n - m, n, device=table.device)
        out.append(table[b, pos // page_size].long() * page_size + pos % page_size)
    return torch.cat(out)


@pytest.mark.parametrize(
    "ps,mode",
    [(1, "bits"), (16, "bits"), (16, "bf16"), (16, "f16"), (16, "pairs"), (1, "f16pairs")],
)
def test_fp8_extend_reads_the_new_tokens_as_computed(ps, mode):
    """With an fp8 cache and k_new/v_new, the new tokens attend to those exact 16-bit rows and
    only the cached prefix is read from fp8: the new tokens' cache rows are poisoned (NaN
    values and scales) and must not reach the output; every fp8 mode matches the reference."""
    hq, hkv, d = 8, 2, 128
    lens, new = [40, 9, 50, 33], [40, 1, 24, 9]  # pure prefill, one token, extends
    kc, vc, ks, vs, table, sl = paged_kv(lens, hkv, d, ps, FP8, DEV, seed=ps + 11)
    q, qo = queries(sum(new), hq, d, DEV, seed=12), indptr(new, DEV)
    g = torch.Generator().manual_seed(13)
    k_new = torch.randn(sum(new), hkv, d, generator=g).to(torch.bfloat16).to(DEV)
    v_new = torch.randn(sum(new), hkv, d, generator=g).to(torch.bfloat16).to(DEV)
    rows = _new_rows_of(kc, table, sl, new, ps)
    for c in (kc, vc):
        c.view(torch.uint8)[rows] = 0x7F  # e4m3 NaN
    for s in (ks, vs):
        s[rows] = float("nan")
    ref = pa.reference_extend(q, kc, vc, table, sl, qo, ps, d**-0.5, ks, vs, k_new=k_new,
                              v_new=v_new)  # fmt: skip
    assert torch.isfinite(ref).all()
    out = pa.extend_fwd(q, kc, vc, table, sl, qo, ps, d**-0.5, out=_out(q), k_scale=ks,
                        v_scale=vs, kv_mode=mode, k_new=k_new, v_new=v_new)  # fmt: skip
    assert_close_rel(out, ref, TOL)
    # without the new rows the kernel reads the poisoned cache: the test sees the difference
    plain = pa.extend_fwd(q, kc, vc, table, sl, qo, ps, d**-0.5, out=_out(q), k_scale=ks,
                          v_scale=vs, kv_mode=mode)  # fmt: skip
    assert not torch.isfinite(plain).all()


def _poison_new_rows(kc, vc, ks, vs, table, sl, new, ps):
    rows = _new_rows_of(kc, table, sl, new, ps)
    for c in (kc, vc):
        c.view(torch.uint8)[rows] = 0x7F  # e4m3 NaN
    for s in (ks, vs):
        s[rows] = float("nan")


def _new_kv(total, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(total, hkv, d, generator=g).to(torch.bfloat16).to(DEV) for _ in "kv"]


@pytest.mark.parametrize("ps", [1, 16])
def test_dequant_prefix_rows(ps):
    """Sequence b's workspace rows start at its plan offset: its cached prefix as e4m3 x scale
    rounded once to bf16 (within one bf16 rounding of the float64 product: Triton's interpreter
    truncates where the GPU rounds to nearest), then its new tokens' rows as passed. The new
    tokens' cache rows (poisoned) are not read."""
    hkv, d = 2, 64
    lens, new = [40, 9, 70, 33], [8, 9, 24, 1]  # prefixes 32, 0, 46, 32
    kc, vc, ks, vs, table, sl = paged_kv(lens, hkv, d, ps, FP8, DEV, seed=ps + 21)
    qo = indptr(new, DEV)
    k_new, v_new = _new_kv(sum(new), hkv, d, ps + 22)
    _poison_new_rows(kc, vc, ks, vs, table, sl, new, ps)
    plan = pa.plan_prefix_dequant(sl, hkv, d)  # pages of 16 rows: 3, 1, 5, 3
    assert (plan.tokens, plan.max_seq_len, plan.offsets.tolist()) == (192, 70, [0, 48, 64, 144])
    assert plan.table.shape == (4, 5) and plan.table[2].tolist() == [4, 5, 6, 7, 8]
    kd, vd = pa.dequant_prefix(kc, vc, ks, vs, k_new, v_new, table, sl, qo, ps, plan)
    assert kd.shape == (192, hkv, d) and kd.dtype == torch.bfloat16
    for cache, scale, rows, got in ((kc, ks, k_new, kd), (vc, vs, v_new, vd)):
        row = 0
        for b, (n, m) in enumerate(zip(lens, new, strict=True)):
            pos = torch.arange(n - m, device=table.device)
            slot = table[b, pos // ps].long() * ps + pos % ps
            off = plan.offsets[b].item()
            want = cache[slot].double() * scale[slot].double()[..., None]
            torch.testing.assert_close(got[off : off + n - m].double(), want, rtol=2.0**-7,
                                       atol=0.0)  # fmt: skip
            assert torch.equal(got[off + n - m : off + n], rows[row : row + m])
            row += m


def test_plan_prefix_dequant_rules():
    """A workspace over the cap gives no plan (the prefix is converted in the kernel); the
    host's lengths give the device's plan."""
    sl = torch.tensor([300, 200], dtype=torch.int32, device=DEV)  # 19 and 13 pages of 16
    plan = pa.plan_prefix_dequant(sl, 8, 128)
    assert (plan.tokens, plan.max_seq_len, plan.offsets.tolist()) == (512, 300, [0, 304])
    host = pa.plan_prefix_dequant(sl, 8, 128, seq_lens_cpu=[300, 200])
    assert torch.equal(host.table, plan.table) and host.tokens == 512
    assert pa.plan_prefix_dequant(sl, 8, 128, max_bytes=512 * 8 * 128 * 4) is not None
    assert pa.plan_prefix_dequant(sl, 8, 128, max_bytes=512 * 8 * 128 * 4 - 1) is None


@pytest.mark.parametrize("ps,mode", [(1, "bits"), (16, "f16pairs")])
def test_fp8_extend_prefix_dequant(ps, mode):
    """An fp8 extend through the bf16 workspace (the default) matches the float64 reference, as
    the in-kernel conversion ("off") does; the kernel reads the keys through the plan."""
    hq, hkv, d = 8, 2, 128
    lens, new = [40, 9, 90, 33], [40, 1, 24, 9]  # pure prefill, one token, extends
    kc, vc, ks, vs, table, sl = paged_kv(lens, hkv, d, ps, FP8, DEV, seed=ps + 31)
    q, qo = queries(sum(new), hq, d, DEV, seed=32), indptr(new, DEV)
    k_new, v_new = _new_kv(sum(new), hkv, d, ps + 33)
    _poison_new_rows(kc, vc, ks, vs, table, sl, new, ps)
    ref = pa.reference_extend(q, kc, vc, table, sl, qo, ps, d**-0.5, ks, vs, k_new=k_new,
                              v_new=v_new)  # fmt: skip
    kw = dict(k_scale=ks, v_scale=vs, kv_mode=mode, k_new=k_new, v_new=v_new)
    for how in ("auto", "off"):
        out = pa.extend_fwd(q, kc, vc, table, sl, qo, ps, d**-0.5, out=_out(q),
                            prefix_dequant=how, **kw)  # fmt: skip
        assert_close_rel(out, ref, TOL)
    # a plan from the host's lengths, as the backend passes it
    plan = pa.plan_prefix_dequant(sl, hkv, d, seq_lens_cpu=lens)
    out = pa.extend_fwd(q, kc, vc, table, sl, qo, ps, d**-0.5, out=_out(q), prefix_plan=plan,
                        **kw)  # fmt: skip
    assert_close_rel(out, ref, TOL)
    # rows from the workspace, through the plan's table: a table pointing elsewhere shows
    shifted = (plan.table + 1) % (plan.tokens // pa.extend.WORKSPACE_PAGE)
    wrong = pa.PrefixDequant(shifted, plan.offsets, plan.tokens, plan.max_seq_len)
    out = pa.extend_fwd(q, kc, vc, table, sl, qo, ps, d**-0.5, out=_out(q), prefix_plan=wrong,
                        **kw)  # fmt: skip
    assert not rel_err(out, ref) <= 10 * TOL  # far off, or NaN from the unwritten page tails
    with pytest.raises(ValueError, match="prefix_dequant"):
        pa.extend_fwd(q, kc, vc, table, sl, qo, ps, d**-0.5, prefix_dequant="on", **kw)


@pytest.mark.parametrize("op", ["decode", "extend"])
def test_fp8_kv_modes(op):
    """Every way fp8 K/V meet q in the dots is held to the reference. The integer bit moves
    ("bits", the default) give what the bf16 cast gives: the same bf16 values times 2^-120,
    the powers of two put back through the scales (on CPU all but a few outputs bit-equal; on a
    GPU the tensor cores may flush e4m3's subnormals, which stay subnormal as bf16 bits)."""
    ps, hq, hkv, d = 16, 8, 2, 128
    lens = [63, 9, 90]
    kc, vc, ks, vs, table, sl = paged_kv(lens, hkv, d, ps, FP8, DEV, seed=3)
    if op == "decode":
        q = queries(len(lens), hq, d, DEV, seed=4)
        ref = pa.reference_decode(q, kc, vc, table, sl, ps, d**-0.5, ks, vs)

        def run(mode):
            return pa.decode_fwd(q, kc, vc, table, sl, ps, d**-0.5, out=_out(q), k_scale=ks,
                                 v_scale=vs, num_splits=3, kv_mode=mode)  # fmt: skip
    else:
        new = [63, 1, 40]
        q, qo = queries(sum(new), hq, d, DEV, seed=4), indptr(new, DEV)
        ref = pa.reference_extend(q, kc, vc, table, sl, qo, ps, d**-0.5, ks, vs)

        def run(mode):
            return pa.extend_fwd(q, kc, vc, table, sl, qo, ps, d**-0.5, out=_out(q), k_scale=ks,
                                 v_scale=vs, kv_mode=mode)  # fmt: skip

    outs = {mode: run(mode) for mode in ("bf16", "f16", "bits", "pairs", "f16pairs")}
    for out in outs.values():
        assert_close_rel(out, ref, TOL)
    # the same numbers up to the output's last bit
    torch.testing.assert_close(outs["bits"], outs["bf16"], rtol=2**-7, atol=1e-5)
    if DEV == "cpu":
        assert (outs["bits"] == outs["bf16"]).float().mean() > 0.999
    # the pairs modes: the same values as bits (fp16's for f16pairs) through other dots
    torch.testing.assert_close(outs["pairs"], outs["bits"], rtol=2**-7, atol=1e-5)
    torch.testing.assert_close(outs["f16pairs"], outs["f16"], rtol=2**-7, atol=1e-5)
    assert torch.equal(run(None), outs["bits"]), "bits is the default"


def test_fp8_kv_mode_follows_q_dtype():
    """ "bits" meets a bf16 q; an fp16 q keeps its precision (K/V cast to fp16), checked against
    the reference; an unknown mode is refused by name."""
    kv_mode_id, modes = pa.common.kv_mode_id, pa.common.KV_MODES
    bf16 = torch.zeros(1, dtype=torch.bfloat16)
    assert kv_mode_id(None, bf16) == modes["bits"]
    assert kv_mode_id(None, bf16.half()) == modes["bf16"]
    assert kv_mode_id("f16", bf16) == modes["f16"]
    with pytest.raises(ValueError, match="kv_mode 'int4'"):
        kv_mode_id("int4", bf16)
    for mode in ("bits", "pairs"):
        with pytest.raises(ValueError, match=f"'{mode}' needs a bf16 q"):
            kv_mode_id(mode, bf16.half())
    lens = [63, 1, 130]
    kc, vc, ks, vs, table, sl = paged_kv(lens, 2, 64, 16, FP8, DEV, seed=5)
    q = queries(len(lens), 8, 64, DEV).half()
    out = pa.decode_fwd(q, kc, vc, table, sl, 16, 0.125, out=_out(q), k_scale=ks, v_scale=vs)
    assert_close_rel(out, pa.reference_decode(q, kc, vc, table, sl, 16, 0.125, ks, vs), TOL)


@pytest.mark.parametrize("splits", [1, 3], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("num_draft", [1, 4], ids=lambda n: f"draft{n}")
@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=_id)
def test_verify(case, num_draft, splits):
    """Unsplit and split 3 ways: every row of the poisoned output is written."""
    ps, hq, hkv, d, dt = case
    lens = [70, 4, 33]
    kc, vc, ks, vs, table, sl = paged_kv(lens, hkv, d, ps, dt, DEV, seed=num_draft)
    q = queries(len(lens) * num_draft, hq, d, DEV)
    out = pa.verify_fwd(
        q,
        kc,
        vc,
        table,
        sl,
        ps,
        d**-0.5,
        num_draft,
        out=_out(q),
        k_scale=ks,
        v_scale=vs,
        num_splits=splits,
    )
    ref = pa.reference_verify(q, kc, vc, table, sl, ps, d**-0.5, ks, vs)
    assert_close_rel(out, ref, TOL)


@pytest.mark.parametrize(
    "case,kv_mode",
    [(CASES[1], None), (CASES[1], "f16pairs"), (CASES[2], None), ((1, 8, 2, 128, FP8), "f16pairs")],
    ids=lambda v: _id(v) if isinstance(v, tuple) else str(v),
)
def test_verify_non_causal(case, kv_mode):
    """causal=False: every draft row sees all of its sequence's keys, its own block included
    (each row is then a decode over the whole sequence)."""
    ps, hq, hkv, d, dt = case
    lens, num_draft = [70, 4, 33], 4
    kc, vc, ks, vs, table, sl = paged_kv(lens, hkv, d, ps, dt, DEV, seed=11)
    q = queries(len(lens) * num_draft, hq, d, DEV, seed=12)
    out = pa.verify_fwd(q, kc, vc, table, sl, ps, d**-0.5, num_draft, out=_out(q), k_scale=ks,
                        v_scale=vs, num_splits=3, causal=False, kv_mode=kv_mode)  # fmt: skip
    rows = torch.arange(len(lens), device=DEV).repeat_interleave(num_draft)
    ref = pa.reference_decode(q, kc, vc, table[rows].contiguous(), sl[rows].contiguous(), ps,
                              d**-0.5, ks, vs)  # fmt: skip
    assert_close_rel(out, ref, TOL)
    causal = pa.reference_verify(q, kc, vc, table, sl, ps, d**-0.5, ks, vs)
    assert rel_err(causal, ref) > TOL  # the two masks differ on these inputs


def test_verify_matches_extend_with_uniform_lengths():
    kc, vc, ks, vs, table, sl = paged_kv([40, 25], 2, 64, 16, torch.bfloat16, DEV)
    q = queries(6, 8, 64, DEV)
    a = pa.verify_fwd(q, kc, vc, table, sl, 16, 0.125, 3, out=_out(q))
    b = pa.extend_fwd(q, kc, vc, table, sl, indptr([3, 3], DEV), 16, 0.125, out=_out(q))
    assert_close_rel(a, b.double(), TOL)


def _shift_pages(t, page_size):
    """``t`` ([slots, ...]) behind one extra page: page 0 then belongs to no sequence."""
    pad = torch.zeros((page_size, *t.shape[1:]), dtype=t.dtype, device=t.device)
    return torch.cat([pad, t])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("op", ["decode", "verify", "extend", "verify-pairs", "extend-f16pairs"])
def test_nonfinite_scale_in_unused_page_0(op, bad):
    """Keys past a sequence's end map to page 0; its scales are read by no sequence, so a NaN
    or inf there must not reach any output."""
    ps, hq, hkv, d = 16, 8, 2, 64
    lens = [37, 5, 70]
    kc, vc, ks, vs, table, sl = paged_kv(lens, hkv, d, ps, FP8, DEV, seed=11)
    op, _, mode = op.partition("-")
    qrows = {"decode": 1, "verify": 3, "extend": 4}[op]
    q = queries(len(lens) * qrows, hq, d, DEV, seed=12)
    args = (table, sl, ps, d**-0.5)
    qo = indptr([qrows] * len(lens), DEV)
    refs = {
        "decode": lambda: pa.reference_decode(q, kc, vc, *args, ks, vs),
        "verify": lambda: pa.reference_verify(q, kc, vc, *args, ks, vs),
        "extend": lambda: pa.reference_extend(q, kc, vc, table, sl, qo, ps, d**-0.5, ks, vs),
    }
    ref = refs[op]()
    kc2, vc2, ks2, vs2 = (_shift_pages(t, ps) for t in (kc, vc, ks, vs))
    ks2[:ps], vs2[:ps] = bad, bad
    t2 = table + 1
    kw = dict(out=_out(q), k_scale=ks2, v_scale=vs2)
    if mode:
        kw["kv_mode"] = mode
    if op == "decode":
        out = pa.decode_fwd(q, kc2, vc2, t2, sl, ps, d**-0.5, num_splits=3, **kw)
    elif op == "verify":
        out = pa.verify_fwd(q, kc2, vc2, t2, sl, ps, d**-0.5, qrows, num_splits=3, **kw)
    else:
        out = pa.extend_fwd(q, kc2, vc2, t2, sl, qo, ps, d**-0.5, **kw)
    assert torch.isfinite(out).all(), "a scale no sequence reads reached the output"
    assert_close_rel(out, ref, TOL)


@pytest.mark.parametrize("mode", ["bits", "bf16", "f16", "pairs", "f16pairs"])
def test_fp8_large_v_scale(mode):
    """|V| near 1e9 (v_scale ~2^21): each mode keeps its dot operands in range (the bits mode
    scaled p * v_scale by 2^112, past fp32's largest value once v_scale >= 2^16)."""
    ps, hq, hkv, d = 16, 8, 2, 64
    lens = [63, 9, 90]
    kc, vc, ks, vs, table, sl = paged_kv(lens, hkv, d, ps, FP8, DEV, seed=13)
    vs = vs * 1e9
    assert vs.min() > 2.0**16
    q = queries(len(lens), hq, d, DEV, seed=14)
    out = pa.decode_fwd(q, kc, vc, table, sl, ps, d**-0.5, out=_out(q), k_scale=ks, v_scale=vs,
                        num_splits=3, kv_mode=mode)  # fmt: skip
    assert_close_rel(out, pa.reference_decode(q, kc, vc, table, sl, ps, d**-0.5, ks, vs), TOL)


@pytest.mark.parametrize(
    "head_dim,page_size,kv_dtype,bad",
    [
        (96, 16, torch.bfloat16, "head_dim 96"),
        (128, 3, torch.bfloat16, "page size 3"),
        (128, 16, torch.float32, "torch.float32"),
    ],
    ids=["head_dim96", "page3", "kv-fp32"],
)
def test_unsupported_values_raise(head_dim, page_size, kv_dtype, bad):
    assert pa.unsupported_reason(head_dim, page_size, kv_dtype) is not None
    with pytest.raises(ValueError, match=bad):
        pa.check_supported(head_dim, page_size, kv_dtype)
    cache = torch.zeros(page_size * 2, 1, head_dim, dtype=kv_dtype, device=DEV)
    q = torch.zeros(1, 1, head_dim, dtype=torch.bfloat16, device=DEV)
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match=bad):
        pa.decode_fwd(
            q, cache, cache, table, torch.ones(1, dtype=torch.int32, device=DEV), page_size, 1.0
        )


def test_fp8_per_token_attention_beats_per_tensor_scale():
    """Decode over K/V with outlier channels: per-token scales track the bf16 result, one 1.0 scale
    (clipping at 448) does not."""
    hkv, d, ps, lens = 2, 64, 16, [48, 30]
    kc, vc, _, _, table, sl = paged_kv(lens, hkv, d, ps, torch.bfloat16, DEV, seed=7)
    kc, vc = kc.float(), vc.float()
    for c in (kc, vc):
        c[..., [3, 11]] *= 200  # outlier channels up to ~800
    kc, vc = kc.bfloat16(), vc.bfloat16()
    q = queries(2, 8, d, DEV) * 0.05
    exact = pa.reference_decode(q, kc, vc, table, sl, ps, d**-0.5)
    (k8, ks), (v8, vs) = (_quantize(c) for c in (kc, vc))
    per_token = pa.decode_fwd(q, k8, v8, table, sl, ps, d**-0.5, k_scale=ks, v_scale=vs)
    ones = torch.ones_like(ks)
    k1, v1 = (c.float().clamp(-448, 448).to(FP8) for c in (kc, vc))
    per_tensor = pa.decode_fwd(q, k1, v1, table, sl, ps, d**-0.5, k_scale=ones, v_scale=ones)
    from helpers import rel_err

    e_token, e_tensor = rel_err(per_token, exact), rel_err(per_tensor, exact)
    assert e_token < 0.05 and e_tensor > 3 * e_token, (e_token, e_tensor)


def _quantize(c):
    from sgl_atom.kernels import kv_quant as kvq

    c8 = torch.empty(c.shape, dtype=FP8, device=DEV)
    s = torch.empty(c.shape[:2], device=DEV)
    kvq.store_kv(
        c, c, c8, torch.empty_like(c8), torch.arange(c.shape[0], device=DEV), s, torch.empty_like(s)
    )
    return c8, s
