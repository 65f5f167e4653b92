"""sparse_attention: index write, block scores, top-k selection and sparse attention against the
float64 torch references, on fresh random inputs with NaN-poisoned outputs."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from helpers import assert_close_rel, device, poisoned
from sgl_atom.kernels import sparse_attention as sa

FP8 = torch.float8_e4m3fn


@dataclass
class Case:
    """Sequences in a paged pool: caches, page table, queries (decode when qo_indptr is None)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    ks: torch.Tensor | None
    vs: torch.Tensor | None
    iq: torch.Tensor
    ik: torch.Tensor
    iks: torch.Tensor | None
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    qo_indptr: torch.Tensor | None
    indptr: torch.Tensor  # qo_indptr, or arange for decode (references take it always)
    page_size: int
    max_qo_len: int


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (x.abs().amax(-1) / 448.0).clamp_min(1e-12)
    return (x / scale[..., None]).to(FP8), scale.float()


def pack_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index rows [slots, dim] as packed 4-bit keys and their scales (the reference writer)."""
    slots, dim = x.shape
    cache, scale = torch.empty(slots, dim // 2, dtype=torch.uint8), torch.empty(slots)
    sa.reference_index_write(x, cache, torch.arange(slots), scale)
    return cache, scale


def make_case(
    seq_lens,
    qo_lens,
    page_size,
    kv_heads=2,
    group=4,
    head_dim=32,
    index_dim=32,
    dtype=torch.float32,
    kv_fp8=False,
    index_fp8=False,
    index_int4=False,
    decode=False,
    seed=0,
    dev=None,
) -> Case:
    dev = dev or device()
    gen = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per) + 3
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(seq_lens), max(pages_per), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = perm[start : start + n].to(torch.int32)
        start += n
    slots = num_pages * page_size
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    k, v, ik = rnd(slots, kv_heads, head_dim), rnd(slots, kv_heads, head_dim), rnd(slots, index_dim)
    ks = vs = iks = None
    if kv_fp8:
        (k, ks), (v, vs) = quantize(k), quantize(v)
    else:
        k, v = k.to(dtype), v.to(dtype)
    if index_fp8:
        ik, iks = quantize(ik)
    elif index_int4:
        ik, iks = pack_int4(ik)
    else:
        ik = ik.to(dtype)
    total_q = sum(qo_lens)
    indptr = torch.tensor([0] + qo_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    to = lambda t: None if t is None else t.to(dev)  # noqa: E731
    return Case(
        to(rnd(total_q, kv_heads * group, head_dim).to(dtype)),
        to(k),
        to(v),
        to(ks),
        to(vs),
        to(rnd(total_q, kv_heads, index_dim).to(dtype)),
        to(ik),
        to(iks),
        to(table),
        to(torch.tensor(seq_lens, dtype=torch.int32)),
        None if decode else to(indptr),
        to(indptr),
        page_size,
        max(qo_lens),
    )


def decode_case(seq_lens, page_size, **kw) -> Case:
    return make_case(seq_lens, [1] * len(seq_lens), page_size, decode=True, **kw)


def run_select(c: Case, topk, init, local, scale=0.125):
    return sa.select_blocks(
        c.iq,
        c.ik,
        c.page_table,
        c.seq_lens,
        c.page_size,
        scale,
        topk,
        init,
        local,
        qo_indptr=c.qo_indptr,
        max_qo_len=c.max_qo_len,
        index_scale=c.iks,
    )


def ref_select(c: Case, topk, init, local, scale=0.125):
    scores = sa.reference_block_scores(
        c.iq, c.ik, c.page_table, c.seq_lens, c.indptr, c.page_size, scale, c.iks
    )
    return sa.reference_select_blocks(scores, c.seq_lens, c.indptr, topk, init, local)


def visible_mask(c: Case, max_blocks: int) -> torch.Tensor:
    """[total_q, 1, max_blocks]: blocks each token can see."""
    pos = torch.cat(
        [
            n - (hi - lo) + torch.arange(hi - lo)
            for n, lo, hi in zip(
                c.seq_lens.tolist(), c.indptr[:-1].tolist(), c.indptr[1:].tolist(), strict=True
            )
        ]
    )
    return (torch.arange(max_blocks)[None, :] <= (pos // 128)[:, None])[:, None, :]


# ---- index write -------------------------------------------------------------------------------


def test_index_write_int4():
    """Packed 4-bit keys: the kernel's bytes and scales equal the reference writer's, each key
    dequantizes to within half a step of its value (a float64 check independent of both), and
    slots outside loc stay untouched."""
    dev, gen = device(), torch.Generator().manual_seed(2)
    tokens, index_dim, slots = 37, 24, 90
    x = torch.randn(tokens, index_dim, generator=gen)
    x[0] = 0.0  # an all-zero row: scale floored, every nibble 8
    x[1, :3] = torch.tensor([7.0, -3.5, 0.5])  # exact half steps of scale 1 round up
    x[1, 3:] = 0.0
    x = x.to(torch.bfloat16).to(dev)
    loc = torch.randperm(slots, generator=gen)[:tokens].to(dev)
    cache = poisoned((slots, index_dim // 2), torch.uint8, dev)
    scale = poisoned((slots,), torch.float32, dev)
    sa.index_write(x, cache, loc, scale)
    want = poisoned((slots, index_dim // 2), torch.uint8, "cpu")
    want_scale = poisoned((slots,), torch.float32, "cpu")
    sa.reference_index_write(x.cpu(), want, loc.cpu(), want_scale)
    rows = loc.cpu()
    got, got_scale = cache.cpu(), scale.cpu()
    assert torch.equal(got[rows], want[rows]), "4-bit index bytes differ from the reference"
    assert torch.equal(got_scale[rows], want_scale[rows]), "4-bit index scales differ"
    q = sa.unpack_int4(got[rows], torch.float64)
    assert q.abs().max() <= 7
    err = (q * got_scale[rows].double()[:, None] - x.cpu().double()).abs()
    assert (err <= got_scale[rows].double()[:, None] * (0.5 + 1e-6)).all(), "past half a step"
    assert torch.equal(got[rows[0]], torch.full((index_dim // 2,), 0x88, dtype=torch.uint8))
    assert sa.unpack_int4(got[rows[1]])[:3].tolist() == [7.0, -3.0, 1.0]  # floor(x + 0.5)
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[rows] = False
    assert (got[untouched] == 255).all() and torch.isnan(got_scale[untouched]).all()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_index_write(fp8):
    dev, gen = device(), torch.Generator().manual_seed(1)
    tokens, index_dim, slots = 63, 24, 200
    x = torch.randn(tokens, index_dim, generator=gen)
    x[0, :4] = torch.tensor([448.0, 127.2, 31.2, 7.9])  # rounded to 64, 16, 4 by a plain cast
    x = x.to(torch.bfloat16).to(dev)
    loc = torch.randperm(slots, generator=gen)[:tokens].to(dev)
    cache = poisoned((slots, index_dim), FP8 if fp8 else torch.bfloat16, dev)
    scale = poisoned((slots,), torch.float32, dev) if fp8 else None
    sa.index_write(x, cache, loc, scale)
    want = poisoned((slots, index_dim), FP8 if fp8 else torch.bfloat16, "cpu")
    want_scale = poisoned((slots,), torch.float32, "cpu") if fp8 else None
    sa.reference_index_write(x.cpu(), want, loc.cpu(), want_scale)
    if not fp8:
        assert torch.equal(cache.cpu().view(torch.int16), want.view(torch.int16)), (
            "bf16 index rows differ"
        )
        return
    # the same bytes and scales as torch's division and round-to-nearest-even cast
    rows = loc.cpu()
    assert torch.equal(cache.cpu()[rows].view(torch.uint8), want[rows].view(torch.uint8)), (
        "fp8 index bytes differ from the reference"
    )
    assert torch.equal(scale.cpu()[rows], want_scale[rows]), "fp8 index scales differ"
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[loc.cpu()] = False
    assert torch.isnan(scale.cpu()[untouched]).all(), "index_write touched slots outside loc"


# ---- block scores and selection -----------------------------------------------------------------

SEQS = [1, 129, 256, 517, 700]
MODES = ["decode", "extend", "verify"]


def mode_case(mode, page_size, **kw) -> Case:
    if mode == "decode":
        return decode_case(SEQS, page_size, **kw)
    if mode == "verify":
        return make_case([s + 3 for s in SEQS], [4] * len(SEQS), page_size, **kw)
    return make_case([12, 300, 390], [12, 5, 20], page_size, **kw)


def check_block_scores(c, **tuning) -> None:
    """Kernel block scores (outputs poisoned first) equal the reference on every visible
    block; ``tuning`` goes to the launcher."""
    max_blocks = -(-int(c.seq_lens.max()) // 128)
    scores = poisoned((c.iq.shape[0], c.iq.shape[1], max_blocks), torch.float32, c.iq.device)
    sa.block_scores(
        c.iq,
        c.ik,
        c.page_table,
        c.seq_lens,
        c.page_size,
        0.3,
        c.qo_indptr,
        c.max_qo_len,
        int(c.seq_lens.max()),
        c.iks,
        scores,
        **tuning,
    )
    ref = sa.reference_block_scores(
        c.iq, c.ik, c.page_table, c.seq_lens, c.indptr, c.page_size, 0.3, c.iks
    )
    vis = visible_mask(c, max_blocks).expand_as(ref)
    assert torch.isfinite(ref[vis]).all()
    assert_close_rel(scores.cpu()[vis], ref[vis], 1e-5, "block scores")


@pytest.mark.parametrize("index", ["fp32", "bf16", "fp8", "int4"])
@pytest.mark.parametrize("page_size", [1, 16, 64, 128], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("mode", MODES)
def test_block_scores_match_reference(mode, page_size, index):
    dtype = torch.bfloat16 if index in ("bf16", "int4") else torch.float32
    kw = dict(index_fp8=index == "fp8", index_int4=index == "int4")
    check_block_scores(mode_case(mode, page_size, dtype=dtype, seed=page_size, **kw))


@pytest.mark.parametrize("index", ["fp8", "int4"])
@pytest.mark.parametrize("magnitude", [1e-7, 1.0, 1e7], ids=lambda m: f"q{m:g}")
@pytest.mark.parametrize("mode", ["decode", "verify"])
def test_block_scores_scaled_cache_bf16_q_any_magnitude(mode, magnitude, index):
    """An fp8 or 4-bit cache with bf16 q scores through fp16 dots on a GPU, q scaled per row by a
    power of two: exact also for q far outside fp16's range (1e7 would overflow it, 1e-7 would be
    subnormal)."""
    kw = dict(index_fp8=index == "fp8", index_int4=index == "int4")
    c = mode_case(mode, 64, dtype=torch.bfloat16, seed=11, **kw)
    c.iq.mul_(magnitude)
    c.iq[0, 0, :4] = 0.0  # zeros inside a row, and one all-zero row below
    c.iq[-1, -1] = 0.0
    check_block_scores(c, blocks_per_program=2)


@pytest.mark.parametrize("nb", [1, 3, 8], ids=lambda n: f"nb{n}")
def test_block_scores_blocks_per_program(nb):
    c = mode_case("verify", 16, index_fp8=nb == 3, index_int4=nb == 8, seed=nb)
    scores = sa.block_scores(
        c.iq,
        c.ik,
        c.page_table,
        c.seq_lens,
        16,
        0.3,
        c.qo_indptr,
        c.max_qo_len,
        index_scale=c.iks,
        blocks_per_program=nb,
    )
    ref = sa.reference_block_scores(c.iq, c.ik, c.page_table, c.seq_lens, c.indptr, 16, 0.3, c.iks)
    vis = visible_mask(c, ref.shape[2]).expand_as(ref)
    assert_close_rel(scores.cpu()[..., : ref.shape[2]][vis], ref[vis], 1e-5, "block scores")


@pytest.mark.parametrize(
    "topk,init,local", [(3, 1, 1), (4, 0, 2), (2, 0, 0)], ids=["k3i1l1", "k4i0l2", "k2i0l0"]
)
@pytest.mark.parametrize("mode", MODES)
def test_selection_matches_reference(mode, topk, init, local):
    c = mode_case(mode, 16, index_fp8=mode == "verify", seed=topk)
    sel, cnt = run_select(c, topk, init, local)
    ref_sel, ref_cnt = ref_select(c, topk, init, local)
    assert torch.equal(cnt.cpu(), ref_cnt), "selected block counts differ"
    assert torch.equal(sel.cpu(), ref_sel), "selected blocks differ"


def test_tie_break_lower_block_wins_and_is_deterministic():
    c = decode_case([1280, 1100], 16, seed=5)
    c.ik.copy_(c.ik[:1].expand_as(c.ik))  # every position scores the same: all blocks tie
    first = run_select(c, 5, 1, 1)
    for _ in range(2):
        again = run_select(c, 5, 1, 1)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    want = torch.tensor([[0, 1, 2, 3, 9], [0, 1, 2, 3, 8]], dtype=torch.int32)
    assert torch.equal(first[0].cpu(), want[:, None, :].expand(-1, 2, -1)), first[0]
    assert torch.equal(ref_select(c, 5, 1, 1)[0], first[0].cpu())


def test_fewer_visible_blocks_than_topk():
    c = make_case([300, 100], [5, 2], 16, seed=6)
    sel, cnt = run_select(c, 6, 1, 1)
    want_cnt = torch.tensor([3] * 5 + [1] * 2, dtype=torch.int32)[:, None].expand(-1, 2)
    assert torch.equal(cnt.cpu(), want_cnt)
    assert torch.equal(sel.cpu()[0, 0], torch.tensor([0, 1, 2, -1, -1, -1], dtype=torch.int32))
    assert torch.equal(sel.cpu()[-1, 1], torch.tensor([0, -1, -1, -1, -1, -1], dtype=torch.int32))


def test_init_plus_local_above_topk_is_refused():
    c = decode_case([300], 16)
    with pytest.raises(ValueError, match="sparse_init_block 2 \\+ sparse_local_block 2"):
        run_select(c, 3, 2, 2)


# ---- sparse attention ---------------------------------------------------------------------------


def run_attention(c: Case, sel, cnt, num_splits=None, sm_scale=0.2, kv_mode=None):
    out = poisoned(c.q.shape, c.q.dtype, c.q.device)
    return sa.sparse_attention_fwd(
        c.q,
        c.k,
        c.v,
        c.page_table,
        c.seq_lens,
        sel,
        cnt,
        c.page_size,
        sm_scale,
        qo_indptr=c.qo_indptr,
        max_qo_len=c.max_qo_len,
        out=out,
        k_scale=c.ks,
        v_scale=c.vs,
        num_splits=num_splits,
        kv_mode=kv_mode,
    )


KV = [
    ("fp32", torch.float32, False, 1e-5),
    ("bf16", torch.bfloat16, False, 1.5e-2),
    ("fp8", torch.bfloat16, True, 1.5e-2),
]


@pytest.mark.parametrize("kv", KV, ids=[k[0] for k in KV])
@pytest.mark.parametrize("group", [1, 4, 8], ids=lambda g: f"gqa{g}")
@pytest.mark.parametrize("mode", MODES)
def test_sparse_attention_matches_reference(mode, group, kv):
    _, dtype, fp8, tol = kv
    c = mode_case(mode, 64 if group == 4 else 1, dtype=dtype, kv_fp8=fp8, group=group, seed=group)
    sel, cnt = run_select(c, 3, 1, 1)
    ref = sa.reference_sparse_attention(
        c.q, c.k, c.v, c.page_table, c.seq_lens, c.indptr, sel, c.page_size, 0.2, c.ks, c.vs
    )
    splits = 2 if group == 4 else None  # the split + merge path, and the default choice
    assert_close_rel(
        run_attention(c, sel, cnt, splits), ref, tol, f"sparse attention splits={splits}"
    )


@pytest.mark.parametrize("mode", MODES)
def test_sparse_attention_fp8_bits_equals_cast(mode):
    """fp8 K/V moved into bf16 bits (the default with a bf16 q) give the bf16 cast's numbers,
    up to the output's last bit."""
    c = mode_case(mode, 64, dtype=torch.bfloat16, kv_fp8=True, group=4, seed=9)
    sel, cnt = run_select(c, 3, 1, 1)
    bits = run_attention(c, sel, cnt, 2)
    cast = run_attention(c, sel, cnt, 2, kv_mode="bf16")
    torch.testing.assert_close(bits, cast, rtol=2**-7, atol=1e-5)
    assert not torch.equal(bits, run_attention(c, sel, cnt, 2, sm_scale=0.3)), "inputs matter"
    with pytest.raises(ValueError, match="takes kv_mode 'bits' or 'bf16', got 'f16'"):
        run_attention(c, sel, cnt, 2, kv_mode="f16")


@pytest.mark.parametrize("page_size", [1, 16, 128], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("mode", MODES)
def test_topk_covering_all_blocks_equals_dense(mode, page_size):
    c = mode_case(mode, page_size, seed=11 + page_size)
    sel, cnt = run_select(c, 6, 1, 1)  # 700 tokens = 6 blocks
    dense = sa.reference_dense_attention(
        c.q, c.k, c.v, c.page_table, c.seq_lens, c.indptr, c.page_size, 0.2
    )
    assert_close_rel(run_attention(c, sel, cnt), dense, 1e-5, "sparse with all blocks vs dense")


# ---- index-selection reuse ----------------------------------------------------------------------


def test_should_score_pattern():
    assert [sa.should_score(o, 4) for o in range(9)] == [
        True,
        False,
        False,
        False,
        True,
        False,
        False,
        False,
        True,
    ]
    assert all(sa.should_score(o, 1) for o in range(5))
    assert [sa.should_score(o, 2, offset=1) for o in range(5)] == [True, True, False, True, False]


def test_reuse_without_a_scored_layer_is_an_error():
    holder = sa.TopkHolder()
    sel, cnt = torch.zeros(3, 2, 4, dtype=torch.int32), torch.ones(3, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="no earlier sparse layer scored"):
        holder.select(1, 4, 3, lambda: (sel, cnt))
    assert holder.select(0, 4, 3, lambda: (sel, cnt))[0] is sel
    assert holder.select(1, 4, 3, lambda: pytest.fail("layer 1 must reuse"))[0] is sel
    with pytest.raises(RuntimeError, match="has 3 token rows, but this forward has 5"):
        holder.reuse(2, 5)
    holder.clear()
    with pytest.raises(RuntimeError, match="no earlier sparse layer scored"):
        holder.reuse(2, 3)


# ---- visible vs attended block counters ------------------------------------------------------


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("batch", [3, 1100])
def test_block_counts_add_one_layer_step(decode, batch):
    """The one-launch counters against every new token's position enumerated in Python, added to
    counters that already hold figures (batch 1100 and its counts run past one 1024 chunk)."""
    g = torch.Generator().manual_seed(batch * 2 + decode)
    heads = 3
    lens = torch.randint(1, 900, (batch,), generator=g)
    per_seq = (
        torch.ones(batch, dtype=torch.int64)
        if decode
        else torch.randint(0, 6, (batch,), generator=g)
    )
    per_seq = torch.minimum(per_seq, lens)
    tokens = int(per_seq.sum())
    count = torch.randint(0, 17, (tokens, heads), generator=g, dtype=torch.int32)
    qo = None if decode else torch.cat([torch.zeros(1, dtype=torch.int64), per_seq.cumsum(0)])
    visible = sum(
        (p // sa.SPARSE_BLOCK + 1) * heads
        for n, q in zip(lens.tolist(), per_seq.tolist(), strict=True)
        for p in range(n - q, n)
    )
    start = torch.randint(0, 10**9, (3,), generator=g)
    want = start + torch.tensor([1, visible, int(count.sum())])
    for fn in (sa.block_counts, sa.reference_block_counts):
        counters = start.clone().to(device())
        fn(
            lens.to(torch.int32).to(device()),
            count.to(device()),
            counters,
            None if qo is None else qo.to(torch.int32).to(device()),
        )
        assert counters.cpu().tolist() == want.tolist(), fn.__name__


def test_int4_query_rounds_each_row_to_8_bit_on_a_power_of_two_step():
    """The q rounding the 4-bit scoring uses: integers in [-128, 127] on a power-of-two step,
    the row's largest magnitude at 64-127 steps, half a step at most from q (the largest element
    may be clamped to 127 steps), zero rows staying zero."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    q = torch.randn(6, 3, 40, generator=gen, dtype=torch.float64)
    q = q * torch.logspace(-30, 30, 6, dtype=torch.float64)[:, None, None]
    q[0, 0] = 0.0
    got = sa.int4_query(q)
    amax = q.abs().amax(-1, keepdim=True)
    step = torch.pow(2.0, torch.floor(torch.log2(amax.clamp_min(1e-300))) - 6)
    ints = got / step
    assert torch.equal(ints, ints.round()) and ints.max() <= 127 and ints.min() >= -128
    assert ((got.abs().amax(-1, keepdim=True) / step)[1:] >= 64).all()
    step = step.expand_as(q)
    err, clamped = (got - q).abs(), q / step >= 127.5
    assert (err[~clamped] <= step[~clamped] / 2).all() and (err[clamped] <= step[clamped]).all()
    assert got[0, 0].eq(0).all()


@pytest.mark.parametrize("scale", [0.0, -0.3])
def test_block_scores_refuse_a_scale_that_is_not_positive(scale):
    """The kernel scales each row's block maximum, not each score: a non-positive scale would
    turn the maximum into the minimum, so it is refused before any launch."""
    c = mode_case("decode", 16, seed=2)
    with pytest.raises(ValueError, match="scale must be positive"):
        sa.block_scores(c.iq, c.ik, c.page_table, c.seq_lens, 16, scale)
