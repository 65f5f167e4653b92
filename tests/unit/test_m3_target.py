"""M3Target, the batched pure-torch M3 target for distillation: equal to the float64 M3Reference
within the dense-exact bound, batched rows equal single rows, taps, KV-cached greedy, the bound's
refusal, model_type dispatch, and autograd through ``logits``."""

from __future__ import annotations

import pytest
import torch

from dspark_training.llama_target import LlamaTarget
from dspark_training.m3_target import M3Target, load_target_model
from m3_reference import M3Reference
from sgl_atom.cpu_mode import cache_dir
from sgl_atom.testing import tiny

LENGTHS = (1, 37, 130, 256)  # 256 = 2 blocks of 128 = the tiny m3's topk_blocks * 128
BOUND = 256

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpts():
    root, quiet = cache_dir() / "tiny", lambda _: None
    return tiny.build(root / "m3", "m3", log=quiet), tiny.build(root / "llama", "llama", log=quiet)


@pytest.fixture(scope="module")
def m3(ckpts):
    return M3Target.load(ckpts[0], dtype=torch.float64)


@pytest.fixture(scope="module")
def seqs(m3):
    gen = torch.Generator().manual_seed(7)
    vocab = m3.embed.shape[0]
    return [torch.randint(0, vocab, (n,), generator=gen) for n in LENGTHS]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _padded(seqs: list[torch.Tensor], pad: int) -> torch.Tensor:
    ids = torch.full((len(seqs), max(len(s) for s in seqs)), pad, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = s
    return ids


def test_dense_exact_bound(m3):
    sc = m3.sparse
    assert (sc.topk_blocks, sc.init_blocks, sc.local_blocks) == (2, 1, 1)
    assert m3.dense_exact_tokens == BOUND == max(LENGTHS)


def test_logits_equal_float64_reference(ckpts, m3, seqs):
    ref = M3Reference.load(ckpts[0])
    for s in seqs:
        want = ref.forward(s)  # sparse layers select blocks; within the bound they pick all
        got, taps = m3.forward(s[None])
        assert taps is None and got.dtype == torch.float64
        assert _rel(got[0], want) < 1e-9, len(s)
    # the bound is tight: one token past it the sparse reference drops a block and differs
    longer = torch.cat([seqs[-1], seqs[1][:1]])
    got, _ = m3.forward(longer[None], allow_beyond_sparse=True)
    assert _rel(got[0, :BOUND], ref.forward(longer)[:BOUND]) < 1e-9
    assert _rel(got[0], ref.forward(longer, dense=True)) < 1e-9
    assert _rel(got[0, BOUND:], ref.forward(longer)[BOUND:]) > 1e-6


def test_batched_rows_equal_single_rows(m3, seqs):
    """Layer 0 (dense MLP) agrees to float64 rounding. The MoE router runs in float32 (as
    served) and its matmul rounds differently for other batch shapes, so later layers agree to
    float32 rounding of the routing weights; a padding or batching bug would be O(1)."""
    h = m3.hidden
    logits, taps = m3.forward(_padded(seqs, pad=5), (0, 2))
    for r, s in enumerate(seqs):
        one, one_taps = m3.forward(s[None], (0, 2))
        n = len(s)
        assert _rel(taps[r, :n, :h], one_taps[0, :, :h]) < 1e-13, n
        assert _rel(taps[r, :n, h:], one_taps[0, :, h:]) < 1e-6, n
        assert _rel(logits[r, :n], one[0]) < 1e-6, n
        assert torch.equal(logits[r, :n].argmax(-1), one[0].argmax(-1)), n


def test_taps_are_layer_outputs(m3, seqs):
    ids = seqs[2][None]
    taps_all = m3.forward(ids, tuple(range(m3.num_layers)))[1]
    logits, taps = m3.forward(ids, (1, m3.num_layers - 1))
    assert taps.shape == (1, ids.shape[1], 2 * m3.hidden)
    h = m3.hidden
    # residual stream recomputed layer by layer through _layer
    x = m3.embed[ids]
    for i in range(m3.num_layers):
        x = m3._layer(i, x, 0, None)
        assert torch.equal(taps_all[..., i * h : (i + 1) * h], x), i
        if i == 1:
            assert torch.equal(taps[..., :h], x)
    last = taps[..., h:]
    assert torch.equal(m3._norm(last, "model.norm.weight") @ m3.lm_head.T, logits)
    with pytest.raises(ValueError, match="tap ids"):
        m3.forward(ids, (m3.num_layers,))


def test_greedy_cached_equals_recomputed(m3, seqs):
    steps = 6
    prompts = torch.stack([seqs[1], seqs[2][:37], seqs[3][:37]])
    cached = m3.greedy(prompts, steps)
    assert cached.shape == (3, steps)
    full = prompts
    for _ in range(steps):
        logits, _ = m3.forward(full)
        full = torch.cat([full, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, full[:, prompts.shape[1] :])
    out = m3.greedy_sequences([seqs[1].tolist(), seqs[2][:5].tolist()], 3)
    assert torch.equal(out[0], full[0, :40])
    assert torch.equal(out[1][:5], seqs[2][:5]) and out[1].shape == (8,)


def test_beyond_the_bound_is_refused(m3, seqs):
    ids = torch.cat([seqs[-1], seqs[1][:1]])[None]  # BOUND + 1 tokens
    with pytest.raises(ValueError, match=f"dense_exact_tokens={BOUND}"):
        m3.forward(ids)
    with pytest.raises(ValueError, match=f"dense_exact_tokens={BOUND}"):
        m3._layer(0, m3.embed[ids], 0, None)
    logits, _ = m3.forward(ids, allow_beyond_sparse=True)
    assert logits.shape[1] == BOUND + 1 and torch.isfinite(logits).all()
    # greedy feeds back all but the last new token: 250 + 7 - 1 = 256 fits, 250 + 8 - 1 not
    prompt = seqs[-1][None, :250]
    assert m3.greedy(prompt, 7).shape == (1, 7)
    with pytest.raises(ValueError, match=f"dense_exact_tokens={BOUND}"):
        m3.greedy(prompt, 8)
    assert m3.greedy(prompt, 8, allow_beyond_sparse=True).shape == (1, 8)


def test_model_type_is_checked_and_dispatched(ckpts):
    m3_dir, llama_dir = ckpts
    with pytest.raises(ValueError, match="model_type 'llama'"):
        M3Target.load(llama_dir)
    m3 = load_target_model(m3_dir)
    assert type(m3) is M3Target and m3.dtype == torch.float32
    assert type(load_target_model(llama_dir)) is LlamaTarget
    assert m3.encode_batch(["hello world"])[0] == m3.encode("hello world") != []


def test_gradients_flow_through_layers(ckpts, seqs):
    model = M3Target.load(ckpts[0])
    names = ("model.layers.1.self_attn.q_proj.weight", "model.layers.2.mlp.experts.0.w1.weight")
    params = [model.w[n] for n in names] + [model.lm_head]
    for p in params:
        p.requires_grad_(True)
        p.grad = None
    ids = seqs[2][None]
    logits = model.logits(ids)  # through _layer, the target trainer's forward
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    loss.backward()
    for n, p in zip(names + ("lm_head.weight",), params, strict=True):
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
        assert p.grad.abs().sum() > 0, n
