"""ATOM_DSPARK's verify CUDA graphs capture FULL hidden states (patches.dspark_graph_capture)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.ngram_info import NgramVerifyInput

from sgl_atom.patches import dspark_graph_capture as patch
from sgl_atom.speculative.dspark.algorithm import NAME


def _runner(name: str, draft: bool = False):
    algo = SimpleNamespace(name=name)
    return SimpleNamespace(model_runner=SimpleNamespace(spec_algorithm=algo, is_draft_worker=draft))


def _ngram_input() -> NgramVerifyInput:
    spec = NgramVerifyInput(
        draft_token=None,
        custom_mask=torch.zeros(1, dtype=torch.bool),  # the runner's static mask buffer
        positions=None,
        retrieve_index=None,
        retrieve_next_token=None,
        retrieve_next_sibling=None,
        draft_token_num=5,
    )
    spec.capture_hidden_mode = CaptureHiddenMode.NULL  # what SGLang's runner captures for n-gram
    return spec


def test_atom_dspark_target_graph_captures_full():
    spec = patch.capture_taps(_ngram_input(), _runner(NAME), 40)
    assert spec.capture_hidden_mode == CaptureHiddenMode.FULL


@pytest.mark.parametrize(
    "runner", [_runner("NGRAM"), _runner(NAME, draft=True)], ids=["ngram", "draft"]
)
def test_other_runners_keep_their_capture(runner):
    spec = patch.capture_taps(_ngram_input(), runner, 40)
    assert spec.capture_hidden_mode == CaptureHiddenMode.NULL


def test_no_spec_info_passes_through():
    assert patch.capture_taps(None, _runner(NAME), 8) is None
