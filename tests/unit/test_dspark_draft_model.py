"""The serving-side DSpark draft: the batched model class (context K/V, one paged-attention
pass for a whole batch of blocks) against the float64 one-sequence reference, and the draft's
own KV pool at bf16 and fp8 with its scratch rows."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

from sgl_atom.models.dspark_draft import AtomDSparkDraftModel
from sgl_atom.speculative.dspark import reference as ref
from sgl_atom.speculative.dspark.markov import markov_refine
from sgl_atom.speculative.dspark.pool import DraftKVPool, block_page_table
from sgl_atom.speculative.dspark.weights import draft_weight_shapes, init_draft_weights
from sgl_atom.testing import DSPARK_CHAIN

sys.path.insert(0, str(Path(__file__).parent / "kernels"))  # the kernel tests' helpers
from helpers import assert_close_rel, poison_  # noqa: E402


def build(dtype: torch.dtype, **config) -> AtomDSparkDraftModel:
    """An unloaded draft of the chain config (``config`` overriding its fields), its
    parameters built at ``dtype`` as the worker's loader builds them at the target's."""
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    raw = json.loads((DSPARK_CHAIN / "config.json").read_text())
    with set_default_torch_dtype(dtype):
        return AtomDSparkDraftModel({**raw, **config})


def chain_draft() -> AtomDSparkDraftModel:
    """The chain draft's config with random float64 weights, placed on the CPU at float64 (the
    oracle's)."""
    m = build(torch.float64)
    w = init_draft_weights(m.dspark, seed=3, init_range=0.05, dtype=torch.float64)
    m.load_weights(w.items())
    return m.place("cpu", torch.float64)


@pytest.fixture(scope="module")
def model():
    return chain_draft()


def placed(model, dtype: torch.dtype, device: str = "cpu", **config) -> AtomDSparkDraftModel:
    """A fresh draft of the chain config (``config`` overriding its fields) with ``model``'s
    weights, placed on ``device`` at ``dtype``."""
    m = build(dtype, **config)
    m.load_weights(model.checkpoint_weights().items())
    return m.place(device, dtype)


def test_load_refuses_missing_and_unexpected_tensors_writing_nothing(model):
    w = model.checkpoint_weights()
    w.pop("norm.weight")
    w["extra.weight"] = torch.zeros(1)
    fresh = build(torch.float64)
    for p in fresh.parameters():
        p.data.fill_(7.0)
    match = r"missing \['norm.weight'\].*unexpected \['extra.weight'\]"
    with pytest.raises(ValueError, match=match):
        fresh.load_weights(w.items())
    assert all(bool((p == 7.0).all()) for p in fresh.parameters())  # nothing half-loaded


class Case:
    """Fresh random inputs for one batched draft pass: ragged contexts scattered over a pool
    whose other rows (and the table columns past each context) point at NaN rows."""

    LENS = (7, 13, 1, 30, 21)  # odd, ragged, one single-token context
    SLOTS = 96

    def __init__(self, model, dtype: str, seed: int, device: str = "cpu") -> None:
        cfg = model.dspark
        self.device = device
        gen = torch.Generator().manual_seed(seed)
        vocab, hidden = cfg.vocab_size, cfg.hidden_size
        self.embed = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64)
        self.head = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 0.2
        width = cfg.num_taps * cfg.tap_hidden_size
        self.taps = [torch.randn(n, width, generator=gen, dtype=torch.float64) for n in self.LENS]
        self.anchors = torch.randint(0, vocab, (len(self.LENS),), generator=gen)
        self.pool = DraftKVPool(
            slots=self.SLOTS,
            layers=cfg.num_hidden_layers,
            kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            dtype=dtype,
            device=device,
            max_batch=len(self.LENS) + 2,
            block_len=cfg.query_len,
            compute_dtype=model.dtype,
        )
        for t in self.pool.k_all + self.pool.v_all:
            poison_(t)
        for t in self.pool.k_scale_all + self.pool.v_scale_all:
            t.fill_(float("nan"))
        perm = torch.randperm(self.SLOTS - 1, generator=gen) + 1  # slot 0 stays NaN
        self.slots, used = [], 0
        for n in self.LENS:
            self.slots.append(perm[used : used + n])
            used += n
        self.context_slots = torch.zeros(len(self.LENS), max(self.LENS), dtype=torch.int32)
        for b, s in enumerate(self.slots):  # columns past n_b: slot 0, a NaN row
            self.context_slots[b, : len(s)] = s

    def write_context(self, model) -> None:
        """One context write for the whole batch, as the worker does after a target forward."""
        taps = torch.cat(self.taps).to(device=self.device, dtype=model.dtype)
        positions = torch.cat([torch.arange(n) for n in self.LENS]).to(self.device)
        slots = torch.cat(self.slots).to(self.device)
        for layer, (k, v) in enumerate(model.context_kv(taps, positions, max(self.LENS))):
            self.pool.write(layer, slots, k, v)

    def pass_args(self, model) -> dict:
        lens = torch.tensor(self.LENS, device=self.device)
        ctx = self.context_slots.to(self.device)
        table = block_page_table(ctx, lens, self.pool.scratch_rows(len(lens)))
        return dict(
            anchors=self.anchors.to(self.device),
            context_lens=lens,
            page_table=table,
            pool=self.pool,
            embed=self.embed.to(device=self.device, dtype=model.dtype),
            lm_head=self.head.to(device=self.device, dtype=model.dtype),
            max_context=max(self.LENS),
        )

    def reference_passes(self, w, cfg) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(draft tokens [k], base logits [k, vocab]) of every block from the float64 oracle."""
        return [
            ref.reference_propose(
                w, cfg, taps=t, anchor=int(a), embed=self.embed, lm_head=self.head
            )
            for t, a in zip(self.taps, self.anchors, strict=True)
        ]

    def reference(self, w, cfg) -> list[torch.Tensor]:
        return [base for _, base in self.reference_passes(w, cfg)]

    def reference_drafts(self, w, cfg) -> list[torch.Tensor]:
        return [tokens for tokens, _ in self.reference_passes(w, cfg)]


# bf16 rounding of activations over two layers; fp8 (3 mantissa bits) K/V rows on top of it
TOL = {"bf16": 1.5e-2, "fp8": 4e-2}  # measured: 7-8e-3 and 1.1-1.9e-2


@pytest.fixture
def served(model):
    """The draft at bf16 (the served dtype), the float64 oracle's weights beside it."""
    return placed(model, torch.bfloat16)


def test_a_draft_sampling_after_the_anchor_drafts_k_rows(model):
    """sample_from_anchor false: k + 1 query rows, the anchor's row attends but gets no logits;
    the k others match the float64 reference."""
    m = placed(model, torch.bfloat16, sample_from_anchor=False)
    assert m.dspark.query_len == m.dspark.block_size + 1
    case = Case(m, "bf16", seed=13)
    case.write_context(m)
    base = m.base_logits(**case.pass_args(m))
    assert base.shape == (len(case.LENS), m.dspark.block_size, m.dspark.vocab_size)
    want = case.reference(model.checkpoint_weights(), m.dspark)
    for b, n in enumerate(case.LENS):
        assert_close_rel(base[b], want[b], TOL["bf16"], what=f"base logits, context {n}")


@pytest.mark.parametrize("kernels", ["triton", "reference"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_batched_propose_matches_the_float64_reference(model, served, dtype, kernels, monkeypatch):
    monkeypatch.setenv("SGL_ATOM_CPU_KERNELS", kernels)
    case = Case(served, dtype, seed=11)
    case.write_context(served)
    base = served.base_logits(**case.pass_args(served))
    want = case.reference(model.checkpoint_weights(), model.dspark)
    for b, n in enumerate(case.LENS):
        assert_close_rel(base[b], want[b], TOL[dtype], what=f"base logits, context {n}")
    tokens = served.propose(**case.pass_args(served))
    w1 = served.markov_head.markov_w1.weight
    w2 = served.markov_head.markov_w2.weight
    assert torch.equal(tokens, markov_refine(base, case.anchors, w1, w2))
    expected = case.reference_drafts(model.checkpoint_weights(), model.dspark)
    assert tokens.tolist() == torch.stack(expected).tolist()  # no near-tie at these seeds


def test_batched_propose_in_float64_equals_the_reference(model, monkeypatch):
    """The same math: at float64 (reference kernels), where SGLang's RMSNorm and RoPE still
    compute in float32, every block's logits match to float32 precision, the drafts exactly."""
    monkeypatch.setenv("SGL_ATOM_CPU_KERNELS", "reference")
    case = Case(model, "auto", seed=5)
    case.write_context(model)
    base = model.base_logits(**case.pass_args(model))
    for b, want in enumerate(case.reference(model.checkpoint_weights(), model.dspark)):
        assert_close_rel(base[b], want, 1e-5, what=f"base logits, context {case.LENS[b]}")
    tokens = model.propose(**case.pass_args(model))
    expected = case.reference_drafts(model.checkpoint_weights(), model.dspark)
    assert tokens.tolist() == torch.stack(expected).tolist()


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_context_kv_matches_the_reference_and_lands_in_its_slots(model, served, dtype):
    case = Case(served, dtype, seed=2)
    case.write_context(served)
    for b, (t, s) in enumerate(zip(case.taps, case.slots, strict=True)):
        want = ref.reference_context_kv(
            model.checkpoint_weights(), model.dspark, t, torch.arange(t.shape[0])
        )
        for layer, (k, v) in enumerate(want):
            rk, rv = case.pool.read(layer, s)
            what = f"layer {layer} context {b}"
            assert_close_rel(rk, k, TOL[dtype], what=f"K {what}")
            assert_close_rel(rv, v, TOL[dtype], what=f"V {what}")
    unused = torch.tensor([0])
    assert torch.isnan(case.pool.read(0, unused)[0].float()).all()


def test_fused_projections_hold_each_checkpoint_tensor_once(served):
    """q/k/v and gate/up load into one SGLang parameter each per layer (its rows in checkpoint
    order): the checkpoint-named tensors are row views of it, and a fresh load of them builds
    the same parameters (what the reference reads is what the fused GEMM multiplies)."""
    named = served.checkpoint_weights()
    assert set(named) == set(draft_weight_shapes(served.dspark))
    for i, layer in enumerate(served.layers):
        a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        for fused, names in (
            (layer.self_attn.qkv_proj.weight, [a + "q_proj.weight", a + "k_proj.weight",
                                               a + "v_proj.weight"]),
            (layer.mlp.gate_up_proj.weight, [m + "gate_proj.weight", m + "up_proj.weight"]),
        ):  # fmt: skip
            row = 0
            for n in names:
                w = named[n]
                assert w.data_ptr() == fused.data_ptr() + row * fused.stride(0) * w.element_size()
                row += w.shape[0]
            assert row == fused.shape[0]
    gen = torch.Generator().manual_seed(8)
    fresh = {n: torch.randn(t.shape, generator=gen).to(t.dtype) for n, t in named.items()}
    again = build(served.dtype)
    again.load_weights(fresh.items())
    for n, t in again.checkpoint_weights().items():
        assert torch.equal(t, fresh[n]), n


def test_rotary_table_covers_what_the_server_asks(served):
    """SGLang's rotary table (its kernel reads past it unchecked) is regrown, doubling, to the
    positions asked; a YaRN table, whose length the scaling fixes, is refused past it."""
    have = served.rotary_emb.cos_sin_cache.shape[0]
    first = served.rotary_emb
    served.cover_positions(have)
    assert served.rotary_emb is first
    served.cover_positions(have + 1)
    longer = served.rotary_emb.cos_sin_cache
    assert longer.shape[0] == 2 * have and longer.dtype == torch.float32
    torch.testing.assert_close(longer[:have], first.cos_sin_cache, rtol=0, atol=0)
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
    m = build(torch.bfloat16, rope_scaling=yarn)
    m.cover_positions(128)
    with pytest.raises(ValueError, match=r"yarn scaling\) covers 128 positions.*needs 129"):
        m.cover_positions(129)


def test_context_kv_rotates_with_the_configs_rope_scaling(model):
    """A llama3-scaled draft's context K is the reference's under the same scaling (to the
    precision of SGLang's float32 RoPE table at positions up to 300) and not the plain draft's:
    the scaling reaches the served rotary embedding."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    scaled = placed(model, torch.float64, rope_scaling=scaling)
    cfg = scaled.dspark
    taps = torch.randn(300, cfg.num_taps * cfg.tap_hidden_size, dtype=torch.float64)
    positions = torch.arange(300)
    got = scaled.context_kv(taps, positions, 299)
    want = ref.reference_context_kv(model.checkpoint_weights(), cfg, taps, positions)
    plain = model.context_kv(taps, positions, 299)
    for (k, v), (wk, wv), (pk, _) in zip(got, want, plain, strict=True):
        assert_close_rel(k, wk, 1e-4, what="scaled K")
        assert_close_rel(v, wv, 1e-5, what="V")
        assert (k - pk).abs().max() > 1e-2


def test_block_page_table_puts_the_block_after_each_context():
    ctx = torch.tensor([[5, 6, 7], [9, 0, 0]], dtype=torch.int32)
    scratch = torch.tensor([[100, 101], [102, 103]], dtype=torch.int32)
    table = block_page_table(ctx, torch.tensor([3, 1]), scratch)
    assert table[0].tolist() == [5, 6, 7, 100, 101]
    assert table[1, :3].tolist() == [9, 102, 103]


def test_scratch_rows_stay_out_of_what_p_d_moves():
    pool = DraftKVPool(
        slots=40,
        layers=2,
        kv_heads=2,
        head_dim=64,
        dtype="fp8",
        device="cpu",
        max_batch=3,
        block_len=4,
    )
    assert pool.k[0].shape[0] == 40 and pool.k_all[0].shape[0] == 52
    assert pool.k_scale[1].shape[0] == 40 and pool.k[0].is_contiguous()
    assert pool.scratch_rows(3).flatten().tolist() == list(range(40, 52))
    with pytest.raises(ValueError, match="scratch rows were allocated for 3"):
        pool.scratch_rows(4)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_pool_round_trip(dtype):
    pool = DraftKVPool(slots=40, layers=2, kv_heads=2, head_dim=64, dtype=dtype, device="cpu")
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(9, 2, 64, generator=gen).to(torch.bfloat16)
    v = torch.randn(9, 2, 64, generator=gen).to(torch.bfloat16) * 3
    loc = torch.tensor([3, 39, 0, 7, 8, 21, 22, 5, 11])
    pool.write(1, loc, k, v)
    rk, rv = pool.read(1, loc)
    if dtype == "bf16":
        assert torch.equal(rk, k) and torch.equal(rv, v)
    else:
        # e4m3 keeps 3 mantissa bits: relative error of a row is at most 2^-4 of its max
        for got, want in ((rk, k), (rv, v)):
            err = (got.float() - want.float()).abs().amax(-1)
            assert torch.all(err <= want.float().abs().amax(-1) / 16)
    untouched = torch.tensor([1, 2, 4])
    assert not pool.read(1, untouched)[0].any() and not pool.read(0, loc)[0].any()
    elements = 2 * 2 * 2 * 64  # K and V, 2 layers, 2 KV heads, head_dim 64
    per_token = elements * 2 if dtype == "bf16" else elements + 2 * 2 * 2 * 4  # + fp32 scales
    assert pool.bytes_per_token == per_token


@pytest.mark.parametrize("kernels", ["triton", "reference"])
def test_bf16_pool_under_an_fp16_draft(model, monkeypatch, kernels):
    """An fp16 target (SGLang's default for a float32 checkpoint) with a bf16 draft pool: the
    block attention runs in the pool's dtype (the kernels take 16-bit K/V in q's dtype only)."""
    from sgl_atom.speculative.dspark.pool import check_block_attention

    monkeypatch.setenv("SGL_ATOM_CPU_KERNELS", kernels)
    m = placed(model, torch.float16)
    case = Case(m, "bf16", seed=13)
    assert case.pool.k_all[0].dtype == torch.bfloat16 and case.pool.compute_dtype == torch.float16
    check_block_attention(m.dspark, case.pool)  # no refusal
    case.write_context(m)
    base = m.base_logits(**case.pass_args(m))
    want = case.reference(model.checkpoint_weights(), model.dspark)
    for b, n in enumerate(case.LENS):
        assert_close_rel(base[b], want[b], TOL["bf16"], what=f"base logits, context {n}")


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_static_draft_pass_drafts_what_the_dynamic_pass_drafts(model, served, dtype, monkeypatch):
    """The pass the CUDA graphs capture (DraftPass: padded batch rows, whole req_to_token rows as
    the table, fixed bounds, each anchor taken from the previous step's accepted tokens inside
    the pass) gives the anchors and the same draft tokens as the per-step pass, padded or not,
    with the requests' rows anywhere in req_to_token; rows past the batch get an empty
    context."""
    from sgl_atom.speculative.dspark.draft_graphs import DraftGraphs, DraftPass

    monkeypatch.setenv("SGL_ATOM_CPU_KERNELS", "triton")
    case = Case(served, dtype, seed=17)
    case.write_context(served)
    want = served.propose(**case.pass_args(served))
    bs, width = len(case.LENS), max(case.LENS) + 9
    gen = torch.Generator().manual_seed(4)
    req_to_token = torch.zeros(bs + 6, width, dtype=torch.int32)  # other rows: slot 0, NaN
    rows = torch.randperm(bs + 6, generator=gen)[:bs]
    req_to_token[rows, : case.context_slots.shape[1]] = case.context_slots
    args = case.pass_args(served)
    dpass = DraftPass(served, case.pool, args["embed"], args["lm_head"], req_to_token, bs + 2, 5)
    lens = torch.tensor(case.LENS)
    # the previous step's accepted tokens: each anchor last of its request's accepted ones
    accept_lens = torch.randint(1, 6, (bs,), generator=gen)
    accepted = torch.randint(0, served.dspark.vocab_size, (bs, 5), generator=gen)
    accepted[torch.arange(bs), accept_lens - 1] = case.anchors
    # a larger batch first: its rows must not leak into the next, smaller one
    full = torch.full((bs + 2,), 5)
    dpass.load(torch.arange((bs + 2) * 5), full, full, torch.arange(bs + 2))
    dpass.load(accepted.flatten(), accept_lens, lens, rows)
    assert dpass.lens[bs:].tolist() == [0, 0]
    want = torch.cat([case.anchors[:, None], want], dim=1)
    assert torch.equal(dpass.run(bs), want)
    assert torch.equal(dpass.run(bs + 2)[:bs], want)  # padded as a graph of 7 rows runs it
    with pytest.raises(ValueError, match="buffers hold 7"):
        eight = torch.zeros(8, dtype=torch.int64)
        dpass.load(torch.zeros(40, dtype=torch.int64), eight, eight, eight)
    graphs = DraftGraphs.__new__(DraftGraphs)  # the replay choice alone (capture needs CUDA)
    graphs.sizes = [1, 2, 4, 8]
    assert [graphs.size_for(b) for b in (1, 3, 4, 5, 8, 9)] == [1, 4, 4, 8, 8, None]
    # context writes whose capture failed (none kept): the worker writes eagerly
    graphs.dpass, graphs.writes = dpass, {}
    idx = torch.zeros(bs, dtype=torch.int64)
    assert graphs.write_context(torch.zeros(bs * 5, 1), idx, idx, idx, idx) is False


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_static_context_write_writes_what_the_eager_write_writes(served, dtype, monkeypatch):
    """The context write the CUDA graphs capture (DraftPass.write_context: the verify's taps,
    accept index and lengths, sequence lengths and window slots in static buffers, the
    committed rows worked out inside it, padded batch rows, fixed RoPE bound) stores the same
    K/V (and fp8 scales) at every committed row's slot as the per-step write, after a larger
    batch filled the buffers; rows not committed and padded rows touch SGLang's padding slot 0
    only."""
    from sgl_atom.speculative.dspark.draft_graphs import DraftPass

    monkeypatch.setenv("SGL_ATOM_CPU_KERNELS", "triton")
    cfg, window, bs = served.dspark, served.dspark.block_size + 1, 3
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    pools = [Case(served, dtype, seed=5).pool for _ in range(2)]
    for pool in pools:  # the same poison in both: NaN rows everywhere
        for t in pool.k_all + pool.v_all + pool.k_scale_all + pool.v_scale_all:
            t.fill_(float("nan"))
    taps = torch.randn(bs * window, cfg.num_taps * cfg.tap_hidden_size, generator=gen)
    taps = taps.to(served.dtype)
    cols = torch.arange(window)[None, :]
    committed = torch.randint(1, window + 1, (bs, 1), generator=gen)
    keep = cols < committed
    chain = torch.arange(bs)[:, None] * window + cols
    rows = torch.where(keep, chain, 0).flatten()
    starts = torch.randint(0, 40, (bs, 1), generator=gen)
    positions = (starts + cols).flatten()
    free = (torch.randperm(Case.SLOTS - 1, generator=gen) + 1)[: bs * window].view(bs, window)
    slots = torch.where(keep, free, 0).flatten()
    accept_index = torch.where(keep, chain, -1).to(torch.int32)  # as SGLang's verify gives it
    for layer, (k, v) in enumerate(served.context_kv(taps[rows], positions, 60)):
        pools[0].write(layer, slots, k, v)

    req_to_token = torch.zeros(bs + 2, 64, dtype=torch.int32)
    embed = torch.zeros(cfg.vocab_size, cfg.hidden_size, dtype=served.dtype)
    dpass = DraftPass(served, pools[1], embed, embed, req_to_token, bs + 2, window)
    big, many = (bs + 2) * window, bs + 2  # a larger batch first: none may leak into this one
    full = torch.full((many,), window)
    old = taps.repeat(2, 1)[:big]
    dpass.load_context(old, torch.arange(big), full, full, 1 + torch.arange(big))
    dpass.load_context(taps, accept_index, committed.flatten(), starts.flatten(), free.flatten())
    assert not dpass.ctx_accept[bs:].any(), "the padded requests commit nothing"
    dpass.write_context(bs + 2)  # padded as a graph of bs + 2 rows runs it
    written = slots[slots > 0]
    # the same rows at the same slots: equal up to the rounding a matmul of more rows may
    # change (a row at a wrong slot or position is off by O(1))
    tol = 1e-2 if dtype == "bf16" else 4e-2
    for layer in range(cfg.num_hidden_layers):
        pair = zip(pools[0].read(layer, written), pools[1].read(layer, written), strict=True)
        for want, got in pair:
            assert_close_rel(got.float(), want.float(), tol, f"layer {layer} context K/V")
    for a, b in zip(
        pools[0].k_all + pools[0].v_all + pools[0].k_scale_all + pools[0].v_scale_all,
        pools[1].k_all + pools[1].v_all + pools[1].k_scale_all + pools[1].v_scale_all,
        strict=True,
    ):
        rest = torch.ones(a.shape[0], dtype=torch.bool)
        rest[written], rest[0] = False, False
        assert b[rest].float().isnan().all(), "only committed slots and the padding slot"
    with pytest.raises(ValueError, match="buffers hold"):
        more = torch.ones(many + 1, dtype=torch.int64)
        dpass.load_context(taps, more, more, more, more)


def test_draft_graph_sizes_follow_the_target_graphs_on_cuda_only():
    """The worker's graph phase: the target's decode graph sizes that the draft's scratch rows
    hold, none off CUDA (SGLang's runtime context gives the device as a string)."""
    from sgl_atom.speculative.dspark.draft_graphs import capture_sizes

    assert capture_sizes("cpu", [1, 2, 4], 8) == []
    assert capture_sizes("cuda", [], 8) == []  # --disable-cuda-graph: SGLang captured none
    assert capture_sizes("cuda", [4, 1, 2, 16, 8, 2], 8) == [1, 2, 4, 8]
    assert capture_sizes(torch.device("cuda", 0), [1, 64], 32) == [1]


def _tuning_file(tmp_path, fp8_mode: str) -> Path:
    """A device tuning file whose verify entries differ from the launcher's defaults."""
    entry = dict(block_n=32, num_warps=4, num_stages=2, waves=3.0)
    data = {
        "decode": {"bf16": dict(block_n=64), "fp8": dict(block_n=128)},
        "verify": {"bf16": entry, "fp8": dict(entry, block_n=128, kv_mode=fp8_mode)},
    }
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_block_attention_takes_the_devices_verify_tiling(model, tmp_path, monkeypatch, kv):
    """On CUDA the draft's block attention launches the tuning file's verify tiling of its
    pool's KV kind (the kind of tile the target's verify has); on CPU the launcher's defaults."""
    from sgl_atom.attention.decode_tuning import DecodeTuning

    monkeypatch.setenv("SGL_ATOM_DECODE_TUNING", str(_tuning_file(tmp_path, "f16pairs")))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA Test GPU")
    m = placed(model, torch.bfloat16)
    kv_dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    got = m.block_tiling(kv_dtype, torch.device("cuda"))
    want = dict(block_n=32 if kv == "bf16" else 128, num_warps=4, num_stages=2)
    if kv == "fp8":
        want["kv_mode"] = "f16pairs"
    assert got.kernel_kwargs() == want and got.waves == 3.0
    assert m.block_tiling(kv_dtype, torch.device("cpu")) == DecodeTuning()


def test_block_tiling_refuses_a_kv_mode_the_drafts_queries_cannot_take(
    model, tmp_path, monkeypatch
):
    """ "bits" reads fp8 K/V against bf16 queries only: an fp16 draft over an fp8 pool is
    refused at its first pass (graph capture at start-up), naming the file."""
    from sgl_atom.attention.decode_tuning import DecodeTuningError

    path = _tuning_file(tmp_path, "bits")
    monkeypatch.setenv("SGL_ATOM_DECODE_TUNING", str(path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA Test GPU")
    m = placed(model, torch.float16)
    with pytest.raises(DecodeTuningError, match=f"{path}.*'bits' needs a bf16 q"):
        m.block_tiling(torch.float8_e4m3fn, torch.device("cuda"))


def test_the_pass_launches_the_block_tiling(model, monkeypatch):
    """What block_tiling answers reaches every layer's block attention launch, and its waves
    the split plan."""
    import dataclasses

    from sgl_atom.kernels.paged_attention import decode_num_splits

    import sgl_atom.attention.kernel_ops as ko
    from sgl_atom.attention.decode_tuning import DecodeTuning

    monkeypatch.setenv("SGL_ATOM_CPU_KERNELS", "reference")
    m = placed(model, torch.bfloat16)
    tiling = DecodeTuning(block_n=32, num_warps=2, waves=7.0)
    monkeypatch.setattr(m, "block_tiling", lambda *_: tiling)
    seen, real = [], ko.REFERENCE.block

    def block(*args, **kw):
        seen.append(kw)
        return real(*args, **kw)

    monkeypatch.setattr(ko, "REFERENCE", dataclasses.replace(ko.REFERENCE, block=block))
    case = Case(m, "bf16", seed=17)
    case.write_context(m)
    m.base_logits(**case.pass_args(m))
    assert len(seen) == m.dspark.num_hidden_layers
    sms = 132  # num_sms' count for a CPU device
    splits = decode_num_splits(len(case.LENS), m.dspark.num_key_value_heads,
                               case.pool.slots, sms, 7.0)  # fmt: skip
    for kw in seen:
        assert kw["block_n"] == 32 and kw["num_warps"] == 2 and kw["num_splits"] == splits
