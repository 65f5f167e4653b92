"""ATOM_DSPARK's target-verify CUDA graphs capture the hidden states its draft reads.

ATOM_DSPARK verifies through SGLang's n-gram path (its spec class answers ``is_ngram()``), and
SGLang 0.5.23's decode graph runner captures an n-gram verify graph with
``CaptureHiddenMode.NULL``. The worker's verify forward asks for ``FULL`` (the draft writes its
context K/V from the target's tapped layers of every verified token), so the first replay
failed: "The runtime hidden-state mode exceeds the fixed CUDA graph capture mode (NULL)". An
AFTER hook on the runner's ``get_spec_info`` raises the captured mode to ``FULL`` for the target
runner of ATOM_DSPARK, as SGLang does for its own DFlash family; every other algorithm's capture
is unchanged. Ledger: ``sgl_atom.patches.LEDGER``.
"""

from __future__ import annotations

from typing import Any

from . import register_once

TARGET = (
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.get_spec_info"
)


def is_atom_dspark_target(runner: Any) -> bool:
    """The graph runner of an ATOM_DSPARK server's target model (not of a draft worker)."""
    from ..speculative.dspark.algorithm import NAME

    model_runner = getattr(runner, "model_runner", None)
    algo = getattr(model_runner, "spec_algorithm", None)
    if algo is None or getattr(model_runner, "is_draft_worker", False):
        return False
    return getattr(algo, "name", None) == NAME


def capture_taps(spec_info: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook: the n-gram verify input of an ATOM_DSPARK target graph captures FULL."""
    if spec_info is not None and is_atom_dspark_target(runner):
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

        spec_info.capture_hidden_mode = CaptureHiddenMode.FULL
    return spec_info


def install() -> None:
    register_once(TARGET, capture_taps, "after")
