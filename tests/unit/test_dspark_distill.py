"""The committed DSpark drafts and the distillation pieces that made them. Against the predictable
chain target (``llama-chain-target``) the chain draft is a full checkpoint, its speculative loop
is lossless, and acceptance is real: at least 4 tokens per forward at k=4 on held-out word
prompts, a random draft of the same config stays near 1, taps read one layer late lose at least
half a token. The pieces (the transformers-backed target's taps and cached greedy, batched anchor
forward, batched measurement, training step) match their references."""

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


def test_llama_target_taps_and_cached_greedy(ckpts):
    """Taps are the decoder layers' outputs (HF's hidden states below the last layer, the last
    one before the final norm), and the KV-cached greedy, batched by prompt length, equals argmax
    decoding recomputed over the whole sequence."""
    from transformers import AutoTokenizer

    target = LlamaTarget.load(ckpts[0])
    prompts = distill.held_out_word_prompts(3) + distill.held_out_prompts(3)
    toks = target.encode_batch(prompts)
    hf_tokenizer = AutoTokenizer.from_pretrained(ckpts[0])
    assert toks == [hf_tokenizer(p)["input_ids"] for p in prompts]
    ids, h, last = torch.tensor([toks[0]]), target.hidden, target.num_layers - 1
    logits, taps = target.forward(ids, (last, *range(last)))  # in the order asked
    out = target.model(ids, output_hidden_states=True)  # transformers' own hidden states
    for i in range(last):
        torch.testing.assert_close(taps[..., (i + 1) * h : (i + 2) * h], out.hidden_states[i + 1])
    raw = taps[..., :h]
    torch.testing.assert_close(target.model.model.norm(raw), out.hidden_states[-1])
    assert (raw - out.hidden_states[-1]).abs().max() > 0.1  # the tap is not the normed entry
    torch.testing.assert_close(logits, out.logits)
    with pytest.raises(ValueError, match="tap ids"):
        target.forward(ids, (target.num_layers,))
    rows = toks + [t[::-1] for t in toks[:3]]  # three lengths decode two rows together
    seqs = target.greedy_sequences(rows, 12, batch=2)
    for p, s in zip(rows, seqs, strict=True):
        full = torch.tensor([p])
        for _ in range(12):
            full = torch.cat([full, target.forward(full)[0][:, -1:].argmax(-1)], dim=1)
        assert torch.equal(s, full[0])


def test_llama_trainer_model_trains_the_initial_weights(ckpts):
    config = json.loads((ckpts[0] / "config.json").read_text())
    model, w, names = train_target.init_model(config, ckpts[0], 0, "cpu", None)
    init = train_target.init_weights(config, 0, "cpu")
    assert set(w) == set(init) and names == {k: k for k in w}
    assert all(torch.equal(w[k], init[k]) for k in init)
    ids = torch.randint(0, config["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    logits = model.logits(ids[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    for k, p in w.items():  # the weights handed to the optimiser are the ones the forward ran
        assert p.grad is not None and p.grad.abs().sum() > 0, k


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
    # evaluate runs the target verifying the draft's blocks step by step and raises when the
    # output differs from plain greedy decoding; it taps as a server would, so below the last
    # layer: the shifted case reads [0, 1] (4.61 tokens/forward there, 5.0 unshifted)
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
