"""The tiny M3 trained on the word chain (``m3-chain-target``) and the DSpark draft distilled
against it (``dspark-m3-chain``): the target follows its chain, the draft reaches several tokens
per forward where the random draft gets none, and the trainer/distiller pieces that made them
refuse what they cannot do."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from dspark_training import distill, train_target
from dspark_training.m3_target import M3Target
from sgl_atom.cpu_mode import cache_dir
from sgl_atom.testing import ASSETS, DSPARK_M3_CHAIN, tiny

M3_CHAIN = ASSETS / "m3-chain-target"
MIN_TPF = 4.0  # the distilled draft measures 4.8-5.3 at k=4 on held-out word prompts x 48 tokens
MIN_OVER_RANDOM = 1.0

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target() -> M3Target:
    return M3Target.load(M3_CHAIN)


@pytest.fixture(scope="module")
def m3_base():
    return tiny.build(cache_dir() / "tiny" / "m3", "m3", log=lambda _: None)


def _names(path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_chain_target_follows_its_chain(target, m3_base):
    info = json.loads((M3_CHAIN / train_target.INFO_FILE).read_text())  # the chain's seed
    # the served layout: the m3 kind's tensor names (MoE under block_sparse_moe) and config
    assert _names(M3_CHAIN) == _names(m3_base)
    assert json.loads((M3_CHAIN / "config.json").read_text()) == json.loads(
        (m3_base / "config.json").read_text()
    )
    chain = train_target.WordChain(info["chain_seed"], target.tokenizer)
    follow = train_target.greedy_follow(target, chain, distill.held_out_word_prompts(8), 48)
    assert follow["exact_share"] == 1.0, follow


def test_chain_draft_reaches_two_tokens_per_forward(target, m3_base):
    es = distill.EvalSet.build("words", target, distill.held_out_word_prompts(16), 4, 48)
    cfg, w = distill.load_draft(DSPARK_M3_CHAIN)
    assert cfg.block_size == 4 and cfg.target_layer_ids == (1, 2)
    trained = distill.measure(target, cfg, w, es, k=4)
    assert trained["prompts"] == 16 and trained["tokens_per_forward"] >= MIN_TPF, trained
    random_dir = tiny.build(cache_dir() / "tiny" / "m3-dspark", "m3-dspark", log=lambda _: None)
    random = distill.measure(target, *distill.load_draft(random_dir), es, k=4)
    gain = trained["tokens_per_forward"] - random["tokens_per_forward"]
    assert gain >= MIN_OVER_RANDOM, (trained, random)


def test_draft_init_from_an_m3_target_is_refused(target):
    cfg, w = distill.load_draft(DSPARK_M3_CHAIN)
    with pytest.raises(ValueError, match=r"this target is M3Target: .* --init draft"):
        distill.init_from_target(dict(w), cfg, target)


def test_m3_training_longer_than_dense_exact_is_refused(tmp_path, m3_base):
    with pytest.raises(SystemExit, match=r"--seq-len 300: .* only up to 256 tokens"):
        train_target.main(["--base", str(m3_base), "--out", str(tmp_path), "--seq-len", "300"])


def test_m3_init_model_trains_the_checkpoint_tensors(m3_base):
    config = json.loads((m3_base / "config.json").read_text())
    model, w, names = train_target.init_model(config, m3_base, 0, "cpu", None)
    assert isinstance(model, M3Target)
    assert set(names.values()) == _names(m3_base)  # saved back under the checkpoint's names
    assert all(t.requires_grad for t in w.values())
    assert any(".block_sparse_moe." in src and ".mlp." in k for k, src in names.items())


def test_chain_kind_copies_the_committed_target(tmp_path):
    out = tiny.build(tmp_path / "m3-chain", "m3-chain", log=lambda _: None)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (out / name).read_bytes() == (M3_CHAIN / name).read_bytes()
