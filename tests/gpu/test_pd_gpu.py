"""The atom P/D backend between GPU pools on one card, beyond the server tier's bf16 pair: fp8 KV
with ATOM_DSPARK's fp8 draft regions, and the faults that tests/e2e checks on CPU.

Servers of the word-chain llama target, side by side, each capped by ``--max-total-tokens``:
a unified server (the reference), a prefill and a decode over the atom transfer backend (NIXL,
UCX with its CUDA transports: ``SGL_ATOM_PD_CUDA_IPC=0`` on that prefill), a prefill that waits
before each chunk's writes (``SGL_ATOM_PD_WRITE_DELAY_MS``, so a kill lands mid-transfer) and
writes through CUDA IPC (the default), and a decode that is killed.
Every server runs fp8 KV (per-token-head scales) and ATOM_DSPARK with an fp8 draft pool, so the
pair moves the target's K/V, its scales and the draft's K/V and scales.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from dataclasses import dataclass

import pytest
from gpu_tier import server_tier_missing

if server_tier_missing():
    pytest.skip(server_tier_missing(), allow_module_level=True)

# the CPU P/D module's request helpers (MAX_NEW greedy tokens, as the router sends them)
# FAST_HEARTBEAT: the decode notices a dead prefill after three missed heartbeats 2 s apart
from test_disagg_serving import DECODE_ARGS, FAST_HEARTBEAT, MAX_NEW, _tpf  # noqa: E402
from test_disagg_serving import _direct_pd as _pd  # noqa: E402

# the tier's feature servers' flags and prompts; PD_ENV: UCX with cuda_ipc / cuda_copy
from test_server_tier import PD_ENV, SPEC_ARGS, SPEC_PROMPTS  # noqa: E402

from sgl_atom.cpu_mode import cache_dir  # noqa: E402
from sgl_atom.testing import DSPARK_CHAIN, tiny  # noqa: E402
from sgl_atom.testing.server import Server  # noqa: E402

DELAY_MS = 6000
# a write that cannot land (its decode is gone) fails its room after this many seconds at most
TRANSFER_TIMEOUT_S = 20
LOST_PREFILL_BOUND_S = 30.0


@dataclass
class GpuPair:
    unified: Server
    prefill: Server
    bootstrap: int
    decode: Server
    slow_prefill: Server
    slow_bootstrap: int
    doomed_decode: Server
    expected: list[list[int]]


@pytest.fixture(scope="module")
def gpu_pair(gpu_servers) -> GpuPair:
    if importlib.util.find_spec("nixl") is None:
        pytest.fail("nixl is not importable here: carry part 3 of the GPU bundle")
    from test_m3_serving import ENV  # sgl_atom.models: the DSpark draft's model class

    from sgl_atom.speculative.dspark.algorithm import NAME
    from sgl_atom.testing.pd import prefill_args
    from sgl_atom.testing.server import free_port

    target = tiny.build(cache_dir() / "tiny" / "llama-chain", "llama-chain")
    fp8 = [
        *SPEC_ARGS,
        "--kv-cache-dtype", "fp8_e4m3",
        "--speculative-algorithm", NAME,
        "--speculative-draft-model-path", str(DSPARK_CHAIN),
        "--spec-decode-kv-cache-dtype", "fp8",
    ]  # fmt: skip
    pd_env = {**ENV, **PD_ENV, "SGL_ATOM_PD_TRANSFER_TIMEOUT": str(TRANSFER_TIMEOUT_S)}
    bp, slow_bp = free_port(), free_port()

    def nccl() -> list[str]:
        return ["--nccl-port", str(free_port())]

    decode = [*fp8, *DECODE_ARGS]
    jobs = {
        "unified": (target, fp8, ENV),
        "prefill": (
            target,
            [*fp8, *prefill_args(bp), *nccl()],
            # NIXL between the GPU pools (the server tier's pair and the faults here: CUDA IPC)
            {**pd_env, "SGL_ATOM_PD_TRANSFER_LOG": "1", "SGL_ATOM_PD_CUDA_IPC": "0"},
        ),
        "decode": (target, [*decode, *nccl()], {**pd_env, **FAST_HEARTBEAT}),
        "slow_prefill": (
            target,
            [*fp8, *prefill_args(slow_bp), *nccl()],
            {**pd_env, "SGL_ATOM_PD_WRITE_DELAY_MS": str(DELAY_MS)},
        ),
        "doomed_decode": (target, [*decode, *nccl()], {**pd_env, **FAST_HEARTBEAT}),
    }
    s = gpu_servers.start_many(jobs, timeout=600)
    outs = s["unified"].generate(SPEC_PROMPTS, max_new_tokens=MAX_NEW)
    return GpuPair(
        s["unified"], s["prefill"], bp, s["decode"], s["slow_prefill"], slow_bp,
        s["doomed_decode"], [o["output_ids"] for o in outs],
    )  # fmt: skip


def _served(pair: GpuPair, indices, room0: int) -> list:
    """The pair's (prefill, decode) answers for SPEC_PROMPTS[indices], sent together."""
    pending = [
        _pd(pair.prefill, pair.bootstrap, pair.decode, SPEC_PROMPTS[i], room0 + n)
        for n, i in enumerate(indices)
    ]
    return [r.join()["d"] for r in pending]


def _wait_for_delay(srv: Server, seen: int) -> None:
    """Until ``srv`` logs one more delayed write than ``seen``: a room is mid-transfer."""
    deadline = time.time() + 60
    while srv.log_text().count(f"waits {DELAY_MS} ms before its writes") <= seen:
        assert time.time() < deadline, srv.log_tail()
        time.sleep(0.2)


def test_fp8_pools_and_draft_regions_match_unified(gpu_pair: GpuPair, report):
    """fp8 target KV with its scales and the fp8 draft's K/V and scales, GPU pool to GPU pool:
    greedy outputs equal the unified server's, and the decode drafts from the transferred
    context as well as unified does."""
    from sgl_atom.disagg.conn import TransferStats

    t0 = time.time()
    got = _served(gpu_pair, range(len(SPEC_PROMPTS)), 11000)
    seconds = time.time() - t0
    errors = [g for g in got if not isinstance(g, dict)]
    assert not errors, errors[0]
    ids = [g["output_ids"] for g in got]
    same = sum(a == b for a, b in zip(ids, gpu_pair.expected, strict=True))
    tpf_pd = _tpf(got)
    log = gpu_pair.prefill.log_text()
    report(
        f"GPU P/D atom, fp8 KV + fp8 DSpark draft pools: {same}/{len(ids)} greedy outputs equal "
        f"unified in {seconds:.1f}s; decode tokens/forward {tpf_pd:.2f}"
    )
    assert same == len(ids)
    # per layer of the tiny target: K, V and their scales; then the draft's 2 layers x (K, V,
    # K scale, V scale)
    assert "24 regions (layers 0..3), 8 of them draft" in log, log[-3000:]
    assert "KV through NIXL" in log, log[-3000:]
    # SGL_ATOM_PD_TRANSFER_LOG: one line per request once its KV landed
    moved = list(TransferStats.logged(log).values())
    assert len(moved) >= len(SPEC_PROMPTS), log[-3000:]
    assert all(t.nbytes > 0 and t.descriptors >= 1 and r == 1 for t, r in moved), moved
    # the draft context came over: acceptance on the decode side is the chain's (5 at k=4
    # unified; 1.0 would mean the drafts were refused)
    assert tpf_pd >= 3.5, tpf_pd


def test_decode_killed_mid_transfer_leaves_prefill_serving(gpu_pair: GpuPair, report):
    """Kill -9 a decode while the prefill holds its room before writing: the prefill's writes
    to the dead rank fail within the transfer timeout, the prefill answers, stays healthy and
    serves the next request to the other decode."""
    seen = gpu_pair.slow_prefill.log_text().count(f"waits {DELAY_MS} ms")
    doomed = _pd(
        gpu_pair.slow_prefill, gpu_pair.slow_bootstrap, gpu_pair.doomed_decode,
        SPEC_PROMPTS[0], 12000,
    )  # fmt: skip
    _wait_for_delay(gpu_pair.slow_prefill, seen)
    os.killpg(gpu_pair.doomed_decode.proc.pid, signal.SIGKILL)
    gpu_pair.doomed_decode.proc.wait(timeout=30)
    t0 = time.time()
    out = doomed.join(timeout=DELAY_MS / 1e3 + TRANSFER_TIMEOUT_S + 30)
    waited = time.time() - t0
    assert "p" in out, f"the prefill has not answered {waited:.0f}s after its decode died"
    assert gpu_pair.slow_prefill._healthy(), gpu_pair.slow_prefill.log_tail()
    nxt = _pd(
        gpu_pair.slow_prefill, gpu_pair.slow_bootstrap, gpu_pair.decode, SPEC_PROMPTS[1], 12001
    ).join()["d"]
    report(
        f"GPU P/D atom, decode killed mid-transfer: the prefill answered {waited:.1f}s after the "
        f"kill ({str(out['p'])[:120]!r}); its next request served"
    )
    assert isinstance(nxt, dict), nxt
    assert nxt["output_ids"] == gpu_pair.expected[1]


def test_prefill_killed_mid_transfer_fails_clearly_and_decode_recovers(gpu_pair: GpuPair, report):
    """Kill -9 a prefill while it holds a room before writing: the decode fails that request
    with a clear error within the heartbeat bound, stays healthy and serves the next request
    from the other prefill."""
    seen = gpu_pair.slow_prefill.log_text().count(f"waits {DELAY_MS} ms")
    pending = _pd(
        gpu_pair.slow_prefill, gpu_pair.slow_bootstrap, gpu_pair.decode, SPEC_PROMPTS[2], 13000
    )
    _wait_for_delay(gpu_pair.slow_prefill, seen)
    t0 = time.time()
    os.killpg(gpu_pair.slow_prefill.proc.pid, signal.SIGKILL)
    gpu_pair.slow_prefill.proc.wait(timeout=30)
    err = pending.join(timeout=LOST_PREFILL_BOUND_S + 30)["d"]
    seconds = time.time() - t0
    report(f"GPU P/D atom, prefill killed mid-transfer: the decode failed the request in "
           f"{seconds:.1f}s (bound {LOST_PREFILL_BOUND_S:.0f}s)")  # fmt: skip
    assert isinstance(err, str), f"decode returned output with its prefill dead: {err}"
    assert "Lost connection with prefill instance" in err, err
    assert seconds < LOST_PREFILL_BOUND_S
    assert gpu_pair.decode._healthy(), gpu_pair.decode.log_tail()
    got = _served(gpu_pair, (3, 4), 13001)
    assert [g["output_ids"] for g in got] == [gpu_pair.expected[i] for i in (3, 4)]
