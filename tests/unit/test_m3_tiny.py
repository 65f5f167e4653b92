"""The ``m3`` tiny checkpoint (config and weight names SGLang's MiniMaxM3 reads) and its
pure-torch reference forward."""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import textwrap

import pytest
import torch

from sgl_atom.attention.sparse import SparseConfig
from sgl_atom.testing import tiny

PROMPT_TOKENS = 300  # three 128-token blocks: the middle one is skipped with topk 2


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny.build(tmp_path_factory.mktemp("m3") / "m3", "m3", log=lambda _: None)


@pytest.fixture(scope="module")
def cfg(ckpt):
    return json.loads((ckpt / "config.json").read_text())


def _sha(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_build_is_small_and_deterministic(ckpt, tmp_path):
    assert (ckpt / "model.safetensors").stat().st_size < 4 * 2**20
    again = tiny.build(tmp_path / "m3", "m3", log=lambda _: None)
    assert _sha(again) == _sha(ckpt)
    assert (again / "config.json").read_text() == (ckpt / "config.json").read_text()


def test_config_parses(cfg):
    assert cfg["architectures"] == ["MiniMaxM3SparseForCausalLM"]
    sc = SparseConfig.from_hf(cfg, cfg["num_key_value_heads"], cfg["head_dim"])
    assert sc.sparse_layer_ids == (1, 2, 3) and sc.topk_blocks == 2
    assert (sc.init_blocks, sc.local_blocks, sc.index_dim) == (1, 1, 128)
    assert sc.use_index_cache and [sc.scores(i) for i in (1, 2, 3)] == [True, False, True]
    assert cfg["max_position_embeddings"] >= (sc.topk_blocks + 1) * 128 + PROMPT_TOKENS
    assert 0 in cfg["moe_layer_freq"] and 1 in cfg["moe_layer_freq"]
    from sglang.srt.configs.model_config import get_minimax_sparse_layer_ids

    dense, sparse = get_minimax_sparse_layer_ids(cfg["sparse_attention_config"])
    assert (dense, sparse) == ([0], [1, 2, 3])


def _load_weights_stacked_mapping() -> list[tuple[str, str]]:
    """(param, checkpoint) substrings of every ``stacked_params_mapping`` literal in
    MiniMaxM3SparseForCausalLM.load_weights, read from its source."""
    from sglang.srt.models.minimax_m3 import MiniMaxM3SparseForCausalLM

    src = textwrap.dedent(inspect.getsource(MiniMaxM3SparseForCausalLM.load_weights))
    pairs = []
    for node in ast.walk(ast.parse(src)):
        target = getattr(node, "target", None) or (getattr(node, "targets", None) or [None])[0]
        if getattr(target, "id", None) == "stacked_params_mapping":
            pairs += [(p, c) for p, c, _ in ast.literal_eval(node.value)]
    assert len(pairs) >= 8, "load_weights changed shape; re-read it"
    return pairs


def _sglang_params(cfg) -> set[str]:
    """Parameter names MiniMaxM3SparseForCausalLM builds for this config (unquantised, no
    fused shared experts), from its module tree."""
    sparse = cfg["sparse_attention_config"]["sparse_attention_freq"]
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(cfg["num_hidden_layers"]):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {a + n + ".weight" for n in ("qkv_proj", "o_proj", "q_norm", "k_norm")}
        if sparse[i]:
            names |= {a + n + ".weight" for n in ("index_qkv_proj", "index_q_norm", "index_k_norm")}
        m = p + "mlp."
        if not cfg["moe_layer_freq"][i]:
            names |= {m + "gate_up_proj.weight", m + "down_proj.weight"}
            continue
        names |= {m + "gate.weight", m + "e_score_correction_bias"}
        names |= {m + "experts.w13_weight", m + "experts.w2_weight"}
        names |= {m + "shared_experts.gate_up_proj.weight", m + "shared_experts.down_proj.weight"}
    return names


def test_every_weight_name_maps_to_a_sglang_param(ckpt, cfg):
    from safetensors import safe_open
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    stacked = _load_weights_stacked_mapping()
    experts = FusedMoE.make_expert_params_mapping("w1", "w2", "w3", cfg["num_local_experts"])
    params = _sglang_params(cfg)
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and set(names) == set(tiny.m3_weight_shapes(cfg))
    hit = set()
    for name in names:
        name = name.replace(".block_sparse_moe", ".mlp")  # as load_weights does
        match = [(p, c) for p, c in stacked if c in name and "mlp.experts." not in name]
        match = match or [(p, c) for p, c, _, _ in experts if c in name]
        mapped = name.replace(*match[0][::-1]) if match else name
        assert mapped in params, f"{name} -> {mapped} is no MiniMaxM3 parameter"
        hit.add(mapped)
    assert hit == params, f"parameters without a checkpoint weight: {params - hit}"


@pytest.fixture(scope="module")
def prompt(ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    text = " ".join(tiny._corpus(200, seed=5))
    ids = tok(text)["input_ids"][:PROMPT_TOKENS]
    assert len(ids) == PROMPT_TOKENS
    return torch.tensor(ids)


def test_reference_sparse_equals_dense_when_topk_covers_every_block(ckpt, prompt):
    from m3_reference import M3Reference

    wide = M3Reference.load(ckpt, topk_blocks=3)
    trace: dict = {}
    sparse = wide.logprobs(prompt, trace=trace)
    dense = wide.logprobs(prompt, dense=True)
    assert sorted(trace) == [1, 2, 3] and torch.isfinite(sparse).all()
    torch.testing.assert_close(sparse, dense, rtol=1e-10, atol=1e-10)


def test_reference_topk2_skips_blocks(ckpt, prompt):
    from m3_reference import M3Reference

    ref = M3Reference.load(ckpt)
    trace: dict = {}
    logits = ref.forward(prompt, trace=trace)
    dense = ref.forward(prompt, dense=True)
    selected, count = trace[1]
    assert int(count[-1, 0]) == 2 and selected[-1, 0].tolist() == [0, 2]  # block 1 skipped
    head = 256  # tokens in blocks 0-1 see at most init + local blocks: nothing is skipped
    torch.testing.assert_close(logits[:head], dense[:head], rtol=1e-10, atol=1e-10)
    assert (logits[head:] - dense[head:]).abs().max() > 1e-3


def test_reference_scores_pick_free_blocks_and_reused_layers_share(ckpt, prompt):
    from m3_reference import M3Reference

    ref = M3Reference.load(ckpt, init_blocks=0)  # one free slot: the scores decide
    trace: dict = {}
    ref.forward(prompt, trace=trace)
    sel1, _ = trace[1]
    assert trace[2] is trace[1] and trace[3] is not trace[1]  # ordinal 1 reuses ordinal 0
    assert set(sel1[-1].flatten().tolist()) <= {0, 1, 2} and (sel1[-1, :, -1] == 2).all()
    scored = M3Reference.load(ckpt, init_blocks=0, use_index_cache=False)
    own: dict = {}
    scored.forward(prompt, trace=own)
    assert own[2] is not own[1] and torch.equal(own[1][0], sel1)


def test_m3_dspark_draft_fits_the_m3_target(ckpt, cfg, tmp_path):
    from safetensors.torch import load_file

    from sgl_atom.speculative.dspark.config import DSparkDraftConfig
    from sgl_atom.speculative.dspark.weights import check_draft_weights

    draft = tiny.build(tmp_path / "m3-dspark", "m3-dspark", log=lambda _: None)
    hf = json.loads((draft / "config.json").read_text())
    assert hf["architectures"] == ["AtomDSparkDraftModel"]
    d = DSparkDraftConfig.from_hf_dict(hf)
    d.check_target(
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        vocab_size=cfg["vocab_size"],
    )
    assert (d.hidden_size, d.vocab_size) == (cfg["hidden_size"], cfg["vocab_size"])
    assert d.tap_hidden_size == cfg["hidden_size"]
    # taps SGLang-style targets can capture: below the target's last layer
    assert d.target_layer_ids == (1, 2) and max(d.target_layer_ids) < cfg["num_hidden_layers"] - 1
    # an MHA draft (its own pool), head_dim the draft pool and kv_quant kernels serve
    assert d.num_attention_heads == d.num_key_value_heads == 2 and d.head_dim == 64
    check_draft_weights(d, load_file(str(draft / "model.safetensors")))
    assert (draft / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(draft / "tokenizer.json")).id_to_token(d.mask_token_id) == (
        "<pad>"
    )
