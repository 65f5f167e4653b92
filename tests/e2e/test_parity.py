"""Greedy output is the same with and without sgl_atom, and on several ranks as on one.

An idle SGLang scheduler keeps a core busy, so every server here is stopped before the next one
starts; the TP1 reference comes from test_api's server when that module ran first.
"""

from __future__ import annotations

import pytest
from e2e_utils import MAX_NEW, greedy_texts


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
def test_multi_rank_greedy_equals_tp1(servers, tiny_llama, tp1_greedy, parallel):
    srv = servers.start(tiny_llama, parallel, name="-".join(parallel).strip("-"))
    try:
        got = greedy_texts(srv)
        assert all(len(ids) == MAX_NEW for ids in got)
        assert got == tp1_greedy
    finally:
        srv.stop()
