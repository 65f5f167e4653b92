"""The committed DSpark drafts and the distillation pieces that made them. Against the predictable
chain target (``llama-chain-target``) the chain draft is a full checkpoint, its speculative loop
is lossless, and acceptance is real: at least 4 tokens per forward at k=4 on held-out word
prompts, a random draft of the same config stays near 1, taps read one layer late lose at least
half a token. The pieces (pure-torch target, batched anchor forward, batched measurement,
training step) match their references."""

from __future__ import annotations

import json

import pytest
import torch

from dspark_training import anchors, distill, train_target
from dspark_training.llama_target import LlamaTarget
from sgl_atom.cpu_mode import cache_dir
from sgl_atom.speculative.dspark import reference as ref
from sgl_atom.testing import ASSETS, DSPARK_CHAIN, DSPARK_M3_CHAIN, tiny

CHAIN_TARGET = ASSETS / "llama-chain-target"  # trained on a sparse order-2 word chain
CHAIN_DRAFT = DSPARK_CHAIN  # distilled against it
MIN_CHAIN_TPF = 4.0  # the chain draft measures 4.8-5.3 at k=4 on held-out word prompts
MAX_RANDOM_TPF = 1.5  # a random draft of the same config measures 1.01 there
MIN_SHIFT_DROP = 0.5  # taps one target layer late ([2, 3]) lose at least this much (3.41 vs 5.0)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpts():
    root = cache_dir() / "tiny"
    quiet = lambda _: None
    return tiny.build(root / "llama", "llama", log=quiet), tiny.build(
        root / "dspark", "dspark", log=quiet
    )


@pytest.fixture(scope="module")
def chain():
    target = LlamaTarget.load(CHAIN_TARGET)
    cfg, w = distill.load_draft(CHAIN_DRAFT)
    es = distill.EvalSet.build("words", target, distill.held_out_word_prompts(16), 4, 48)
    return target, cfg, w, es


def test_chain_draft_is_a_full_checkpoint(ckpts):
    _, random_draft = ckpts
    cfg, weights = distill.load_draft(CHAIN_DRAFT)  # checks every tensor's name and shape
    assert (CHAIN_DRAFT / "config.json").read_text() == (random_draft / "config.json").read_text()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (CHAIN_DRAFT / name).read_bytes() == (random_draft / name).read_bytes()
    _, random_weights = distill.load_draft(random_draft)
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert not torch.equal(weights["fc.weight"], random_weights["fc.weight"])
    assert cfg.block_size == 4 and cfg.num_hidden_layers == 2 and cfg.target_layer_ids == (1, 2)


@pytest.mark.parametrize("draft", [CHAIN_DRAFT, DSPARK_M3_CHAIN], ids=["llama-chain", "m3-chain"])
def test_held_out_prompts_are_not_training_prompts(draft):
    info = json.loads((draft / "distill.json").read_text())
    words = round(info["train_prompts"] * info["word_frac"])
    train = set(distill.word_prompts(words, info["train_word_seed"], 2, 48))
    train |= set(distill.corpus_prompts(info["train_prompts"] - words, info["train_prompt_seed"]))
    assert len(train) > 0.9 * info["train_prompts"]
    held_out = distill.held_out_prompts(512) + distill.held_out_word_prompts(512)
    assert not train & set(held_out)


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


def test_batched_anchor_forward_matches_the_reference(chain):
    target, cfg, w, _ = chain
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


@pytest.mark.parametrize("shift", [0, -1], ids=["taps", "taps-one-early"])
def test_batched_measurement_matches_the_lossless_loop(chain, shift):
    # evaluate runs the transformers target verifying the draft's blocks step by step and raises
    # when the output differs from plain greedy decoding; it taps as a server would, so below
    # the last layer: the shifted case reads [0, 1] (4.61 tokens/forward there, 5.0 unshifted)
    prompts = distill.held_out_word_prompts(4)
    loop = distill.evaluate(CHAIN_TARGET, CHAIN_DRAFT, prompts, 4, 24, tap_shift=shift)
    target, cfg, w, _ = chain
    es = distill.EvalSet.build("words", target, prompts, 4, 24)
    batched = distill.measure(target, cfg, w, es, k=4, tap_shift=shift)
    for key in ("steps", "tokens_per_forward", "acceptance_rate"):
        assert batched[key] == loop[key], (batched, loop)
    assert shift or loop["tokens_per_forward"] >= MIN_CHAIN_TPF, loop


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
    trained = distill.measure(target, cfg, w, es, k=4)
    assert trained["prompts"] == 16 and trained["max_new"] == 48
    assert trained["tokens_per_forward"] >= MIN_CHAIN_TPF, trained
    # a random draft of the same config (tiny kind "dspark", the layout distillation starts from)
    random = distill.measure(target, *distill.load_draft(ckpts[1]), es, k=4)
    assert random["tokens_per_forward"] < MAX_RANDOM_TPF, random
    # the same draft reading target layers [2, 3]: the context taps carry what it needs
    shifted = distill.measure(target, cfg, w, es, k=4, tap_shift=1)
    assert shifted["tap_layer_ids"] == [2, 3]
    drop = trained["tokens_per_forward"] - shifted["tokens_per_forward"]
    assert drop >= MIN_SHIFT_DROP, (trained, shifted)


def test_chain_kind_copies_the_committed_target(tmp_path):
    out = tiny.build(tmp_path / "llama-chain", "llama-chain", log=lambda _: None)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (out / name).read_bytes() == (CHAIN_TARGET / name).read_bytes()
    assert tiny.is_built(out, "llama-chain")
