"""The serving-side DSpark draft: the batched model class against the one-sequence reference,
and the draft's own KV pool at bf16 and fp8."""

from __future__ import annotations

import json

import pytest
import torch

from sgl_atom.models.dspark_draft import AtomDSparkDraftModel
from sgl_atom.spec.dspark import reference as ref
from sgl_atom.spec.dspark.pool import DraftKVPool
from sgl_atom.spec.dspark.weights import init_draft_weights
from sgl_atom.testing import DSPARK_DISTILLED


@pytest.fixture(scope="module")
def model():
    raw = json.loads((DSPARK_DISTILLED / "config.json").read_text())
    m = AtomDSparkDraftModel(raw)
    w = init_draft_weights(m.dspark, seed=3, init_range=0.05, dtype=torch.float64)
    m.load_weights(w.items())
    return m


def test_load_refuses_missing_and_unexpected_tensors(model):
    w = dict(model.w)
    w.pop("norm.weight")
    w["extra.weight"] = torch.zeros(1)
    fresh = AtomDSparkDraftModel(json.loads((DSPARK_DISTILLED / "config.json").read_text()))
    match = r"missing \['norm.weight'\].*unexpected \['extra.weight'\]"
    with pytest.raises(ValueError, match=match):
        fresh.load_weights(w.items())


def test_batched_propose_equals_reference_per_request(model):
    cfg = model.dspark
    gen = torch.Generator().manual_seed(0)
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    embed = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64)
    head = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 0.2
    lens = [7, 13, 1]
    taps = [torch.randn(n, cfg.num_taps * cfg.tap_hidden_size, generator=gen, dtype=torch.float64)
            for n in lens]
    anchors = torch.tensor([5, 17, 400])
    expected = [
        ref.reference_propose(
            model.w, cfg, taps=t, anchor=int(a), embed=embed, lm_head=head
        )[0]
        for t, a in zip(taps, anchors, strict=True)
    ]
    # the context rows of all requests, one after another, as the worker gathers them
    per_req = [model.context_kv(t, torch.arange(t.shape[0])) for t in taps]
    context = [
        (torch.cat([kv[i][0] for kv in per_req]), torch.cat([kv[i][1] for kv in per_req]))
        for i in range(cfg.num_hidden_layers)
    ]
    owner = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))
    got = model.propose(
        anchors=anchors,
        context_lens=torch.tensor(lens),
        context_kv=context,
        context_owner=owner,
        embed=embed,
        lm_head=head,
    )
    assert got.tolist() == torch.stack(expected).tolist()


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
