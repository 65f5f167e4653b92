"""sgl_atom's MiniMaxM3SparseForCausalLM on a real server (atom backend, bf16, CPU) against the
float64 reference forward of the tiny ``m3`` checkpoint.

The prompt (420 tokens) is longer than (topk + local) blocks of 128 tokens and is prefilled in
256-token chunks, so the second chunk's sparse layers read the first chunk's index keys and
drop blocks. Decoding after it brings the sparse path to its first log line of block counts.
"""

from __future__ import annotations

import re

import pytest
import torch
from e2e_utils import greedy_from_ids, teacher_forced_logprobs, word_prompts

from sgl_atom.cpu_mode import cache_dir
from sgl_atom.models.m3_reference import M3Reference
from sgl_atom.testing import tiny
from sgl_atom.testing.server import Server

PROMPT_TOKENS = 420
# bf16 server vs float64 reference. Nearly every position agrees to ~1e-2; a token whose
# expert routing is a near-tie (top-2 vs third score within ~1e-3) can pick another expert
# in bf16 and move by ~0.16, so the bound on the maximum is looser than on the bulk.
TOL_BULK, BULK_FRACTION, TOL_MAX = 0.03, 0.99, 0.3
# enough decode steps for the sparse path's first log line (every 64 sparse layer steps;
# 3 sparse layers per forward)
DECODE_TOKENS = 24
ARGS = ["--dtype", "bfloat16", "--attention-backend", "atom", "--chunked-prefill-size", "256"]
SKIP_LINE = re.compile(r"(\d+) of (\d+) visible \(token, head\) blocks attended, (\d+) skipped")


@pytest.fixture(scope="module")
def model():
    return tiny.build(cache_dir() / "tiny" / "m3", "m3")


@pytest.fixture(scope="module")
def prompt(model) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    text = " ".join(word_prompts(40, seed=3, min_words=20, max_words=40))
    ids = tok(text)["input_ids"][:PROMPT_TOKENS]
    assert len(ids) == PROMPT_TOKENS
    return ids


@pytest.fixture(scope="module")
def served(servers, model, prompt) -> tuple[list[float], Server]:
    srv = servers.start(model, ARGS, env={"SGLANG_EXTERNAL_MODEL_PACKAGE": "sgl_atom.models"})
    logprobs = teacher_forced_logprobs(srv, [prompt])[0]
    greedy_from_ids(srv, [prompt], DECODE_TOKENS)
    return logprobs, srv


def test_logprobs_match_reference(served, model, prompt, report):
    got = torch.tensor(served[0], dtype=torch.float64)
    ref = M3Reference.load(model).logprobs(torch.tensor(prompt))
    err = (got - ref).abs()
    bulk = (err <= TOL_BULK).double().mean().item()
    report(
        f"m3 bf16 server vs float64 reference ({PROMPT_TOKENS} tokens): max |dlogp| "
        f"{err.max():.4f}, mean {err.mean():.4f}, within {TOL_BULK}: {bulk:.1%}"
    )
    assert bulk >= BULK_FRACTION, f"only {bulk:.1%} of positions within {TOL_BULK}"
    assert err.max() <= TOL_MAX, f"max |dlogp| {err.max():.4f} at {int(err.argmax())}"


def test_sparse_layers_skip_blocks(served, model, report):
    cfg = M3Reference.load(model).sparse
    assert PROMPT_TOKENS > (cfg.topk_blocks + cfg.local_blocks) * 128
    lines = SKIP_LINE.findall(served[1].log_text())
    assert lines, "the sparse path logged no block counts"
    attended, visible, skipped = map(int, lines[-1])
    report(f"m3 sparse layers: {attended} of {visible} visible blocks attended, {skipped} skipped")
    assert skipped > 0 and attended + skipped == visible
