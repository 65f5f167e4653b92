"""A server with sgl_atom loaded answers through /generate, OpenAI and the frontend language."""

from __future__ import annotations

import pytest
from e2e_utils import PROMPTS, greedy_texts

from sgl_atom.testing.server import Server, ServerStartError


@pytest.fixture(scope="module")
def tp1(servers, tiny_llama):
    return servers.start(tiny_llama, name="tp1")


@pytest.fixture(scope="module", autouse=True)
def _record_tp1_greedy(tp1, reference_outputs):
    # the parity tests compare against these; computing them here saves a server start
    reference_outputs.setdefault("tp1", greedy_texts(tp1))


def test_plugin_is_loaded_in_every_process(tp1):
    log = tp1.log_text()
    # launcher/tokenizer, scheduler and detokenizer each run register()
    assert log.count("sgl_atom registered:") >= 3, tp1.log_tail()
    # ... and each checks, once SGLang applied the hooks, that every hooked target is wrapped
    for role in ("tokenizer", "scheduler", "detokenizer"):
        assert f"targets wrapped ({role})" in log, tp1.log_tail()


def test_generate_answers(tp1):
    out = tp1.generate(["Hello world"], max_new_tokens=8)[0]
    assert len(out["output_ids"]) == 8 and isinstance(out["text"], str)
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_openai_completions_answer(tp1):
    import openai

    client = openai.OpenAI(base_url=tp1.url + "/v1", api_key="none")
    out = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=6, temperature=0)
    assert out.usage.completion_tokens == 6 and out.choices[0].text
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].message.content


def test_frontend_language_program_returns_text(tp1):
    import sglang as sgl

    @sgl.function
    def qa(s, question):
        s += "Question: " + question + "\nAnswer:"
        s += sgl.gen("answer", max_tokens=8, temperature=0)

    state = qa.run(question="What is the capital of france?", backend=sgl.RuntimeEndpoint(tp1.url))
    assert isinstance(state["answer"], str) and len(state["answer"]) > 0


# each of these crashed the whole server in SGLang 0.5.23 (patches/request_checks)
BAD_REQUESTS = {
    "id-past-vocab": ("/generate", {"input_ids": [1, 600]}, "outside the vocabulary"),
    "id-negative": ("/generate", {"input_ids": [5, -1]}, "outside the vocabulary"),
    "id-2^40": ("/generate", {"input_ids": [2**40]}, "outside the vocabulary"),
    "empty-text": ("/generate", {"text": ""}, "the prompt is empty"),
    "empty-in-batch": ("/generate", {"text": ["Hello world", ""]}, "the prompt is empty"),
    "top-logprobs": (
        "/generate",
        {"text": "Hello", "return_logprob": True, "top_logprobs_num": 100000},
        "top_logprobs_num",
    ),
    "completions-ids": ("/v1/completions", {"model": "m", "prompt": [1, 600]}, "vocabulary"),
    "completions-logprobs": (
        "/v1/completions",
        {"model": "m", "prompt": "Hello", "logprobs": 100000},
        "top_logprobs_num",
    ),
    "top_k": ("/generate", {"text": "Hello", "sampling_params": {"top_k": -5}}, "top_k"),
    "n0": ("/generate", {"text": "Hello", "sampling_params": {"n": 0}}, "n"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_400_and_server_stays_up(tp1, case):
    import requests

    path, payload, needle = BAD_REQUESTS[case]
    if path == "/generate":
        payload = {"sampling_params": {"max_new_tokens": 2}, **payload}
    else:
        payload = {"max_tokens": 2, **payload}
    with pytest.raises(requests.HTTPError) as err:
        tp1.post(path, payload, timeout=60)
    body = err.value.response.text
    assert err.value.response.status_code == 400, body
    assert needle in body, body
    out = tp1.generate(["Hello world"], max_new_tokens=2)[0]  # the server still serves
    assert len(out["output_ids"]) == 2


def test_bad_model_path_fails_with_sglangs_error():
    srv = Server("/nonexistent/sgl-atom-model", ["--max-total-tokens", "1024"], name="bad")
    with pytest.raises(ServerStartError) as err:
        srv.start(timeout=240)
    msg = str(err.value)
    assert "exited with code" in msg and "/nonexistent/sgl-atom-model" in msg
    assert srv.proc.poll() is not None
