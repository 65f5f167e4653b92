"""The P/D headline: router + a PP2 prefill (TP1 stages) + a TP2 decode, sgl_atom's MiniMax-M3
model with its distilled DSpark draft at fp8 under the bf16 target, over the atom transfer backend.

The ``m3-chain`` checkpoint (the tiny M3 architecture trained on the word chain, so its greedy
choices are clear of near-ties) with ``sparse_topk_blocks`` 3 (init block + local block + one
block chosen by its index score), fp8 KV (so fp8 index keys with per-token scales), the atom
attention backend, ATOM_DSPARK with the ``dspark-m3-chain`` draft distilled against it (taps 1
and 2, its own fp8 pool). SGLang keeps an M3 model's K/V in a ``MiniMaxSparseKVPool``; the atom
backend keeps its own index cache beside it, written by sparse layers 1 and 3 (layer 2 reuses
layer 1's selection).

The prefill's stages hold layers 0..1 and 2..3: stage 0 hands layer 1's block selection to stage
1 with the hidden states, and stage 1 (both taps, the draft) writes the draft's context K/V. Each
stage writes both decode ranks their one KV head of two of its layers, the index keys and scales
of its index-writing layer whole, and stage 1 the whole draft (2 layers x K, V and fp8 scales)
to each decode rank, where the draft runs whole. The long prompts reach a fourth 128-token
block, so every decode step on the decode server chooses one of at least 2 middle blocks by the
index keys the prefill computed and moved.

One module-scoped set of processes on 127.0.0.1, started together: a unified ATOM_DSPARK server
(the reference), and the prefill and decode behind SGLang's PD router. The atom backend's
kernels (paged and sparse) run as their torch references (``SGL_ATOM_CPU_KERNELS=reference``).
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from e2e_utils import teacher_forced_logprobs, word_prompts
from test_disagg_serving import DECODE_ARGS, PD_ENV, _tpf

from sgl_atom import envs
from sgl_atom.cpu_mode import cache_dir
from sgl_atom.speculative.dspark.algorithm import NAME
from sgl_atom.testing import DSPARK_M3_CHAIN, tiny
from sgl_atom.testing.pd import prefill_args
from sgl_atom.testing.router import Router
from sgl_atom.testing.server import Server, free_port

TOPK = 3  # init + local + one block chosen by index score
LONG_MIN_TOKENS = TOPK * 128 + 16  # a 4th block: 2 candidates for the 1 scored choice
NUM_LONG, NUM_SHORT, MAX_NEW = 2, 14, 16
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
# per stage: 2 layers x (K, V, K scale, V scale) + its index-writing layer x (index key, scale);
# the last stage then the fp8 draft's 2 layers x (K, V, K scale, V scale)
STAGE_KINDS = "target_k 2, target_v 2, k_scale 2, v_scale 2, index_k 1, index_scale 1"
DRAFT_KINDS = "draft_k 2, draft_v 2, draft_k_scale 2, draft_v_scale 2"


@dataclass
class M3PD:
    unified: Server
    prefill: Server
    decode: Server
    router: Router


@pytest.fixture(scope="module")
def model():
    base = tiny.build(cache_dir() / "tiny" / "m3-chain", "m3-chain")
    return tiny.m3_variant(
        base, cache_dir() / "tiny" / f"m3-chain-topk{TOPK}", {"sparse_topk_blocks": TOPK}
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
    draft = str(DSPARK_M3_CHAIN)
    spec = [*ARGS, "--speculative-algorithm", NAME, "--speculative-draft-model-path", draft]
    spec += ["--spec-decode-kv-cache-dtype", "fp8"]
    bp = free_port()
    jobs = {
        "m3-unified": (spec, {**PD_ENV, **ENV}),
        "m3-pp2-prefill": ([*spec, *prefill_args(bp), "--pp-size", "2"], {**PD_ENV, **ENV}),
        # SGLang's own decode heartbeat at its defaults: no prefill is killed here
        "m3-tp2-decode": ([*spec, *DECODE_ARGS, "--tp", "2"], {**PD_ENV, **ENV}),
    }
    # five scheduler ranks start at once on two cores: allow them twice the time
    started = servers.start_many(
        {n: (model, *job) for n, job in jobs.items()},
        timeout=2 * envs.SGL_ATOM_SERVER_TIMEOUT.get(),
    )
    prefill, decode = started["m3-pp2-prefill"], started["m3-tp2-decode"]
    router = Router([(prefill.url, bp)], [decode.url])
    try:
        router.start()
        yield M3PD(started["m3-unified"], prefill, decode, router)
    finally:
        router.stop()


@pytest.fixture(scope="module")
def outputs(m3pd, prompts) -> tuple[list[dict], list[dict], float]:
    """Outputs from the router and the unified server (side by side), and the time."""
    params = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}

    def one(prompt: str) -> dict:
        return m3pd.router.post("/generate", {"text": prompt, "sampling_params": params})

    t0 = time.time()
    with ThreadPoolExecutor(len(prompts) + 1) as ex:
        unified = ex.submit(m3pd.unified.generate, prompts, max_new_tokens=MAX_NEW)
        got = list(ex.map(one, prompts))
        expected = unified.result()
    return got, expected, time.time() - t0


def test_router_prefill_decode_matches_unified(outputs, m3pd, prompts, model, report):
    from transformers import AutoTokenizer

    got, expected, elapsed = outputs
    lens = [len(AutoTokenizer.from_pretrained(model)(p)["input_ids"]) for p in prompts]
    assert sum(n >= LONG_MIN_TOKENS for n in lens) == NUM_LONG
    ids, ref = [o["output_ids"] for o in got], [o["output_ids"] for o in expected]
    same = sum(a == b for a, b in zip(ids, ref, strict=True))
    tpf_pd, tpf_unified = _tpf(got), _tpf(expected)
    report(
        f"P/D atom PP2->TP2 m3 + ATOM_DSPARK (topk {TOPK}, fp8 KV and index keys, fp8 draft "
        f"pools): {same}/{len(prompts)} greedy outputs ({MAX_NEW} tokens) equal unified in "
        f"{elapsed:.1f}s; tokens/forward P/D {tpf_pd:.2f}, unified {tpf_unified:.2f}; prompt "
        f"tokens {lens}"
    )
    # the draft context came over: the decode side drafts as well as unified does
    assert tpf_pd >= 4.0 and tpf_unified >= 4.0  # measured 5.33 on both
    assert abs(tpf_pd - tpf_unified) <= 0.15 * tpf_unified + 0.1
    if ids != ref:
        tok = AutoTokenizer.from_pretrained(model)
        gaps = _first_divergence_gaps(m3pd.unified, tok, prompts, ids, ref)
        pytest.fail(
            f"{len(gaps)} of {len(prompts)} P/D outputs differ from unified; the reference's "
            f"top-2 log-prob gap where each first differs: {[round(g, 4) for g in gaps]}"
        )


def _first_divergence_gaps(srv, tok, prompts, ids, ref) -> list[float]:
    """For each output that differs from the reference: the reference's top-2 log-prob gap at
    the first differing token (teacher-forced on prompt + the reference's tokens so far)."""
    sequences, where = [], []
    for prompt, a, b in zip(prompts, ids, ref, strict=True):
        if a == b:
            continue
        d = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        prompt_ids = tok(prompt)["input_ids"]
        sequences.append(prompt_ids + b[: d + 1])
        where.append(len(prompt_ids) + d)
    _, gaps = teacher_forced_logprobs(srv, sequences, top=2)
    return [g[i] for g, i in zip(gaps, where, strict=True)]


def test_logs_name_the_regions_of_each_stage(outputs, m3pd):
    log = m3pd.prefill.log_text()
    assert f"regions by kind: {STAGE_KINDS}" in log, log[-3000:]
    assert f"regions by kind: {STAGE_KINDS}, {DRAFT_KINDS}" in log, log[-3000:]
    # each stage writes each decode rank its head of every K/V page (split) and the index keys
    # whole; the last stage also the whole draft
    accepted = re.findall(r"accepted decode rank tp ([01])/2 .*: (\d+) region pairs, (\S+)", log)
    pairs = sorted((rank, int(n)) for rank, n, _ in accepted)
    assert pairs == [("0", 10), ("0", 18), ("1", 10), ("1", 18)], accepted
    assert all("split" in modes and "replicated" in modes for _, _, modes in accepted), accepted
    assert "layers [1, 3] write index keys" in m3pd.decode.log_text()
