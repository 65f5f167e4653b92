"""Every environment variable sgl_atom reads, declared once with its type and default.

Read values through the module-level objects (``envs.SGL_ATOM_LOG_LEVEL.get()``), never through
``os.environ`` elsewhere, so the README's table stays complete.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    default: T
    doc: str

    @property
    def sglang_name(self) -> str:
        """The spelling SGLang 0.5.23's deprecation warning points to (``SGL_`` -> ``SGLANG_``):
        SGLang copies every ``SGL_*`` variable there, and a user who follows the warning sets
        only this one."""
        return "SGLANG_" + self.name.removeprefix("SGL_")

    def _raw(self) -> str | None:
        """The own name first: SGLang copies it over the other spelling in every process that
        imports SGLang, so a stale copy inherited from a parent never wins."""
        return os.environ.get(self.name) or os.environ.get(self.sglang_name) or None

    def get(self) -> T:
        raw = self._raw()
        if raw is None:
            return self.default
        if isinstance(self.default, bool):
            return raw.strip().lower() in ("1", "true", "yes", "on")  # type: ignore[return-value]
        if isinstance(self.default, int):
            try:
                return int(raw)  # type: ignore[return-value]
            except ValueError as e:
                raise ValueError(f"{self.name}={raw!r} is not an integer") from e
        return raw  # type: ignore[return-value]

    def is_set(self) -> bool:
        return self._raw() is not None


SGL_ATOM_CPU_MODE = EnvVar(
    "SGL_ATOM_CPU_MODE",
    "auto",
    "CPU reference mode: 'auto' (on when the host has no NVIDIA driver), 'on' or 'off'.",
)
SGL_ATOM_CACHE_DIR = EnvVar(
    "SGL_ATOM_CACHE_DIR",
    "",
    "Where built artefacts go (the no-device libcuda shim, tiny checkpoints). "
    "Default: .cache/ in the checkout, or ~/.cache/sgl_atom when that is read-only.",
)
SGL_ATOM_CPU_CORES = EnvVar(
    "SGL_ATOM_CPU_CORES",
    "",
    "CPU mode: core lists per rank, '|'-separated (e.g. '0|1'); default spreads the host's "
    "cores over the ranks.",
)
SGL_ATOM_SERVER_TIMEOUT = EnvVar(
    "SGL_ATOM_SERVER_TIMEOUT",
    300,
    "Seconds the demo and the tests wait for a server to become healthy.",
)
SGL_ATOM_STOP_GRACE = EnvVar(
    "SGL_ATOM_STOP_GRACE",
    20,
    "Seconds the demo, the tests and the benchmarks give a server after SIGTERM before SIGKILL.",
)
SGL_ATOM_VENV = EnvVar(
    "SGL_ATOM_VENV",
    "",
    "Where `make setup` puts the project venv (read by scripts/setup.sh; default .venv).",
)
SGL_ATOM_FP8_SCALE = EnvVar(
    "SGL_ATOM_FP8_SCALE",
    "per_token",
    "atom backend with fp8 KV: 'per_token' (one scale per token and KV head) or 'per_tensor' "
    "(upstream SGLang's store with scale 1.0, for A/B accuracy comparisons).",
)
SGL_ATOM_M3_INDEX_DTYPE = EnvVar(
    "SGL_ATOM_M3_INDEX_DTYPE",
    "auto",
    "atom backend, sparse (MiniMax-M3-style) models: dtype of the index-key cache, 'auto' (fp8 "
    "under fp8 KV, else bf16), 'bf16', 'fp8' (e4m3 with one scale per token: half the bytes "
    "the block scoring reads, under bf16 KV too) or 'int4' (packed 4-bit keys with one scale "
    "per token: a quarter of bf16's bytes, scored against q rounded to 8-bit integers; a "
    "coarser score, so the selection can differ from fp8's near the top-k cut).",
)
SGL_ATOM_DECODE_TUNING = EnvVar(
    "SGL_ATOM_DECODE_TUNING",
    "",
    "atom backend on a GPU: path of a decode tuning file (JSON from "
    "benchmarks/tune_decode.py --write-config) to use instead of the committed one "
    "for the device (sgl_atom/attention/tuned/); empty: the committed file, else defaults.",
)
SGL_ATOM_EXTEND_DEQUANT_MB = EnvVar(
    "SGL_ATOM_EXTEND_DEQUANT_MB",
    256,
    "atom backend, fp8 KV: MiB of bf16 workspace an extend (prefill chunk, prefix hit) may "
    "take to dequantize its batch's cached prefixes once, with its new tokens' K/V, and attend "
    "through the 16-bit kernel; a batch over it converts the prefix in the attention kernel "
    "(1.8-2x slower there). 0: always in the kernel.",
)
SGL_ATOM_LOG_LEVEL = EnvVar(
    "SGL_ATOM_LOG_LEVEL",
    "INFO",
    "Log level of the sgl_atom logger.",
)
SGL_ATOM_CPU_KERNELS = EnvVar(
    "SGL_ATOM_CPU_KERNELS",
    "triton",
    "atom backend on CPU: 'triton' runs the Triton kernels (paged and sparse attention) under "
    "Triton's interpreter; 'reference' runs their torch references (same contracts, float64; "
    "much faster), for servers whose kernels are not what is under test.",
)
SGL_ATOM_DSPARK_FAULT = EnvVar(
    "SGL_ATOM_DSPARK_FAULT",
    "",
    "ATOM_DSPARK, fault-injection tests only: 'taps-early' taps each target layer one below the "
    "draft's; 'stale-context' writes no context K/V for decoded tokens (empty: off).",
)
SGL_ATOM_DSPARK_DRAFT_GRAPHS = EnvVar(
    "SGL_ATOM_DSPARK_DRAFT_GRAPHS",
    True,
    "ATOM_DSPARK on CUDA: capture the draft's propose pass and its context write after each "
    "verify in CUDA graphs, one per decode batch size SGLang captures (0: the draft runs "
    "eagerly; off with --disable-cuda-graph too).",
)
SGL_ATOM_DSPARK_FUSED_MARKOV = EnvVar(
    "SGL_ATOM_DSPARK_FUSED_MARKOV",
    True,
    "ATOM_DSPARK on CUDA: each step of the draft's Markov head is one fused kernel (bias GEMM, "
    "base logits and argmax; kernels/draft_markov) rather than a GEMM, an add and an argmax "
    "(0: the unfused torch ops).",
)
SGL_ATOM_PY_SPY = EnvVar(
    "SGL_ATOM_PY_SPY",
    "",
    "benchmarks/bench_server.py --host-profile: path of the py-spy binary that samples the "
    "server's scheduler (empty: py-spy on PATH).",
)
SGL_ATOM_DSPARK_HOST_SEQ_LENS = EnvVar(
    "SGL_ATOM_DSPARK_HOST_SEQ_LENS",
    False,
    "ATOM_DSPARK under overlap scheduling: keep SGLang's host copy of each step's sequence "
    "lengths, for which the scheduler waits on every verify before it prepares the next step "
    "(default off: the lengths stay on the device and the atom backend sizes its tables from "
    "a host bound: the requests' allocated KV or host lengths plus two verify windows).",
)
SGL_ATOM_PD_TRANSFER_TIMEOUT = EnvVar(
    "SGL_ATOM_PD_TRANSFER_TIMEOUT",
    60,
    "atom P/D transfer backend: seconds a producer waits for one chunk's writes to land before "
    "it fails the request.",
)
SGL_ATOM_PD_WRITE_DELAY_MS = EnvVar(
    "SGL_ATOM_PD_WRITE_DELAY_MS",
    0,
    "atom P/D transfer backend, fault-injection tests only: the producer sleeps this many ms "
    "before each chunk's writes (0: off).",
)
SGL_ATOM_PD_TRANSFER_LOG = EnvVar(
    "SGL_ATOM_PD_TRANSFER_LOG",
    False,
    "atom P/D transfer backend, prefill side: one log line per request when its KV has landed "
    "(bytes written, NIXL descriptors, decode ranks, write time and rate).",
)
SGL_ATOM_PD_STAGING_MB = EnvVar(
    "SGL_ATOM_PD_STAGING_MB",
    128,
    "atom P/D transfer backend, prefill side: MiB of the staging buffer through which a head cut "
    "into a decode rank holding fewer heads is packed into whole decode pages (allocated at the "
    "first such write, on the pool's device; 0: written span by span).",
)
SGL_ATOM_PD_NIXL_PROGRESS_THREAD = EnvVar(
    "SGL_ATOM_PD_NIXL_PROGRESS_THREAD",
    True,
    "atom P/D transfer backend, prefill side: whether the producer's NIXL agent runs NIXL's "
    "progress thread (its default). Off, its UCX worker progresses only while the writer polls "
    "its writes: no worker lock and no host callbacks of that thread on the copy stream. A "
    "decode's agent always keeps the thread (it must take in writes it does not poll for).",
)
SGL_ATOM_PD_CUDA_IPC = EnvVar(
    "SGL_ATOM_PD_CUDA_IPC",
    True,
    "atom P/D transfer backend: a decode rank whose pool is in GPU memory shares it through CUDA "
    "IPC in its handshake, and a prefill rank on the same GPU (or a GPU of the same host) writes "
    "the KV with one copy kernel per chunk instead of NIXL (the metadata buffers stay on NIXL). "
    "0 on either side: NIXL only.",
)
SGL_ATOM_PD_HEARTBEAT_INTERVAL_MS = EnvVar(
    "SGL_ATOM_PD_HEARTBEAT_INTERVAL_MS",
    1000,
    "atom P/D transfer backend, decode side: how often each prefill rank it transfers from is "
    "asked, on the transfer session's control socket, whether it is alive (0: no heartbeat).",
)
SGL_ATOM_PD_HEARTBEAT_TIMEOUT_MS = EnvVar(
    "SGL_ATOM_PD_HEARTBEAT_TIMEOUT_MS",
    10000,
    "atom P/D transfer backend, decode side: a prefill rank silent this long is lost; its "
    "in-flight requests fail and the next request to it bootstraps again. Lower it for faster "
    "failure where schedulers never stall for seconds (a false loss fails live requests).",
)
SGL_ATOM_REQUEST_CHECKS = EnvVar(
    "SGL_ATOM_REQUEST_CHECKS",
    True,
    "Answer requests that would crash SGLang's scheduler (input ids outside the vocabulary, an "
    "empty prompt, top_logprobs_num above the vocabulary, top_k < -1 or 0, n outside 1..256) "
    "with a 400 naming the field; 'off' leaves SGLang's own validation alone.",
)

ALL: tuple[EnvVar, ...] = (
    SGL_ATOM_CPU_MODE,
    SGL_ATOM_CACHE_DIR,
    SGL_ATOM_CPU_CORES,
    SGL_ATOM_SERVER_TIMEOUT,
    SGL_ATOM_STOP_GRACE,
    SGL_ATOM_VENV,
    SGL_ATOM_FP8_SCALE,
    SGL_ATOM_M3_INDEX_DTYPE,
    SGL_ATOM_DECODE_TUNING,
    SGL_ATOM_EXTEND_DEQUANT_MB,
    SGL_ATOM_LOG_LEVEL,
    SGL_ATOM_CPU_KERNELS,
    SGL_ATOM_DSPARK_FAULT,
    SGL_ATOM_DSPARK_DRAFT_GRAPHS,
    SGL_ATOM_DSPARK_FUSED_MARKOV,
    SGL_ATOM_DSPARK_HOST_SEQ_LENS,
    SGL_ATOM_PY_SPY,
    SGL_ATOM_PD_TRANSFER_TIMEOUT,
    SGL_ATOM_PD_WRITE_DELAY_MS,
    SGL_ATOM_PD_TRANSFER_LOG,
    SGL_ATOM_PD_STAGING_MB,
    SGL_ATOM_PD_NIXL_PROGRESS_THREAD,
    SGL_ATOM_PD_CUDA_IPC,
    SGL_ATOM_PD_HEARTBEAT_INTERVAL_MS,
    SGL_ATOM_PD_HEARTBEAT_TIMEOUT_MS,
    SGL_ATOM_REQUEST_CHECKS,
)
