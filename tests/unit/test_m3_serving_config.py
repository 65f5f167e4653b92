"""Serving-side pieces of the MiniMax-M3 model: checkpoint variants (config overrides over the
same weights) and the patch that keeps SGLang's MiniMax sparse wrapper off the atom backend."""

from __future__ import annotations

import json

import pytest

from sgl_atom.attention.backend import AtomAttnBackend
from sgl_atom.attention.sparse import SparseConfig
from sgl_atom.models.minimax_m3 import MiniMaxM3SparseForCausalLM
from sgl_atom.patches.m3_atom_unwrapped import wrap_unless_atom_serves_sparse
from sgl_atom.testing import tiny


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny.build(tmp_path_factory.mktemp("m3") / "m3", "m3", log=lambda _: None)


def _cfg(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_variant_overrides_the_config_and_keeps_the_weights(ckpt, tmp_path):
    out = tiny.m3_variant(ckpt, tmp_path / "topk4", {"sparse_topk_blocks": 4}, head_dim=128)
    base, cfg = _cfg(ckpt), _cfg(out)
    assert cfg["sparse_attention_config"]["sparse_topk_blocks"] == 4
    assert {k: v for k, v in cfg.items() if k != "sparse_attention_config"} == {
        k: v for k, v in base.items() if k != "sparse_attention_config"
    }
    for name in ("model.safetensors", "tokenizer.json"):
        assert (out / name).read_bytes() == (ckpt / name).read_bytes()
    stamp = (out / tiny.STAMP).stat().st_mtime_ns
    assert tiny.m3_variant(ckpt, out, {"sparse_topk_blocks": 4}, head_dim=128) == out
    assert (out / tiny.STAMP).stat().st_mtime_ns == stamp, "an unchanged variant was rebuilt"
    tiny.m3_variant(ckpt, out, {"sparse_topk_blocks": 5})
    assert _cfg(out)["sparse_attention_config"]["sparse_topk_blocks"] == 5


def test_all_dense_variant_has_no_sparse_layer(ckpt, tmp_path):
    layers = _cfg(ckpt)["num_hidden_layers"]
    zeros = [0] * layers
    out = tiny.m3_variant(
        ckpt,
        tmp_path / "dense",
        {"sparse_attention_freq": zeros, "sparse_disable_index_value": zeros},
    )
    cfg = _cfg(out)
    sc = SparseConfig.from_hf(cfg, cfg["num_key_value_heads"], cfg["head_dim"])
    assert sc.sparse_layer_ids == () and not sc.ordinal_of
    from sglang.srt.configs.model_config import get_minimax_sparse_layer_ids

    assert get_minimax_sparse_layer_ids(cfg["sparse_attention_config"]) == (
        list(range(layers)),
        [],
    )


class _Runner:
    def __init__(self, model):
        self.model = model


class _UpstreamM3:
    """Stands in for SGLang's own M3 class: no SERVES_SPARSE_ON_ATOM flag."""


def _original(runner, backend):
    return ("wrapped", backend)


def test_atom_backend_of_our_m3_is_not_wrapped():
    atom = AtomAttnBackend.__new__(AtomAttnBackend)
    ours = MiniMaxM3SparseForCausalLM.__new__(MiniMaxM3SparseForCausalLM)
    assert wrap_unless_atom_serves_sparse(_original, _Runner(ours), atom) is atom


@pytest.mark.parametrize("case", ["upstream_model", "other_backend", "no_model"])
def test_everything_else_is_wrapped_as_before(case):
    atom = AtomAttnBackend.__new__(AtomAttnBackend)
    ours = MiniMaxM3SparseForCausalLM.__new__(MiniMaxM3SparseForCausalLM)
    runner, backend = {
        "upstream_model": (_Runner(_UpstreamM3()), atom),
        "other_backend": (_Runner(ours), object()),
        "no_model": (object(), atom),
    }[case]
    assert wrap_unless_atom_serves_sparse(_original, runner, backend) == ("wrapped", backend)
