"""Requests that would crash SGLang's scheduler are refused by name (patches/request_checks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sgl_atom.patches.request_checks import MAX_N, check_request

VOCAB = 512
MANAGER = SimpleNamespace(model_config=SimpleNamespace(vocab_size=VOCAB))


def _req(**kw):
    base = dict(
        sampling_params={"max_new_tokens": 4},
        return_logprob=False,
        top_logprobs_num=0,
        input_embeds=None,
        image_data=None,
        video_data=None,
        audio_data=None,
    )
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(
    "ids, kw, needle",
    [
        ([1, 600], {}, "token id 600 at position 1, outside the vocabulary [0, 512)"),
        ([5, -1, 7], {}, "token id -1 at position 1"),
        ([2**40], {}, f"token id {2**40} at position 0"),
        ([], {}, "the prompt is empty"),
        ([3], {"return_logprob": True, "top_logprobs_num": VOCAB + 1}, "top_logprobs_num"),
        ([3], {"sampling_params": {"top_k": -2}}, "sampling_params.top_k is -2"),
        ([3], {"sampling_params": {"top_k": 0}}, "sampling_params.top_k is 0"),
        ([3], {"sampling_params": {"n": 0}}, "sampling_params.n is 0"),
        ([3], {"sampling_params": {"n": MAX_N + 1}}, f"sampling_params.n is {MAX_N + 1}"),
    ],
    ids=[
        "id-past-vocab",
        "id-negative",
        "id-2^40",
        "empty",
        "top-logprobs",
        "top_k-2",
        "top_k0",
        "n0",
        "n-cap",
    ],  # fmt: skip
)
def test_refused_naming_the_field(ids, kw, needle):
    with pytest.raises(ValueError) as err:
        check_request(MANAGER, _req(**kw), ids)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    "ids, kw",
    [
        ([0, VOCAB - 1], {}),
        ([3], {"return_logprob": True, "top_logprobs_num": VOCAB}),
        ([3], {"sampling_params": {"top_k": -1, "n": 2}}),
        ([], {"input_embeds": [[0.0, 1.0]]}),  # embeddings instead of tokens
        (None, {}),  # SGLang has not tokenized (embeddings path)
    ],
    ids=["vocab-edges", "top-logprobs-all", "top_k-all-n2", "embeds", "no-ids"],
)
def test_valid_requests_pass(ids, kw):
    check_request(MANAGER, _req(**kw), ids)
