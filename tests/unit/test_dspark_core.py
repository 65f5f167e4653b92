"""DSpark core: draft config, Markov refinement, greedy acceptance, counters, the tiny draft
checkpoint and the reference draft forward."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import torch

from sgl_atom.speculative.dspark import (
    DSparkConfigError,
    DSparkDraftConfig,
    SpecStats,
    greedy_accept,
    markov_refine,
)
from sgl_atom.speculative.dspark import reference as ref
from sgl_atom.speculative.dspark.weights import check_draft_weights, draft_weight_shapes
from sgl_atom.testing import tiny

# ---------------------------------------------------------------- config


def _hf(**over) -> dict:
    d = {
        "architectures": ["AtomDSparkDraftModel"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 100,
        "block_size": 4,
        "dspark_target_layer_ids": [0, 2],
        "num_target_layers": 4,
        "mask_token_id": 3,
        "markov_rank": 8,
    }
    d.update(over)
    return {k: v for k, v in d.items() if v is not None}


def test_config_parses_prefixed_and_plain_fields():
    cfg = DSparkDraftConfig.from_hf_dict(_hf())
    assert cfg.block_size == 4 and cfg.target_layer_ids == (0, 2) and cfg.head_dim == 16
    assert cfg.query_len == 4 and cfg.num_taps == 2 and cfg.tap_hidden_size == 64
    assert cfg.markov_head_type == "vanilla" and not cfg.enable_confidence_head
    assert DSparkDraftConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_config_reads_nested_layouts_and_prefixed_names():
    nested = _hf(block_size=None, mask_token_id=None, dspark_target_layer_ids=None)
    nested["dflash_config"] = {"block_size": 7, "target_layer_ids": [1, 3], "mask_token_id": 5}
    cfg = DSparkDraftConfig.from_hf_dict(nested)
    assert (cfg.block_size, cfg.target_layer_ids, cfg.mask_token_id) == (7, (1, 3), 5)
    pre = _hf(block_size=None, dspark_block_size=6, dspark_noise_token_id=9, mask_token_id=None)
    cfg = DSparkDraftConfig.from_hf_dict(pre)
    assert (cfg.block_size, cfg.mask_token_id) == (6, 9)
    wrapped = {"architectures": ["X"], "text_config": _hf(), "dspark_block_size": 4}
    assert DSparkDraftConfig.from_hf_dict(wrapped).hidden_size == 64


BAD_CONFIGS = {
    "missing-hidden": (dict(hidden_size=None), r"hidden_size=None, expected an integer"),
    "no-architectures": (dict(architectures=[]), r"architectures=\[\]"),
    "block-size-0": (dict(block_size=0), r"block_size=0, expected an integer >= 1"),
    "no-block-size": (dict(block_size=None), r"dspark_block_size / block_size=None"),
    "taps-empty": (dict(dspark_target_layer_ids=[]), r"dspark_target_layer_ids=\[\], expected"),
    "no-taps": (
        dict(dspark_target_layer_ids=None),
        r"dspark_target_layer_ids / target_layer_ids=None, expected a non-empty list",
    ),
    "taps-unordered": (dict(dspark_target_layer_ids=[2, 1]), r"strictly increasing"),
    "taps-negative": (dict(dspark_target_layer_ids=[-1, 2]), r"=-1, expected an integer >= 0"),
    "tap-past-target": (dict(dspark_target_layer_ids=[1, 4]), r"num_target_layers=4"),
    "rank-0": (dict(markov_rank=0), r"markov_rank=0, expected an integer >= 1"),
    "rank-over-vocab": (dict(markov_rank=101), r"markov_rank=101, expected <= vocab_size"),
    "head-gated": (dict(markov_head_type="gated"), r"markov_head_type='gated'.*vanilla"),
    "head-unknown": (dict(markov_head_type="lstm"), r"markov_head_type='lstm'.*'rnn'"),
    "mask-past-vocab": (dict(mask_token_id=100), r"mask_token_id=100, expected in \[0, vocab"),
    "kv-heads": (dict(num_key_value_heads=3), r"num_key_value_heads=3, expected a divisor"),
    "rank-str": (dict(markov_rank="8"), r"markov_rank='8', expected an integer"),
    "bool-field": (dict(sample_from_anchor="yes"), r"sample_from_anchor='yes', expected true"),
    "arch-not-list": (dict(architectures="AtomDSparkDraftModel"), r"architectures='Atom.*list"),
    "arch-not-str": (dict(architectures=[5]), r"architectures=5, expected a string"),
    "hidden-bool": (dict(hidden_size=True), r"hidden_size=True, expected an integer"),
    "head-dim-0": (dict(head_dim=0), r"head_dim=0, expected an integer >= 1"),
    "layers-0": (dict(num_hidden_layers=0), r"num_hidden_layers=0, expected an integer >= 1"),
    "vocab-float": (dict(vocab_size=100.0), r"vocab_size=100.0, expected an integer"),
    "max-pos-0": (dict(max_position_embeddings=0), r"max_position_embeddings=0, expected an"),
    "tap-width-0": (dict(target_hidden_size=0), r"target_hidden_size=0, expected an integer >= 1"),
    "no-mask": (
        dict(mask_token_id=None),
        r"dspark_noise_token_id / mask_token_id=None, expected an integer \(field is required\)",
    ),
    "mask-negative": (dict(mask_token_id=-1), r"mask_token_id=-1, expected an integer >= 0"),
    "taps-not-list": (dict(dspark_target_layer_ids="0,2"), r"ids='0,2', expected a non-empty list"),
    "taps-bool": (dict(dspark_target_layer_ids=[0, True]), r"ids=True, expected an integer"),
    "num-targets-0": (dict(num_target_layers=0), r"num_target_layers=0, expected an integer >= 1"),
    "head-not-str": (dict(markov_head_type=5), r"markov_head_type=5, expected a string"),
    "eps-str": (dict(rms_norm_eps="1e-6"), r"rms_norm_eps='1e-6', expected a number"),
    "nested-bool": (
        dict(dspark_config={"enable_confidence_head": 1}),
        r"dspark_config.enable_confidence_head=1, expected true or false",
    ),
    "disagree": (
        dict(dflash_config={"target_layer_ids": [1, 3]}),
        r"dflash_config.target_layer_ids=\[1, 3\], expected the same value as "
        r"dspark_target_layer_ids",
    ),
}


@pytest.mark.parametrize("over,msg", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_config_refusals_name_the_field(over, msg):
    with pytest.raises(DSparkConfigError, match=msg):
        DSparkDraftConfig.from_hf_dict(_hf(**over))


def test_config_refuses_what_is_not_a_dict():
    with pytest.raises(DSparkConfigError, match="draft config must be a dict, got list"):
        DSparkDraftConfig.from_hf_dict([_hf()])


def test_config_defaults_fill_absent_or_null_fields():
    cfg = DSparkDraftConfig.from_hf_dict(
        _hf(rope_theta=None, num_key_value_heads=None, markov_head_type="Vanilla", rms_norm_eps=1)
    )
    assert (cfg.rope_theta, cfg.num_key_value_heads, cfg.markov_head_type) == (
        10000.0,
        4,
        "vanilla",
    )
    assert cfg.rms_norm_eps == 1.0 and cfg.max_position_embeddings == 32768


def test_config_is_checked_when_built_directly():
    cfg = DSparkDraftConfig.from_hf_dict(_hf())
    with pytest.raises(ValueError, match="block_size"):
        dataclasses.replace(cfg, block_size=0)
    with pytest.raises(ValueError, match="markov_rank=101, expected <= vocab_size"):
        dataclasses.replace(cfg, markov_rank=101)
    with pytest.raises(ValueError, match="target_layer_ids"):
        dataclasses.replace(cfg, target_layer_ids=(2, 2))


def test_check_target_refuses_mismatches():
    cfg = DSparkDraftConfig.from_hf_dict(_hf())
    cfg.check_target(num_layers=4, hidden_size=64, vocab_size=100)
    with pytest.raises(DSparkConfigError, match="below the target's 2 layers"):
        cfg.check_target(num_layers=2, hidden_size=64, vocab_size=100)
    with pytest.raises(DSparkConfigError, match="target_hidden_size=64, expected the target's 32"):
        cfg.check_target(num_layers=4, hidden_size=32, vocab_size=100)
    with pytest.raises(DSparkConfigError, match="vocab_size=100, expected the target's"):
        cfg.check_target(num_layers=4, hidden_size=64, vocab_size=128)


# ---------------------------------------------------------------- Markov head


def _markov_loop(base, anchor, w1, w2):
    """One request, one position at a time, in float64."""
    tokens = torch.empty(base.shape[:2], dtype=torch.int64)
    for b in range(base.shape[0]):
        prev = int(anchor[b])
        for j in range(base.shape[1]):
            logits = base[b, j].double() + w1[prev].double() @ w2.double().T
            prev = int(torch.argmax(logits))
            tokens[b, j] = prev
    return tokens


@pytest.mark.parametrize("batch,k,vocab,rank", [(1, 1, 5, 1), (3, 5, 37, 7), (8, 7, 257, 32)])
def test_markov_refine_matches_loop(batch, k, vocab, rank):
    g = torch.Generator().manual_seed(batch * 100 + k)
    base = torch.randn(batch, k, vocab, generator=g)
    w1, w2 = torch.randn(vocab, rank, generator=g), torch.randn(vocab, rank, generator=g)
    anchor = torch.randint(0, vocab, (batch,), generator=g)
    tokens, logits = markov_refine(base, anchor, w1, w2, return_logits=True)
    assert torch.equal(tokens, _markov_loop(base, anchor, w1, w2))
    assert logits.dtype == torch.float32 and logits.shape == (batch, k, vocab)
    assert torch.equal(logits.argmax(-1), tokens)


def test_markov_bias_follows_the_previous_token_and_ties_go_low():
    vocab = 6
    w1 = torch.eye(vocab, 2)  # tokens 0 and 1 have a latent, others none
    w2 = torch.zeros(vocab, 2)
    w2[4, 0] = 10.0  # after token 0, token 4 wins
    base = torch.zeros(2, 2, vocab)  # all ties without the bias
    tokens = markov_refine(base, torch.tensor([0, 5]), w1, w2)
    assert tokens.tolist() == [[4, 0], [0, 4]]


def test_markov_refine_refuses_shape_mismatch():
    with pytest.raises(ValueError, match=r"markov_w1 and markov_w2 must both be \[vocab=5"):
        markov_refine(torch.zeros(1, 2, 5), torch.zeros(1), torch.zeros(4, 2), torch.zeros(4, 2))


# ---------------------------------------------------------------- acceptance and counters


def test_accept_all_none_and_mixed():
    draft = torch.tensor([[5, 6, 7], [9, 6, 7], [5, 6, 8], [5, 1, 7]])
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    acc = greedy_accept(draft, target)
    assert acc.accepted.tolist() == [3, 0, 2, 1]
    assert acc.num_committed.tolist() == [4, 1, 3, 2]
    assert acc.bonus.tolist() == [8, 5, 7, 6]
    assert acc.committed.tolist() == [
        [5, 6, 7, 8],
        [5, -1, -1, -1],
        [5, 6, 7, -1],
        [5, 6, -1, -1],
    ]


def test_accept_later_match_after_a_miss_counts_nothing():
    acc = greedy_accept(torch.tensor([[1, 2, 3]]), torch.tensor([[1, 9, 3, 4]]), pad_id=0)
    assert acc.accepted.tolist() == [1] and acc.committed.tolist() == [[1, 9, 0, 0]]


def test_accept_refuses_wrong_target_width():
    with pytest.raises(ValueError, match=r"target must be \[batch=1, k \+ 1=3\]"):
        greedy_accept(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long))


def test_spec_stats_arithmetic():
    stats = SpecStats(block_size=4)
    assert stats.tokens_per_forward == 0.0 and stats.acceptance_rate == 0.0
    stats.update(torch.tensor([4, 0, 2]))
    stats.update([3])
    assert (stats.steps, stats.accepted, stats.proposed) == (4, 9, 16)
    assert stats.acceptance_rate == 9 / 16 and stats.tokens_per_forward == 1 + 9 / 4
    assert stats.as_log_line() == (
        "DSpark k=4: steps 4, accepted 9/16 (56.2%), tokens/forward 3.25"
    )
    m = stats.as_metrics()
    assert m["spec_accept_length"] == 3.25 and m["spec_accept_rate"] == 9 / 16
    assert m["spec_steps"] == 4 and m["spec_proposed_tokens"] == 16
    other = SpecStats(block_size=4, steps=1, accepted=4, proposed=4)
    stats.merge(other)
    assert stats.tokens_per_forward == 1 + 13 / 5
    with pytest.raises(ValueError, match=r"accepted counts must lie in \[0, k=4\]"):
        stats.update([5])
    with pytest.raises(ValueError, match="cannot merge"):
        stats.merge(SpecStats(block_size=7))


# ---------------------------------------------------------------- tiny checkpoint


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark")
    quiet = lambda _: None
    return tiny.build(root / "llama", "llama", log=quiet), tiny.build(
        root / "d", "dspark", log=quiet
    )


def _load(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _sha(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_tiny_draft_checkpoint_layout(ckpts):
    target, draft = ckpts
    hf = json.loads((draft / "config.json").read_text())
    assert hf["architectures"] == ["AtomDSparkDraftModel"]
    assert hf["dspark_target_layer_ids"] == hf["target_layer_ids"] == [1, 2]
    assert hf["model_type"] == "qwen3" and hf["mask_token_id"] == 3
    cfg = DSparkDraftConfig.from_hf_dict(hf)
    tcfg = json.loads((target / "config.json").read_text())
    cfg.check_target(
        num_layers=tcfg["num_hidden_layers"],
        hidden_size=tcfg["hidden_size"],
        vocab_size=tcfg["vocab_size"],
    )
    w = _load(draft)
    check_draft_weights(cfg, w)
    assert w["fc.weight"].shape == (256, 512) and w["hidden_norm.weight"].shape == (256,)
    assert w["markov_head.markov_w1.weight"].shape == (cfg.vocab_size, 32)
    assert w["markov_head.markov_w2.weight"].shape == (cfg.vocab_size, 32)
    assert w["layers.1.self_attn.k_proj.weight"].shape == (128, 256)
    assert not any("embed_tokens" in n or "lm_head" in n for n in w)
    assert set(w) == set(draft_weight_shapes(cfg))
    tok = (draft / "tokenizer.json").read_bytes()
    assert tok == (target / "tokenizer.json").read_bytes()
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(draft / "tokenizer.json")).id_to_token(cfg.mask_token_id) == (
        "<pad>"
    )


def test_tiny_draft_is_deterministic_and_skips_rebuild(ckpts, tmp_path):
    _, draft = ckpts
    again = tiny.build(tmp_path / "again", "dspark", log=lambda _: None)
    assert _sha(again) == _sha(draft)
    assert (again / "config.json").read_text() == (draft / "config.json").read_text()
    logs: list[str] = []
    tiny.build(draft, "dspark", log=logs.append)
    assert logs == [f"[tiny] dspark checkpoint already built at {draft}"]


def test_check_draft_weights_names_what_is_wrong(ckpts):
    _, draft = ckpts
    cfg = DSparkDraftConfig.from_hf_dict(json.loads((draft / "config.json").read_text()))
    w = _load(draft)
    w.pop("norm.weight")
    w["fc.weight"] = w["fc.weight"][:, :256]
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\].*fc.weight \(256, 256\)"):
        check_draft_weights(cfg, w)


# ---------------------------------------------------------------- reference forward


@pytest.fixture(scope="module")
def setup(ckpts):
    from transformers import AutoTokenizer, LlamaForCausalLM

    target_dir, draft_dir = ckpts
    target = LlamaForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float64).eval()
    cfg = DSparkDraftConfig.from_hf_dict(json.loads((draft_dir / "config.json").read_text()))
    w = {k: v.double() for k, v in _load(draft_dir).items()}
    ids = AutoTokenizer.from_pretrained(target_dir)("The red cat walks to the city")["input_ids"]
    with torch.no_grad():
        out = target(torch.tensor([ids]), output_hidden_states=True)
    taps = ref.taps_from_hidden_states(out.hidden_states, cfg.target_layer_ids)[0]
    anchor = int(out.logits[0, -1].argmax())
    embed = target.get_input_embeddings().weight.detach()
    head = target.get_output_embeddings().weight.detach()
    return cfg, w, taps, anchor, embed, head


def _logits(setup, taps=None, embeds=None, kv_extra=None):
    cfg, w, t, anchor, embed, head = setup
    taps = t if taps is None else taps
    n = taps.shape[0]
    kv = ref.reference_context_kv(w, cfg, taps, torch.arange(n))
    if kv_extra is not None:
        kv = [(torch.cat([k, kv_extra]), torch.cat([v, kv_extra])) for k, v in kv]
    ids = ref.block_input_ids(torch.tensor([anchor]), cfg)[0]
    embeds = embed[ids] if embeds is None else embeds
    return ref.reference_base_logits(
        w, cfg, context_kv=kv, context_len=n, block_embeds=embeds, lm_head=head
    )


def test_reference_propose_runs(setup):
    cfg, w, taps, anchor, embed, head = setup
    tokens, base = ref.reference_propose(
        w, cfg, taps=taps, anchor=anchor, embed=embed, lm_head=head
    )
    assert tokens.shape == (cfg.block_size,) and base.shape == (cfg.block_size, cfg.vocab_size)
    assert torch.isfinite(base).all() and torch.equal(base, _logits(setup))
    w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
    assert torch.equal(tokens, markov_refine(base[None], torch.tensor([anchor]), w1, w2)[0])


def test_reference_is_non_causal_inside_the_block(setup):
    cfg, _, _, anchor, embed, _ = setup
    ids = ref.block_input_ids(torch.tensor([anchor]), cfg)[0]
    embeds = embed[ids].clone()
    embeds[cfg.query_len - 1] += 0.5  # the last MASK position
    base, moved = _logits(setup), _logits(setup, embeds=embeds)
    assert not torch.allclose(base[0], moved[0])  # the anchor row sees the last position


def test_reference_reads_the_context_and_nothing_past_it(setup):
    cfg, _, taps, _, _, _ = setup
    base = _logits(setup)
    changed = taps.clone()
    changed[0] += 1.0
    assert not torch.allclose(base, _logits(setup, taps=changed))
    stale = torch.randn(3, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.float64)
    assert torch.equal(base, _logits(setup, kv_extra=stale))


def test_context_kv_written_in_chunks_equals_one_write(setup):
    cfg, w, taps, _, _, _ = setup
    n = taps.shape[0]
    whole = ref.reference_context_kv(w, cfg, taps, torch.arange(n))
    cut = n // 2
    first = ref.reference_context_kv(w, cfg, taps[:cut], torch.arange(cut))
    second = ref.reference_context_kv(w, cfg, taps[cut:], torch.arange(cut, n))
    for (k, v), (k1, v1), (k2, v2) in zip(whole, first, second, strict=True):
        torch.testing.assert_close(k, torch.cat([k1, k2]), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(v, torch.cat([v1, v2]), rtol=1e-12, atol=1e-12)


def test_taps_refuse_the_last_target_layer(setup):
    hidden = tuple(torch.zeros(1, 2, 4) for _ in range(5))  # embedding + 4 layers
    assert ref.taps_from_hidden_states(hidden, (0, 2)).shape == (1, 2, 8)
    with pytest.raises(ValueError, match=r"ids must be below 3"):
        ref.taps_from_hidden_states(hidden, (1, 3))


def test_sample_from_anchor_false_drops_the_anchor_row(setup):
    cfg, w, taps, anchor, embed, head = setup
    cfg2 = dataclasses.replace(cfg, sample_from_anchor=False)
    assert cfg2.query_len == cfg.block_size + 1
    _, base = ref.reference_propose(w, cfg2, taps=taps, anchor=anchor, embed=embed, lm_head=head)
    assert base.shape == (cfg.block_size, cfg.vocab_size)
