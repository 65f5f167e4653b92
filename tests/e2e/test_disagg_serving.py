"""P/D disaggregation over the atom transfer backend: prefill, decode and router as real processes.

One module-scoped set of processes on 127.0.0.1, started together: a unified server (the
reference), a prefill and a decode server with ``--disaggregation-transfer-backend atom`` behind
SGLang's PD router, a second prefill whose writes are delayed (killed mid-transfer), and a
decode server whose model has another layout (2 layers of head dim 32 against 4 of 64).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from e2e_utils import word_prompts

from sgl_atom import envs
from sgl_atom.cpu_mode import cache_dir
from sgl_atom.testing import tiny
from sgl_atom.testing.router import Router
from sgl_atom.testing.server import Server, free_port

MAX_NEW = 8
# Control sockets and UCX on loopback; SGLang's own variables.
PD_ENV = {"SGLANG_HOST_IP": "127.0.0.1", "UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,self"}
# Decode notices a dead prefill after one missed heartbeat (SGLang's floor is 2 s).
DECODE_ENV = {
    **PD_ENV,
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1",
}
SLOW_WRITE_MS = 6000


def prefill_args(bootstrap_port: int) -> list[str]:
    return [
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-transfer-backend",
        "atom",
        "--disaggregation-bootstrap-port",
        str(bootstrap_port),
    ]


# On CPU the decode server keeps retracted KV in CPU tensors (its default host pool needs CUDA).
DECODE_ARGS = [
    "--disaggregation-mode",
    "decode",
    "--disaggregation-transfer-backend",
    "atom",
    "--disaggregation-decode-retraction-backup",
    "cpu_tensor",
]


@dataclass
class PD:
    unified: Server
    prefill: Server
    prefill_bootstrap: int
    decode: Server
    router: Router
    slow_prefill: Server
    slow_bootstrap: int
    other_decode: Server


@pytest.fixture(scope="module")
def pd(servers, tiny_llama):
    hd32 = tiny.build(cache_dir() / "tiny" / "llama-hd32", "llama-hd32")
    bp, slow_bp = free_port(), free_port()
    jobs = {
        "unified": (tiny_llama, [], PD_ENV),
        "prefill": (tiny_llama, prefill_args(bp), PD_ENV),
        "decode": (tiny_llama, DECODE_ARGS, DECODE_ENV),
        "slow_prefill": (
            tiny_llama,
            prefill_args(slow_bp),
            {**PD_ENV, "SGL_ATOM_PD_WRITE_DELAY_MS": str(SLOW_WRITE_MS)},
        ),
        "other_decode": (hd32, DECODE_ARGS, DECODE_ENV),
    }
    started = servers.start_many(jobs)
    router = Router([(started["prefill"].url, bp)], [started["decode"].url])
    try:
        router.start()
        yield PD(
            unified=started["unified"],
            prefill=started["prefill"],
            prefill_bootstrap=bp,
            decode=started["decode"],
            router=router,
            slow_prefill=started["slow_prefill"],
            slow_bootstrap=slow_bp,
            other_decode=started["other_decode"],
        )
    finally:
        router.stop()


def _params(max_new: int = MAX_NEW) -> dict:
    return {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}


def _router_ids(router: Router, prompts: list[str]) -> list[list[int]]:
    def one(prompt: str) -> list[int]:
        return router.post("/generate", {"text": prompt, "sampling_params": _params()})[
            "output_ids"
        ]

    with ThreadPoolExecutor(4) as ex:
        return list(ex.map(one, prompts))


def _error_text(e: Exception) -> str:
    body = e.read().decode(errors="replace") if isinstance(e, urllib.error.HTTPError) else ""
    return f"{e} {body}"


def _direct_pd(prefill: Server, bootstrap: int, decode: Server, prompt: str, room: int) -> dict:
    """What SGLang's PD router does, by hand: the same request to both, with bootstrap fields."""
    payload = {
        "text": prompt,
        "sampling_params": _params(),
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap,
        "bootstrap_room": room,
    }
    out: dict = {}

    def go(key: str, srv: Server) -> None:
        try:
            out[key] = srv.post("/generate", payload, timeout=120)
        except Exception as e:  # the error is the result here
            out[key] = _error_text(e)

    threads = [threading.Thread(target=go, args=(k, s)) for k, s in (("p", prefill), ("d", decode))]
    for t in threads:
        t.start()
    out["threads"] = threads
    return out


def _join(result: dict, timeout: float = 120) -> dict:
    for t in result.pop("threads"):
        t.join(timeout)
    return result


def _agent_name(srv: Server) -> str:
    m = re.search(r"Initialized NIXL agent: (atom-\S+)", srv.log_text())
    assert m, f"{srv.name} started no atom NIXL agent:\n{srv.log_tail()}"
    return m.group(1)


def test_router_prefill_decode_matches_unified(pd, report):
    prompts = word_prompts(16, seed=6, min_words=3, max_words=24)
    expected = [o["output_ids"] for o in pd.unified.generate(prompts, max_new_tokens=MAX_NEW)]
    t0 = time.time()
    got = _router_ids(pd.router, prompts)
    report(f"P/D atom TP1->TP1 via router: {len(prompts)} prompts in {time.time() - t0:.1f}s")
    assert got == expected
    assert re.search(r"accepted decode rank tp 0/1 .*whole", pd.prefill.log_text())


def test_mismatched_layout_is_refused_before_any_write(pd):
    res = _join(_direct_pd(pd.prefill, pd.prefill_bootstrap, pd.other_decode, "one two", 7001))
    err = res["d"]
    assert isinstance(err, str), f"a decode with another layout was served: {err}"
    assert "refused" in err and "nothing was written" in err, err
    # the error names the region and both values
    assert "target_k layer 0: head_dim producer 64, consumer 32" in err, err
    assert "target_k layer 2: producer exports it, consumer has no such region" in err, err
    agent = _agent_name(pd.other_decode)
    log = pd.prefill.log_text()
    assert f"({agent})" in log and f"refused decode rank tp 0/1 ({agent})" in log
    assert f"accepted decode rank tp 0/1 ({agent})" not in log
    # the prefill still serves its own decode
    prompts = word_prompts(2, seed=11)
    expected = [o["output_ids"] for o in pd.unified.generate(prompts, max_new_tokens=MAX_NEW)]
    assert _router_ids(pd.router, prompts) == expected


def test_prefill_killed_mid_transfer_fails_clearly_and_decode_recovers(pd):
    pending = _direct_pd(pd.slow_prefill, pd.slow_bootstrap, pd.decode, "five six seven", 7002)
    deadline = time.time() + 60
    while "waits 6000 ms before its writes" not in pd.slow_prefill.log_text():
        assert time.time() < deadline, pd.slow_prefill.log_tail()
        time.sleep(0.2)
    os.killpg(pd.slow_prefill.proc.pid, signal.SIGKILL)
    pd.slow_prefill.proc.wait(timeout=30)
    res = _join(pending)
    err = res["d"]
    assert isinstance(err, str), f"decode returned output with its prefill dead: {err}"
    assert "Lost connection with prefill instance" in err, err
    # the decode server serves the next request
    prompts = word_prompts(2, seed=12)
    expected = [o["output_ids"] for o in pd.unified.generate(prompts, max_new_tokens=MAX_NEW)]
    assert _router_ids(pd.router, prompts) == expected


# ---------------------------------------------------------------- head split and merge


@dataclass
class Parallel:
    pp2_prefill: Server
    pp2_bootstrap: int
    tp2_decode: Server
    tp2_prefill: Server
    tp2_bootstrap: int


@pytest.fixture(scope="module")
def parallel(servers, tiny_llama, pd):
    """A PP2 prefill (one TP rank per stage) and a TP2 decode; a TP2 prefill for pd's decode."""
    pp2_bp, tp2_bp = free_port(), free_port()
    jobs = {
        "pp2_prefill": (prefill_args(pp2_bp) + ["--pp-size", "2"], PD_ENV),
        "tp2_decode": (DECODE_ARGS + ["--tp", "2"], DECODE_ENV),
        "tp2_prefill": (prefill_args(tp2_bp) + ["--tp", "2"], PD_ENV),
    }
    # six scheduler ranks start next to the five running servers: allow them twice the time
    started = servers.start_many(
        {n: (tiny_llama, *job) for n, job in jobs.items()},
        timeout=2 * envs.SGL_ATOM_SERVER_TIMEOUT.get(),
    )
    return Parallel(
        started["pp2_prefill"], pp2_bp, started["tp2_decode"], started["tp2_prefill"], tp2_bp
    )


def _pd_ids(prefill: Server, bootstrap: int, decode: Server, prompts: list[str], room0: int):
    pending = [_direct_pd(prefill, bootstrap, decode, p, room0 + i) for i, p in enumerate(prompts)]
    results = [_join(r)["d"] for r in pending]
    for r in results:
        assert isinstance(r, dict), r
    return [r["output_ids"] for r in results]


def test_pp2_prefill_into_tp2_decode_splits_heads(pd, parallel):
    prompts = word_prompts(6, seed=21, min_words=3, max_words=24)
    expected = [o["output_ids"] for o in pd.unified.generate(prompts, max_new_tokens=MAX_NEW)]
    got = _pd_ids(parallel.pp2_prefill, parallel.pp2_bootstrap, parallel.tp2_decode, prompts, 9000)
    assert got == expected
    log = parallel.pp2_prefill.log_text()
    # both stages (layers 0..1 and 2..3) write both decode ranks their one head of two
    assert re.search(r"pp 0/2: 4 regions \(layers 0\.\.1\)", log), log[-3000:]
    assert re.search(r"pp 1/2: 4 regions \(layers 2\.\.3\)", log), log[-3000:]
    assert len(re.findall(r"accepted decode rank tp [01]/2 .*: 4 region pairs, split", log)) == 4


def test_tp2_prefill_into_tp1_decode_merges_heads(pd, parallel):
    prompts = word_prompts(6, seed=22, min_words=3, max_words=24)
    expected = [o["output_ids"] for o in pd.unified.generate(prompts, max_new_tokens=MAX_NEW)]
    got = _pd_ids(parallel.tp2_prefill, parallel.tp2_bootstrap, pd.decode, prompts, 9100)
    assert got == expected
    log = parallel.tp2_prefill.log_text()
    assert len(re.findall(r"accepted decode rank tp 0/1 .*: 8 region pairs, merge", log)) == 2
