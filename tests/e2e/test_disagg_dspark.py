"""P/D with the ATOM_DSPARK draft over the atom transfer backend, TP1 -> TP1.

On the word-chain target with the draft distilled against it (4.8 tokens/forward unified), so
"the decode side drafts as well as unified" is a real check. The prefill server runs ATOM_DSPARK
too: it only runs extends, so its worker writes the draft's context K/V into its draft pool and
never proposes; the atom backend exports the draft pool's regions (draft K/V and, at fp8, their
scales, per draft layer) after the target's and moves them with the target's pages, so the
decode server drafts from the first decode step on. One module-scoped set of processes on
127.0.0.1: a unified ATOM_DSPARK server (the reference), a prefill and a decode server (fp8
draft pools) behind SGLang's PD router, and a decode server whose draft pool is bf16 (refused
at handshake).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from e2e_utils import word_prompts
from test_disagg_serving import DECODE_ARGS, PD_ENV, _direct_pd, _join, prefill_args

from sgl_atom.cpu_mode import cache_dir
from sgl_atom.spec.dspark.algorithm import NAME
from sgl_atom.testing import DSPARK_CHAIN, tiny
from sgl_atom.testing.router import Router
from sgl_atom.testing.server import Server, free_port

PROMPTS = word_prompts(16, seed=31, min_words=4, max_words=16)
MAX_NEW = 16
ATOM = ["--attention-backend", "atom", "--chunked-prefill-size", "32"]
SPEC = ["--speculative-algorithm", NAME, "--speculative-draft-model-path", str(DSPARK_CHAIN)]
FP8 = [*ATOM, *SPEC, "--spec-decode-kv-cache-dtype", "fp8"]
BF16 = [*ATOM, *SPEC, "--speculative-draft-kv-cache-dtype", "bf16"]
SPEC_ENV = {"SGL_ATOM_CPU_KERNELS": "reference", "SGLANG_EXTERNAL_MODEL_PACKAGE": "sgl_atom.models"}


@dataclass
class SpecPD:
    unified: Server
    prefill: Server
    bootstrap: int
    decode: Server
    bf16_decode: Server
    router: Router


@pytest.fixture(scope="module")
def spd(servers):
    chain = tiny.build(cache_dir() / "tiny" / "llama-chain", "llama-chain")
    bp = free_port()
    jobs = {
        "dspark-unified": (FP8, {**PD_ENV, **SPEC_ENV}),
        "dspark-prefill": (FP8 + prefill_args(bp), {**PD_ENV, **SPEC_ENV}),
        "dspark-decode": (FP8 + DECODE_ARGS, {**PD_ENV, **SPEC_ENV}),
        "dspark-decode-bf16": (BF16 + DECODE_ARGS, {**PD_ENV, **SPEC_ENV}),
    }
    started = servers.start_many({n: (chain, *job) for n, job in jobs.items()})
    router = Router([(started["dspark-prefill"].url, bp)], [started["dspark-decode"].url])
    try:
        router.start()
        yield SpecPD(
            unified=started["dspark-unified"],
            prefill=started["dspark-prefill"],
            bootstrap=bp,
            decode=started["dspark-decode"],
            bf16_decode=started["dspark-decode-bf16"],
            router=router,
        )
    finally:
        router.stop()


def _tpf(outs: list[dict]) -> float:
    """Mean tokens per target forward: output tokens over verify steps, per request."""
    per = [len(o["output_ids"]) / max(1, o["meta_info"].get("spec_verify_ct", 0)) for o in outs]
    return sum(per) / len(per)


def test_router_prefill_decode_with_draft_matches_unified(spd, report):
    params = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}

    def one(prompt: str) -> dict:
        return spd.router.post("/generate", {"text": prompt, "sampling_params": params})

    # the unified reference and the P/D pair run side by side (all prompts in flight on each)
    t0 = time.time()
    with ThreadPoolExecutor(len(PROMPTS) + 1) as ex:
        unified = ex.submit(spd.unified.generate, PROMPTS, max_new_tokens=MAX_NEW)
        got = list(ex.map(one, PROMPTS))
        expected = unified.result()
    elapsed = time.time() - t0
    same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(got, expected, strict=True))
    tpf_pd, tpf_unified = _tpf(got), _tpf(expected)
    report(
        f"P/D atom TP1->TP1 with ATOM_DSPARK (fp8 draft pools): {same}/{len(PROMPTS)} greedy "
        f"outputs ({MAX_NEW} tokens) equal unified ATOM_DSPARK in {elapsed:.1f}s; tokens/forward "
        f"P/D {tpf_pd:.2f}, unified {tpf_unified:.2f}"
    )
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
    log = spd.prefill.log_text()
    # the tiny llama's 4 fp16 target layers (K, V) come first, then the fp8 draft's 2 layers
    # x (K, V, K scale, V scale)
    assert "16 regions (layers 0..3), 8 of them draft" in log, log[-3000:]
    assert "accepted decode rank tp 0/1" in log
    # the draft context came over: drafting on the decode side accepts as much as unified does
    assert tpf_pd > 1.0
    assert abs(tpf_pd - tpf_unified) <= 0.15 * tpf_unified + 0.1


def test_draft_dtype_mismatch_is_refused(spd):
    res = _join(_direct_pd(spd.prefill, spd.bootstrap, spd.bf16_decode, "one two three", 8101))
    err = res["d"]
    assert isinstance(err, str), f"a decode with a bf16 draft pool was served: {err}"
    assert "refused" in err, err
    assert "draft_k draft layer 0: dtype producer float8_e4m3fn, consumer bfloat16" in err, err
