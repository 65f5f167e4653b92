"""P/D disaggregation over the atom transfer backend: prefill, decode and router as real processes.

Every server runs the word-chain target with its distilled ATOM_DSPARK draft (4.8 tokens/forward
unified), fp8 draft pools under the fp16 target, so "the decode side drafts as well as unified"
checks that the draft's context K/V came over. A prefill server only runs extends: its worker
writes the draft's context K/V and never proposes; the backend exports the draft pool's regions
after the target's and moves them with the target's pages.

Two groups of processes on 127.0.0.1 per module:

1. TP1: a unified ATOM_DSPARK server (the reference of every pair), a prefill and a decode behind
   SGLang's PD router, a prefill whose writes are delayed (killed mid-transfer), a decode whose
   model has another layout (the dense tiny llama of head dim 32) and a decode whose draft pool
   is bf16 (both refused at handshake).
2. Multi-rank, started once group 1's extra servers have stopped: a PP2 prefill (TP1 stages; the
   draft and its taps' last stage on stage 1) into a TP2 decode (heads split, the draft whole
   on both ranks), and a TP2 prefill into group 1's TP1 decode (heads merged).
"""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from e2e_utils import listening_sockets, word_prompts

from sgl_atom import envs
from sgl_atom.cpu_mode import cache_dir
from sgl_atom.disagg.conn import TransferStats
from sgl_atom.speculative.dspark.algorithm import NAME
from sgl_atom.testing import DSPARK_CHAIN, tiny
from sgl_atom.testing.pd import PDRequest, decode_args, prefill_args
from sgl_atom.testing.router import Router
from sgl_atom.testing.server import Server, free_port, stop_many

PROMPTS = word_prompts(16, seed=31, min_words=4, max_words=16)
MAX_NEW = 16
# UCX over TCP. Control sockets and UCX listen on --host (127.0.0.1) by default. Up to six
# servers share two cores here and a scheduler can stall for seconds: the transfer session's
# heartbeat (not under test in these modules) gets a timeout no stall reaches.
PD_ENV = {"UCX_TLS": "tcp,self", "SGL_ATOM_PD_HEARTBEAT_TIMEOUT_MS": "30000"}
SPEC_ENV = {
    **PD_ENV,
    "SGL_ATOM_CPU_KERNELS": "reference",
    "SGLANG_EXTERNAL_MODEL_PACKAGE": "sgl_atom.models",
}
# Decode notices a dead prefill after three missed heartbeats 2 s apart (SGLang's floor is
# 2 s): a killed prefill fails its requests within ~6 s, and a bootstrap server that answers
# one /health late (over 3 s, on two loaded cores) fails nothing.
FAST_HEARTBEAT = {
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "3",
}
DECODE_ENV = {**SPEC_ENV, **FAST_HEARTBEAT}
SLOW_WRITE_MS = 6000
# The PP2 prefill's stages hold layers 0..2 and 3: the draft's tap 1 (the stream entering layer
# 2) is captured on stage 0 and travels to the last stage with the pipeline payload.
PP2_ENV = {**SPEC_ENV, "SGLANG_PP_LAYER_PARTITION": "3,1"}
ATOM = [
    "--attention-backend",
    "atom",
    "--chunked-prefill-size",
    "32",
    "--max-running-requests",
    str(len(PROMPTS)),
]
SPEC = ["--speculative-algorithm", NAME, "--speculative-draft-model-path", str(DSPARK_CHAIN)]
FP8 = [*ATOM, *SPEC, "--spec-decode-kv-cache-dtype", "fp8"]
BF16 = [*ATOM, *SPEC, "--speculative-draft-kv-cache-dtype", "bf16"]


# With SGLang's default 512 tokens reserved per running request, the tiny KV budget would admit
# about 7 of the 16 prompts at a time.
DECODE_ARGS = [*decode_args(cpu=True), "--num-reserved-decode-tokens", "64"]


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
    bf16_decode: Server
    nccl_ports: dict[str, int]


@pytest.fixture(scope="module")
def chain():
    return tiny.build(cache_dir() / "tiny" / "llama-chain", "llama-chain")


@pytest.fixture(scope="module")
def pd(servers, chain):
    hd32 = tiny.build(cache_dir() / "tiny" / "llama-hd32", "llama-hd32")
    bp, slow_bp = free_port(), free_port()
    nccl = {"prefill": free_port(), "decode": free_port()}  # torch's TCPStore listens there
    jobs = {
        "unified": (chain, FP8, SPEC_ENV),
        "prefill": (
            chain,
            [*FP8, *prefill_args(bp), "--nccl-port", str(nccl["prefill"])],
            {**SPEC_ENV, "SGL_ATOM_PD_TRANSFER_LOG": "1"},
        ),
        "decode": (chain, [*FP8, *DECODE_ARGS, "--nccl-port", str(nccl["decode"])], DECODE_ENV),
        "slow_prefill": (
            chain,
            FP8 + prefill_args(slow_bp),
            {**SPEC_ENV, "SGL_ATOM_PD_WRITE_DELAY_MS": str(SLOW_WRITE_MS)},
        ),
        "other_decode": (hd32, DECODE_ARGS, DECODE_ENV),
        "bf16_decode": (chain, BF16 + DECODE_ARGS, DECODE_ENV),
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
            bf16_decode=started["bf16_decode"],
            nccl_ports=nccl,
        )
    finally:
        router.stop()


def test_control_plane_listens_on_host_only(pd):
    """With --host 127.0.0.1 and no SGLANG_HOST_IP / UCX_NET_DEVICES, nothing of a P/D server
    listens beyond loopback but torch's TCPStore (SGLang's --nccl-port, all interfaces)."""
    for name, srv in (("prefill", pd.prefill), ("decode", pd.decode)):
        socks = listening_sockets(srv.proc.pid)
        off = [(a, p) for a, p in socks if not ipaddress.ip_address(a).is_loopback]
        assert [p for _, p in off] in ([], [pd.nccl_ports[name]]), (name, off)
        assert "atom P/D control plane listens on 127.0.0.1 (from --host)" in srv.log_text()


@pytest.fixture(scope="module")
def expected(pd) -> list[dict]:
    """The unified server's outputs for PROMPTS: the reference of every pair."""
    return pd.unified.generate(PROMPTS, max_new_tokens=MAX_NEW)


def _params(max_new: int = MAX_NEW) -> dict:
    return {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}


def _router_outs(router: Router, prompts: list[str]) -> list[dict]:
    def one(prompt: str) -> dict:
        return router.post("/generate", {"text": prompt, "sampling_params": _params()})

    with ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(one, prompts))


def _ids(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def _tpf(outs: list[dict]) -> float:
    """Mean tokens per target forward: output tokens over verify steps, per request."""
    per = [len(o["output_ids"]) / max(1, o["meta_info"].get("spec_verify_ct", 0)) for o in outs]
    return sum(per) / len(per)


def _check_pair(label: str, got: list[dict], expected: list[dict], seconds: float, report):
    same = sum(a == b for a, b in zip(_ids(got), _ids(expected), strict=True))
    tpf_pd, tpf_unified = _tpf(got), _tpf(expected)
    report(
        f"P/D atom {label} with ATOM_DSPARK (fp8 draft pools): {same}/{len(expected)} greedy "
        f"outputs ({MAX_NEW} tokens) equal unified in {seconds:.1f}s; tokens/forward P/D "
        f"{tpf_pd:.2f}, unified {tpf_unified:.2f}"
    )
    assert _ids(got) == _ids(expected)
    # the draft context came over: the decode side drafts as well as unified does
    assert tpf_pd >= 4.0  # measured 5.33
    assert abs(tpf_pd - tpf_unified) <= 0.15 * tpf_unified + 0.1


def _direct_pd(prefill: Server, bootstrap: int, decode: Server, prompt: str, room: int):
    """What SGLang's PD router does, by hand: the same request to both, with bootstrap fields."""
    payload = {"text": prompt, "sampling_params": _params()}
    return PDRequest(prefill, decode, payload, bootstrap, room)


def _pd_outs(prefill: Server, bootstrap: int, decode: Server, room0: int) -> list[dict]:
    pending = [_direct_pd(prefill, bootstrap, decode, p, room0 + i) for i, p in enumerate(PROMPTS)]
    results = [r.join()["d"] for r in pending]
    for r in results:
        assert isinstance(r, dict), r
    return results


def _agent_name(srv: Server) -> str:
    m = re.search(r"Initialized NIXL agent: (atom-\S+)", srv.log_text())
    assert m, f"{srv.name} started no atom NIXL agent:\n{srv.log_tail()}"
    return m.group(1)


# ---------------------------------------------------------------- TP1 -> TP1


def test_router_prefill_decode_matches_unified(pd, expected, report):
    t0 = time.time()
    got = _router_outs(pd.router, PROMPTS)
    _check_pair("TP1->TP1 via router", got, expected, time.time() - t0, report)
    log = pd.prefill.log_text()
    # the tiny llama's 4 fp16 target layers (K, V) come first, then the fp8 draft's 2 layers
    # x (K, V, K scale, V scale)
    assert "16 regions (layers 0..3), 8 of them draft" in log, log[-3000:]
    assert re.search(r"accepted decode rank tp 0/1 .*whole", log)
    # SGL_ATOM_PD_TRANSFER_LOG: one line per request, once its KV landed
    moved = list(TransferStats.logged(log).values())
    assert len(moved) >= len(PROMPTS), log[-3000:]
    assert all(t.nbytes > 0 and t.descriptors >= 1 and r == 1 for t, r in moved), moved


def test_mismatched_layout_is_refused_before_any_write(pd, expected):
    res = _direct_pd(pd.prefill, pd.prefill_bootstrap, pd.other_decode, "one two", 7001).join()
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
    assert _ids(_router_outs(pd.router, PROMPTS[:2])) == _ids(expected[:2])


def test_draft_dtype_mismatch_is_refused(pd):
    res = _direct_pd(pd.prefill, pd.prefill_bootstrap, pd.bf16_decode, "one two", 7101).join()
    err = res["d"]
    assert isinstance(err, str), f"a decode with a bf16 draft pool was served: {err}"
    assert "refused" in err, err
    assert "draft_k draft layer 0: dtype producer float8_e4m3fn, consumer bfloat16" in err, err


def test_prefill_killed_mid_transfer_fails_clearly_and_decode_recovers(pd, expected):
    pending = _direct_pd(pd.slow_prefill, pd.slow_bootstrap, pd.decode, "five six seven", 7002)
    deadline = time.time() + 60
    while "waits 6000 ms before its writes" not in pd.slow_prefill.log_text():
        assert time.time() < deadline, pd.slow_prefill.log_tail()
        time.sleep(0.2)
    os.killpg(pd.slow_prefill.proc.pid, signal.SIGKILL)
    pd.slow_prefill.proc.wait(timeout=30)
    res = pending.join()
    err = res["d"]
    assert isinstance(err, str), f"decode returned output with its prefill dead: {err}"
    assert "Lost connection with prefill instance" in err, err
    # the decode server serves the next requests
    assert _ids(_router_outs(pd.router, PROMPTS[2:4])) == _ids(expected[2:4])


# ---------------------------------------------------------------- head split and merge


@dataclass
class Parallel:
    pp2_prefill: Server
    pp2_bootstrap: int
    tp2_decode: Server
    tp2_prefill: Server
    tp2_bootstrap: int


@pytest.fixture(scope="module")
def parallel(servers, chain, pd, expected):
    """A PP2 prefill (one TP rank per stage) and a TP2 decode; a TP2 prefill for pd's decode.

    Started once group 1's servers other than the reference and the TP1 decode have stopped."""
    stop_many([pd.router, pd.prefill, pd.slow_prefill, pd.other_decode, pd.bf16_decode])
    pp2_bp, tp2_bp = free_port(), free_port()
    jobs = {
        "pp2_prefill": (FP8 + prefill_args(pp2_bp) + ["--pp-size", "2"], PP2_ENV),
        "tp2_decode": (FP8 + DECODE_ARGS + ["--tp", "2"], DECODE_ENV),
        "tp2_prefill": (FP8 + prefill_args(tp2_bp) + ["--tp", "2"], SPEC_ENV),
    }
    # six scheduler ranks start at once on two cores: allow them twice the time
    started = servers.start_many(
        {n: (chain, *job) for n, job in jobs.items()},
        timeout=2 * envs.SGL_ATOM_SERVER_TIMEOUT.get(),
    )
    return Parallel(
        started["pp2_prefill"], pp2_bp, started["tp2_decode"], started["tp2_prefill"], tp2_bp
    )


def test_pp2_prefill_into_tp2_decode_splits_heads(parallel, expected, report):
    t0 = time.time()
    got = _pd_outs(parallel.pp2_prefill, parallel.pp2_bootstrap, parallel.tp2_decode, 9000)
    _check_pair("PP2->TP2", got, expected, time.time() - t0, report)
    log = parallel.pp2_prefill.log_text()
    # stage 0 (layers 0..2) writes both decode ranks their one head of two and sends tap 1 on;
    # stage 1 (layer 3) too, and the whole draft (2 layers x K, V and their scales) to each
    assert "ATOM_DSPARK PP stage: no draft here; taps [1] sent on" in log, log[-3000:]
    assert re.search(r"pp 0/2: 6 regions \(layers 0\.\.2\), 0 of them draft", log), log[-3000:]
    assert re.search(r"pp 1/2: 10 regions \(layers 3\.\.3\), 8 of them draft", log), log[-3000:]
    assert len(re.findall(r"accepted decode rank tp [01]/2 .*split", log)) == 4
    # the split heads go packed into whole decode pages (stage.py), and the outputs above match
    assert "head cuts are packed through a 128 MiB staging buffer" in log, log[-3000:]


def test_tp2_prefill_into_tp1_decode_merges_heads(pd, parallel, expected, report):
    t0 = time.time()
    got = _pd_outs(parallel.tp2_prefill, parallel.tp2_bootstrap, pd.decode, 9100)
    _check_pair("TP2->TP1", got, expected, time.time() - t0, report)
    log = parallel.tp2_prefill.log_text()
    assert len(re.findall(r"accepted decode rank tp 0/1 .*merge", log)) == 2
