"""Greedy output is the same with and without sgl_atom, and on several ranks as on one.

The servers start and answer side by side (idle schedulers sleep: ``--sleep-on-idle``); the TP1
reference comes from test_api's server when that module ran first.
"""

from __future__ import annotations

import pytest
from e2e_utils import MAX_NEW, PROMPTS, greedy_texts, side_by_side

from sgl_atom import envs
from sgl_atom.testing.server import plugins_without_sgl_atom

# Ranks split the matmuls, so sums round in another order: on this random tiny checkpoint a
# greedy choice whose top two log-probs lie closer than this may flip, and only such a choice.
NEAR_TIE = 0.02


MULTI_RANK = {"tp2": ["--tp", "2"], "pp2": ["--pp-size", "2"]}


@pytest.fixture(scope="module")
def runs(servers, tiny_llama, reference_outputs) -> dict:
    """Greedy outputs of the TP1 reference (test_api's server's, when that module ran first),
    of a server without sgl_atom, and at TP2 and PP2, the servers started and answering side
    by side; for each multi-rank server, where its outputs part from TP1's, the gaps of
    :func:`_divergence_gaps` (asked of that server)."""
    jobs = {
        "no-plugin": ([], {"SGLANG_PLUGINS": plugins_without_sgl_atom()}),
        **{name: (args, {}) for name, args in MULTI_RANK.items()},
    }
    if "tp1" not in reference_outputs:
        jobs["tp1-reference"] = ([], {})
    # five scheduler ranks start at once on two cores: allow them twice the time
    started = servers.start_many(
        {name: (tiny_llama, args, env) for name, (args, env) in jobs.items()},
        timeout=2 * envs.SGL_ATOM_SERVER_TIMEOUT.get(),
    )
    out = side_by_side(greedy_texts, {name: (srv,) for name, srv in started.items()})
    reference_outputs.setdefault("tp1", out.pop("tp1-reference", None))
    want = reference_outputs["tp1"]
    gaps = side_by_side(
        lambda srv, got: _divergence_gaps(srv, tiny_llama, want, got),
        {name: (started[name], out[name]) for name in MULTI_RANK},
    )
    for srv in started.values():
        srv.stop()
    out["logs"] = {name: srv.log_text() for name, srv in started.items()}
    return {**out, "tp1": want, "gaps": gaps}


def test_greedy_output_same_without_plugin(runs):
    assert "sgl_atom registered" not in runs["logs"]["no-plugin"]
    assert runs["no-plugin"] == runs["tp1"]


@pytest.mark.parametrize("name", MULTI_RANK)
def test_multi_rank_greedy_equals_tp1(runs, name, report):
    got, gaps = runs[name], runs["gaps"][name]
    assert all(len(ids) == MAX_NEW for ids in got)
    same = len(PROMPTS) - len(gaps)
    report(
        f"{' '.join(MULTI_RANK[name])} vs TP1: {same}/{len(PROMPTS)} greedy outputs identical; "
        f"top-1 minus TP1's token where they part: {gaps}"
    )
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
