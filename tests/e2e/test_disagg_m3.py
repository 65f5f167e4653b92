"""P/D of sgl_atom's MiniMax-M3 model over the atom transfer backend, sparse index keys included.

The tiny ``m3`` checkpoint with ``sparse_topk_blocks`` 3 (init block + local block + one block
chosen by its index score), fp8 KV (so fp8 index keys with per-token scales), the atom attention
backend. SGLang keeps an M3 model's K/V in a ``MiniMaxSparseKVPool``; the atom backend keeps its
own index cache beside it, written by sparse layers 1 and 3 (layer 2 reuses layer 1's
selection). The atom transfer backend moves, per request page, every layer's K/V and fp8 scales
and the index keys and scales of layers 1 and 3. The long prompts reach a fourth 128-token
block, so every decode step on the decode server chooses one of at least 2 middle blocks by the
index keys the prefill server computed and moved (the tiny kind's own top-k of 2 is init + local
only: no choice at all).

One module-scoped set of processes on 127.0.0.1, started together: a unified server (the
reference), and a prefill and a decode server behind SGLang's PD router. The atom backend's
kernels (paged and sparse) run as their torch references (``SGL_ATOM_CPU_KERNELS=reference``).
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from e2e_utils import word_prompts
from test_disagg_serving import DECODE_ARGS, DECODE_ENV, PD_ENV, prefill_args

from sgl_atom.cpu_mode import cache_dir
from sgl_atom.testing import tiny
from sgl_atom.testing.router import Router
from sgl_atom.testing.server import Server, free_port

TOPK = 3  # init + local + one block chosen by index score
LONG_MIN_TOKENS = TOPK * 128 + 16  # a 4th block: 2 candidates for the 1 scored choice
NUM_LONG, NUM_SHORT, MAX_NEW = 2, 6, 16
ARGS = [
    "--dtype",
    "bfloat16",
    "--attention-backend",
    "atom",
    "--kv-cache-dtype",
    "fp8_e4m3",
    "--chunked-prefill-size",
    "256",
]
ENV = {"SGL_ATOM_CPU_KERNELS": "reference", "SGLANG_EXTERNAL_MODEL_PACKAGE": "sgl_atom.models"}
# 4 layers x (K, V, K scale, V scale) + layers 1 and 3 x (index key, index scale)
KINDS = "target_k 4, target_v 4, k_scale 4, v_scale 4, index_k 2, index_scale 2"


@dataclass
class M3PD:
    unified: Server
    prefill: Server
    decode: Server
    router: Router


@pytest.fixture(scope="module")
def model():
    base = tiny.build(cache_dir() / "tiny" / "m3", "m3")
    return tiny.m3_variant(
        base, cache_dir() / "tiny" / f"m3-topk{TOPK}", {"sparse_topk_blocks": TOPK}
    )


@pytest.fixture(scope="module")
def prompts(model) -> list[str]:
    """NUM_LONG prompts of at least LONG_MIN_TOKENS tokens, then NUM_SHORT short ones."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    words = " ".join(word_prompts(80, seed=41, min_words=20, max_words=40)).split()
    long, start = [], 0
    for _ in range(NUM_LONG):
        end = start + LONG_MIN_TOKENS // 2
        while len(tok(" ".join(words[start:end]))["input_ids"]) < LONG_MIN_TOKENS:
            end += 8
        long.append(" ".join(words[start:end]))
        start = end
    return long + word_prompts(NUM_SHORT, seed=42, min_words=3, max_words=24)


@pytest.fixture(scope="module")
def m3pd(servers, model):
    bp = free_port()
    jobs = {
        "m3-unified": (ARGS, {**PD_ENV, **ENV}),
        "m3-prefill": ([*ARGS, *prefill_args(bp)], {**PD_ENV, **ENV}),
        "m3-decode": ([*ARGS, *DECODE_ARGS], {**DECODE_ENV, **ENV}),
    }
    started = servers.start_many({n: (model, *job) for n, job in jobs.items()})
    router = Router([(started["m3-prefill"].url, bp)], [started["m3-decode"].url])
    try:
        router.start()
        yield M3PD(started["m3-unified"], started["m3-prefill"], started["m3-decode"], router)
    finally:
        router.stop()


@pytest.fixture(scope="module")
def outputs(m3pd, prompts) -> tuple[list[list[int]], list[list[int]], float]:
    """Greedy ids from the unified server and through the router (side by side), and the time."""
    params = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}

    def one(prompt: str) -> list[int]:
        out = m3pd.router.post("/generate", {"text": prompt, "sampling_params": params})
        return out["output_ids"]

    t0 = time.time()
    with ThreadPoolExecutor(len(prompts) + 1) as ex:
        unified = ex.submit(m3pd.unified.generate, prompts, max_new_tokens=MAX_NEW)
        got = list(ex.map(one, prompts))
        expected = [o["output_ids"] for o in unified.result()]
    return got, expected, time.time() - t0


def test_router_prefill_decode_matches_unified(outputs, prompts, model, report):
    from transformers import AutoTokenizer

    got, expected, elapsed = outputs
    lens = [len(AutoTokenizer.from_pretrained(model)(p)["input_ids"]) for p in prompts]
    assert sum(n >= LONG_MIN_TOKENS for n in lens) == NUM_LONG
    same = sum(a == b for a, b in zip(got, expected, strict=True))
    report(
        f"P/D atom TP1->TP1 m3 (topk {TOPK}, fp8 KV and index keys): {same}/{len(prompts)} "
        f"greedy outputs ({MAX_NEW} tokens) equal unified in {elapsed:.1f}s; prompt tokens {lens}"
    )
    assert got == expected


def test_logs_name_the_index_regions(outputs, m3pd):
    for srv in (m3pd.prefill, m3pd.decode):
        log = srv.log_text()
        assert f"regions by kind: {KINDS}" in log, f"{srv.name}:\n{srv.log_tail()}"
    log = m3pd.prefill.log_text()
    assert re.search(r"accepted decode rank tp 0/1 .*: 20 region pairs, replicated,whole", log)
    assert "layers [1, 3] write index keys" in m3pd.decode.log_text()
