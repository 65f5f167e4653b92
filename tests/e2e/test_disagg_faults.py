"""P/D faults over the atom transfer backend: a stopped prefill, and a soak with kills.

One group of processes on 127.0.0.1 (tiny llama, atom attention, reference kernels): a unified
server (the reference, stopped once its outputs are taken), a prefill and a decode behind
SGLang's PD router. The decode keeps SGLang's default bootstrap heartbeat (5 s, 2 misses, which
notices a stopped prefill after 11-16 s): what fails its requests within seconds is the atom
transfer session's own heartbeat (``SGL_ATOM_PD_HEARTBEAT_*``, timeout 4000 ms). The router
runs with the fail-fast settings the README gives (health checks every second, no retries, no
circuit breaker), so a request either returns its output or a clear error.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import requests
from e2e_utils import word_prompts
from test_disagg_serving import DECODE_ARGS, PD_ENV

from sgl_atom.testing.pd import bootstrap_fields, prefill_args
from sgl_atom.testing.router import Router
from sgl_atom.testing.server import Server, ServerPool, free_port

PROMPTS = word_prompts(200, seed=43, min_words=3, max_words=10)
MAX_NEW = 8
CONCURRENCY = 32
# the transfer session's heartbeat is what these tests measure: its fast setting
ENV = {**PD_ENV, "SGL_ATOM_CPU_KERNELS": "reference", "SGL_ATOM_PD_HEARTBEAT_TIMEOUT_MS": "4000"}
ARGS = ["--attention-backend", "atom", "--max-running-requests", str(CONCURRENCY)]
# detection: heartbeat timeout (4 s) + one interval (1 s) + the decode scheduler's next poll
ORPHAN_BOUND_S = 8.0
FAIL_BOUND_S = 10.0
ROUTER_FAIL_FAST = [
    "--health-check-interval-secs",
    "1",
    "--health-failure-threshold",
    "3",  # 1 is too eager: one /health timing out under load took the only prefill out
    "--health-check-timeout-secs",
    "5",
    "--health-success-threshold",
    "1",
    "--disable-retries",
    "--disable-circuit-breaker",
]


@dataclass
class Pair:
    prefill: Server
    bootstrap: int
    decode: Server
    router: Router
    expected: list[list[int]]
    jobs: dict[str, tuple]  # name -> (model, args, env), to start a killed server again


def _params() -> dict:
    return {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pair(servers: ServerPool, tiny_llama) -> Pair:
    bp = free_port()
    jobs = {
        "unified": (tiny_llama, ARGS, ENV),
        "prefill": (tiny_llama, [*ARGS, *prefill_args(bp)], ENV),
        "decode": (tiny_llama, [*ARGS, *DECODE_ARGS], ENV),
    }
    started = servers.start_many(jobs)
    outs = started["unified"].generate(PROMPTS, max_new_tokens=MAX_NEW)
    started["unified"].stop()  # two cores: the reference is not needed any more
    router = Router([(started["prefill"].url, bp)], [started["decode"].url])
    router.cmd += ROUTER_FAIL_FAST
    try:
        router.start()
        ids = [o["output_ids"] for o in outs]
        yield Pair(started["prefill"], bp, started["decode"], router, ids, jobs)
    finally:
        router.stop()


def _error_text(e: Exception) -> str:
    """``HTTP 502 decode_server_error: <message>`` for the router's JSON errors, else the text."""
    if not isinstance(e, requests.HTTPError):
        return str(e)
    body, code = e.response.text, e.response.status_code
    try:
        err = json.loads(body)["error"]
        return f"HTTP {code} {err.get('code')}: {err.get('message')}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {code}: {body}"


def _via_router(pair: Pair, i: int, timeout: float = 120) -> tuple[str, object, float]:
    """("ok", output ids, seconds) or ("error", text, seconds) for PROMPTS[i]."""
    t0 = time.time()
    try:
        out = pair.router.post(
            "/generate", {"text": PROMPTS[i], "sampling_params": _params()}, timeout=timeout
        )
        return "ok", out["output_ids"], time.time() - t0
    except Exception as e:  # the error is the result here
        return "error", _error_text(e), time.time() - t0


def _serves(pair: Pair, indices=(0, 1)) -> None:
    for i in indices:
        kind, got, _ = _via_router(pair, i)
        assert kind == "ok" and got == pair.expected[i], (kind, got)


# ---------------------------------------------------------------- a stopped prefill


def test_decode_fails_requests_of_a_stopped_prefill_and_recovers(pair: Pair, report):
    """SIGSTOP the prefill's process tree: a request the decode holds for it fails within
    seconds, naming the lost prefill; after SIGCONT the next request is served."""
    _serves(pair)  # the decode has shaken hands with the prefill: its rank is watched
    payload = {"text": PROMPTS[2], "sampling_params": _params()}
    payload |= bootstrap_fields(pair.bootstrap, 424242)
    os.killpg(pair.prefill.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.time()
        try:
            out = pair.decode.post("/generate", payload, timeout=60)
            err = f"served: {out}"
        except Exception as e:
            err = _error_text(e)
        seconds = time.time() - t0
    finally:
        os.killpg(pair.prefill.proc.pid, signal.SIGCONT)
    assert "Lost connection with prefill instance" in err, err
    assert seconds < ORPHAN_BOUND_S, (seconds, err)
    assert "answered no heartbeat" in pair.decode.log_text()
    back = _probe(pair, timeout=30)  # the router marked the stopped prefill unhealthy
    report(
        f"P/D atom, prefill stopped (SIGSTOP): the decode failed its request in {seconds:.1f}s "
        f"(bound {ORPHAN_BOUND_S:.0f}s); served again {back:.1f}s after SIGCONT"
    )
    _serves(pair, (3, 4))


# ---------------------------------------------------------------- soak


class Soak:
    """CONCURRENCY workers send PROMPTS through the router; ``pause`` holds new requests."""

    def __init__(self, pair: Pair):
        self.pair = pair
        self.results: list[tuple[str, object, float] | None] = [None] * len(PROMPTS)
        self.go = threading.Event()
        self.go.set()
        self.lock = threading.Lock()
        self.done = 0

    def one(self, i: int) -> None:
        self.go.wait()
        self.results[i] = _via_router(self.pair, i, timeout=60)
        with self.lock:
            self.done += 1

    def wait_done(self, n: int, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while self.done < n:
            assert time.time() < deadline, f"{self.done}/{n} requests after {timeout}s"
            time.sleep(0.1)


def _kill_and_restart(servers: ServerPool, pair: Pair, role: str) -> None:
    """Kill -9 the ``role`` server's process tree; start it again on the same port."""
    old: Server = getattr(pair, role)
    os.killpg(old.proc.pid, signal.SIGKILL)
    old.proc.wait(timeout=30)
    model, args, env = pair.jobs[role]
    setattr(pair, role, servers.start(model, args, port=old.port, env=env, name=f"{role}-again"))


def _probe(pair: Pair, timeout: float = 90) -> float:
    """Seconds until the router serves a request again (its health checks run every second)."""
    t0 = time.time()
    while True:
        kind, got, _ = _via_router(pair, 0)
        if kind == "ok":
            assert got == pair.expected[0]
            return time.time() - t0
        assert time.time() - t0 < timeout, got
        time.sleep(0.5)


def test_soak_with_a_prefill_kill_and_a_decode_kill(pair: Pair, servers: ServerPool, report):
    t0 = time.time()
    soak = Soak(pair)
    with ThreadPoolExecutor(CONCURRENCY) as ex:
        futs = [ex.submit(soak.one, i) for i in range(len(PROMPTS))]
        for n, role in ((50, "prefill"), (120, "decode")):
            soak.wait_done(n)
            soak.go.clear()  # requests already sent are in flight through the kill
            _kill_and_restart(servers, pair, role)
            _probe(pair)
            soak.go.set()
        for f in futs:
            f.result()
    seconds = time.time() - t0
    wrong, failed, sample, slow = [], Counter(), {}, []
    for i, (kind, got, took) in enumerate(soak.results):
        if kind == "ok" and got != pair.expected[i]:
            wrong.append(i)
        elif kind == "error":
            key = got.split(":")[0]  # "HTTP 502 decode_server_error"
            failed[key] += 1
            cause = got[len(key) + 2 :].split(" with exception ")[-1]  # a decode KVTransferError
            sample.setdefault(key, cause[:100])
            if took > FAIL_BOUND_S:
                slow.append((i, round(took, 1), got[:300]))
    ok = sum(r[0] == "ok" for r in soak.results) - len(wrong)
    worst = max((r[2] for r in soak.results if r[0] == "error"), default=0.0)
    report(
        f"P/D atom soak ({len(PROMPTS)} requests, concurrency {CONCURRENCY}, {MAX_NEW} tokens, "
        f"prefill then decode kill -9 and restart): {ok} equal unified, {len(wrong)} wrong, "
        f"{sum(failed.values())} failed (max {worst:.1f}s: "
        + "; ".join(f"{n}x {key} ({sample[key]!r})" for key, n in failed.most_common())
        + f") in {seconds:.0f}s"
    )
    assert not wrong, wrong
    assert not slow, slow
    assert all(key.startswith("HTTP ") for key in failed), failed  # no hang, no reset
    for srv in (pair.prefill, pair.decode):
        assert srv._healthy(), srv.log_tail()
    _serves(pair, (5,))
