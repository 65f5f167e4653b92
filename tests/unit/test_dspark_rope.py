"""The DSpark draft's RoPE: its tables against SGLang's own ``get_rope`` caches for every
scaling type it takes, the refusals of the others, and the scaling reaching the served draft."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from sgl_atom.speculative.dspark import reference as ref
from sgl_atom.speculative.dspark import rope
from sgl_atom.speculative.dspark.config import DSparkConfigError, DSparkDraftConfig

HEAD_DIM, THETA, MAX_POS, N = 64, 500000.0, 8192, 4096
SCALINGS = {
    "none": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    },
    "yarn": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 16,
        "beta_slow": 2,
        "mscale": 1.0,
        "mscale_all_dim": 0.7,
        "attn_factor": 1.1,
    },
}

# SGLang's caches, computed where SGLang takes the CPU as its device (its rotary modules pick
# their kernels when imported)
_SGLANG = f"""
import json, sys, torch
from sglang.srt.layers.rotary_embedding import get_rope
out = {{}}
for name, scaling in json.loads(sys.argv[1]).items():
    r = get_rope({HEAD_DIM}, {HEAD_DIM}, {MAX_POS}, {THETA}, True, scaling, dtype=torch.float32)
    out[name] = r.cos_sin_cache[:{N}].tolist()
print(json.dumps(out))
"""


def _hf(**over) -> dict:
    d = {
        "architectures": ["AtomDSparkDraftModel"],
        "hidden_size": 256,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "head_dim": HEAD_DIM,
        "intermediate_size": 128,
        "vocab_size": 100,
        "block_size": 4,
        "dspark_target_layer_ids": [0],
        "mask_token_id": 3,
        "markov_rank": 8,
        "rope_theta": THETA,
        "max_position_embeddings": MAX_POS,
    }
    return {k: v for k, v in {**d, **over}.items() if v is not None}


@pytest.fixture(scope="module")
def sglang_caches() -> dict[str, torch.Tensor]:
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    run = subprocess.run(
        [sys.executable, "-c", _SGLANG, json.dumps(SCALINGS)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in json.loads(run.stdout).items()}


@pytest.mark.parametrize("name", SCALINGS)
def test_tables_equal_sglangs_rotary_embedding(sglang_caches, name):
    cfg = DSparkDraftConfig.from_hf_dict(_hf(rope_scaling=SCALINGS[name]))
    cos, sin = rope.tables(cfg, torch.arange(N))
    want = sglang_caches[name]  # [N, head_dim]: cos of each frequency, then sin
    half = HEAD_DIM // 2
    # float32 angles in SGLang: its error grows with the position (~N * 2^-24 rad)
    torch.testing.assert_close(cos[:, :half], want[:, :half], rtol=0, atol=2e-3)
    torch.testing.assert_close(sin[:, :half], want[:, half:], rtol=0, atol=2e-3)
    assert torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])
    if name != "none":  # the scaling changes the table: the comparison above has teeth
        plain = sglang_caches["none"]
        assert (plain[:, :half] - want[:, :half]).abs().max() > 0.1


def test_rope_parameters_are_read_like_rope_scaling():
    params = {**SCALINGS["llama3"], "rope_theta": 1e6}
    cfg = DSparkDraftConfig.from_hf_dict(_hf(rope_theta=None, rope_parameters=params))
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling.rope_type == "llama3"
    assert cfg.rope_scaling.original_max_position_embeddings == 1024
    plain = DSparkDraftConfig.from_hf_dict(
        _hf(rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 2e5})
    )
    assert plain.rope_scaling is None and plain.rope_theta == 2e5
    both = DSparkDraftConfig.from_hf_dict(  # rope_scaling wins; the theta is still read
        _hf(rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 3e5},
            rope_scaling=SCALINGS["linear"])
    )  # fmt: skip
    assert both.rope_theta == 3e5 and both.rope_scaling.rope_type == "linear"
    back = DSparkDraftConfig.from_hf_dict(cfg.to_hf_dict())
    assert back == cfg and back.to_hf_dict()["rope_scaling"] == {
        k: v for k, v in SCALINGS["llama3"].items()
    }


@pytest.mark.parametrize(
    "scaling, expected",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, r"rope_type one of default, linear, llama3"),
        ({"factor": 2.0, "type": "longrope"}, r"got 'longrope'"),
        ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.2}, r"attention_factor not"),
        ({"rope_type": "linear", "factor": 0}, r"factor a number > 0, got 0"),
        ({"rope_type": "linear", "factor": True}, r"factor a number > 0, got True"),
        ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192.0},
         r"original_max_position_embeddings an integer > 0"),
        ({"rope_type": "yarn", "factor": 4.0, "truncate": "yes"}, r"truncate true or false"),
        ({"rope_type": "linear"}, r"factor a number > 0, got None"),
        ("linear", r"a dict with rope_type"),
    ],
)  # fmt: skip
def test_unknown_scaling_is_refused_naming_the_field(scaling, expected):
    with pytest.raises(DSparkConfigError, match=r"rope_scaling=.*expected .*" + expected):
        DSparkDraftConfig.from_hf_dict(_hf(rope_scaling=scaling))


def test_the_reference_rotates_with_the_scaled_tables():
    """A rotated head is each frequency pair turned by its table angle: the scaled draft's
    differs from the plain one's where the scaling moves the frequencies."""
    x = torch.randn(N, 1, HEAD_DIM, dtype=torch.float64)
    pos = torch.arange(N)
    scaled = DSparkDraftConfig.from_hf_dict(_hf(rope_scaling=SCALINGS["llama3"]))
    cos, sin = rope.tables(scaled, pos)
    half = HEAD_DIM // 2
    want = torch.cat(
        [x[..., :half] * cos[:, None, :half] - x[..., half:] * sin[:, None, :half],
         x[..., half:] * cos[:, None, :half] + x[..., :half] * sin[:, None, :half]], -1
    )  # fmt: skip
    torch.testing.assert_close(ref.rope(x, pos, scaled), want, rtol=1e-12, atol=1e-12)
    plain = DSparkDraftConfig.from_hf_dict(_hf())
    assert (ref.rope(x, pos, plain) - want).abs().max() > 0.1
