"""Requests that would crash SGLang 0.5.23's scheduler get a 400 naming the field instead.

Upstream, one request can kill the whole server: ``input_ids`` outside the vocabulary (an
IndexError in the embedding), an empty prompt on a tokenizer that adds no BOS (a reshape error
in RoPE), ``top_logprobs_num`` above the vocabulary size (``topk`` out of range). A BEFORE hook
on ``TokenizerManager._validate_one_request`` (run in the HTTP process for every request, also
each one of a batch, before anything reaches a scheduler) raises ``ValueError``, which SGLang's
HTTP layer answers with 400. It also refuses ``top_k`` below -1 or 0 and ``n`` outside
1..``MAX_N``. ``SGL_ATOM_REQUEST_CHECKS=off`` leaves SGLang's own validation alone. Ledger:
``sgl_atom.patches.LEDGER``.
"""

from __future__ import annotations

from typing import Any

from . import register_once

TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
MAX_N = 256  # parallel samples per request


def check_request(manager: Any, obj: Any, input_ids: list[int] | None) -> None:
    """Raise ValueError naming the field when ``obj`` would crash a scheduler."""
    vocab = int(manager.model_config.vocab_size)
    if input_ids is not None:
        _check_ids(obj, input_ids, vocab)
    if getattr(obj, "return_logprob", False):
        top = getattr(obj, "top_logprobs_num", 0) or 0
        if isinstance(top, int) and not 0 <= top <= vocab:
            raise ValueError(
                f"top_logprobs_num (OpenAI 'logprobs'/'top_logprobs') is {top}: it must be "
                f"between 0 and the vocabulary size {vocab}"
            )
    params = getattr(obj, "sampling_params", None)
    if isinstance(params, dict):
        _check_sampling(params)


def _check_ids(obj: Any, input_ids: list[int], vocab: int) -> None:
    has_other_input = any(
        getattr(obj, name, None) is not None
        for name in ("input_embeds", "image_data", "video_data", "audio_data")
    )
    if not input_ids and not has_other_input:
        raise ValueError(
            "the prompt is empty: it has 0 tokens (this model's tokenizer adds no BOS token); "
            "send a non-empty 'text'/'prompt' or at least one token in 'input_ids'"
        )
    if not input_ids:
        return
    lo, hi = min(input_ids), max(input_ids)
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"input_ids holds token id {bad} at position {input_ids.index(bad)}, outside the "
            f"vocabulary [0, {vocab}); send ids the model's tokenizer produced"
        )


def _check_sampling(params: dict) -> None:
    top_k = params.get("top_k")
    if isinstance(top_k, int) and (top_k < -1 or top_k == 0):
        raise ValueError(f"sampling_params.top_k is {top_k}: use -1 (no limit) or at least 1")
    n = params.get("n", 1)
    if isinstance(n, int) and not 1 <= n <= MAX_N:
        raise ValueError(f"sampling_params.n is {n}: ask for 1 to {MAX_N} samples per request")


def validate_before(manager: Any, obj: Any, input_ids: list[int] | None, *a, **kw) -> None:
    """BEFORE hook: check, then let SGLang's own validation run unchanged."""
    check_request(manager, obj, input_ids)


def install() -> None:
    register_once(TARGET, validate_before, "before")
