"""Greedy output is the same with and without sgl_atom, and on several ranks as on one.

An idle SGLang scheduler keeps a core busy, so every server here is stopped before the next one
starts; the TP1 reference comes from test_api's server when that module ran first.
"""

from __future__ import annotations

import pytest
from e2e_utils import MAX_NEW, PROMPTS, greedy_texts

# Ranks split the matmuls, so sums round in another order: on this random tiny checkpoint a
# greedy choice whose top two log-probs lie closer than this may flip, and only such a choice.
NEAR_TIE = 0.02


@pytest.fixture(scope="module")
def tp1_greedy(servers, tiny_llama, reference_outputs):
    if "tp1" not in reference_outputs:
        srv = servers.start(tiny_llama, name="tp1-reference")
        try:
            reference_outputs["tp1"] = greedy_texts(srv)
        finally:
            srv.stop()
    return reference_outputs["tp1"]


def test_greedy_output_same_without_plugin(servers, tiny_llama, tp1_greedy):
    bare = servers.start(tiny_llama, name="no-plugin", with_plugin=False)
    try:
        assert "sgl_atom registered" not in bare.log_text()
        assert greedy_texts(bare) == tp1_greedy
    finally:
        bare.stop()


@pytest.mark.parametrize("parallel", [["--tp", "2"], ["--pp-size", "2"]], ids=["tp2", "pp2"])
def test_multi_rank_greedy_equals_tp1(servers, tiny_llama, tp1_greedy, parallel, report):
    srv = servers.start(tiny_llama, parallel, name="-".join(parallel).strip("-"))
    try:
        got = greedy_texts(srv)
        assert all(len(ids) == MAX_NEW for ids in got)
        gaps = _divergence_gaps(srv, tiny_llama, tp1_greedy, got)
    finally:
        srv.stop()
    report(f"{' '.join(parallel)} vs TP1: {len(PROMPTS) - len(gaps)}/{len(PROMPTS)} greedy "
           f"outputs identical; top-1 minus TP1's token where they part: {gaps}")  # fmt: skip
    assert all(g < NEAR_TIE for g in gaps), gaps
    assert len(gaps) <= 1


def _divergence_gaps(srv, model, want: list[list[int]], got: list[list[int]]) -> list[float]:
    """For each output that parts from ``want``: on ``srv``, given the common prefix, how far
    ``want``'s token lies below the best one (0 at an exact tie)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    gaps = []
    for prompt, a, b in zip(PROMPTS, want, got, strict=True):
        j = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if j is None:
            continue
        ids = tok(prompt)["input_ids"] + a[: j + 1]
        out = srv.post(
            "/generate",
            {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "return_logprob": True,
                "logprob_start_len": len(ids) - 2,
                "top_logprobs_num": 1,
            },
        )
        meta = out["meta_info"]
        best = meta["input_top_logprobs"][-1][0][0]
        mine = meta["input_token_logprobs"][-1][0]
        gaps.append(round(best - mine, 4))
    return gaps
