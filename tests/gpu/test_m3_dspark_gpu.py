"""ATOM_DSPARK on sgl_atom's MiniMax-M3 model on the GPU: the checks of
tests/e2e/test_m3_dspark_serving.py, with the atom kernels, CUDA graphs and SGLang's overlap
scheduler.

Servers of the tiny ``m3-chain`` target (bf16, atom backend), side by side, each capped by
``--max-total-tokens``: one without speculation (the reference), and one per draft pool dtype
with the ``dspark-m3-chain`` draft distilled against it. Every M3 layer (dense layer 0, sparse
layers 1-3 with index reuse) serves the target-verify step inside SGLang's verify graphs, the
taps of layers 1 and 2 reach the draft, and the draft's own passes replay from its graphs.
"""

from __future__ import annotations

import re

import pytest
from gpu_tier import server_tier_missing

if server_tier_missing():
    pytest.skip(server_tier_missing(), allow_module_level=True)

from e2e_utils import word_prompts  # noqa: E402

from sgl_atom.cpu_mode import cache_dir  # noqa: E402
from sgl_atom.testing import DSPARK_M3_CHAIN, tiny  # noqa: E402

PROMPTS = word_prompts(8, seed=11, min_words=4, max_words=16)
MAX_NEW = 24
ARGS = [
    "--dtype", "bfloat16",
    "--attention-backend", "atom",
    "--max-total-tokens", "8192",
    "--decode-log-interval", "4",
]  # fmt: skip
ENV = {"SGLANG_EXTERNAL_MODEL_PACKAGE": "sgl_atom.models"}
DTYPES = ("bf16", "fp8")


@pytest.fixture(scope="module")
def m3_dspark(gpu_servers) -> dict:
    """name -> (output ids, verify counts, log) of the plain server and each draft pool's."""
    from sgl_atom.speculative.dspark.algorithm import NAME

    target = tiny.build(cache_dir() / "tiny" / "m3-chain", "m3-chain")
    spec = ["--speculative-algorithm", NAME, "--speculative-draft-model-path", str(DSPARK_M3_CHAIN)]
    jobs = {"plain": (target, ARGS, ENV)}
    for dtype in DTYPES:
        jobs[dtype] = (target, [*ARGS, *spec, "--spec-decode-kv-cache-dtype", dtype], ENV)
    started = gpu_servers.start_many(jobs, timeout=600)
    runs = {}
    for name, srv in started.items():
        try:
            outs = srv.generate(PROMPTS, max_new_tokens=MAX_NEW)
            log = srv.log_text()
        finally:
            srv.stop()
        runs[name] = (
            [o["output_ids"] for o in outs],
            [o["meta_info"].get("spec_verify_ct") for o in outs],
            log,
        )
    return runs


@pytest.mark.parametrize("draft_dtype", DTYPES)
def test_m3_dspark_lossless_on_gpu(m3_dspark, draft_dtype, report):
    want = m3_dspark["plain"][0]
    ids, verify, log = m3_dspark[draft_dtype]
    same = sum(a == b for a, b in zip(ids, want, strict=True))
    assert all(verify), "every response reports spec_verify_ct"
    tpf = sum(len(i) for i in ids) / sum(verify)
    report(
        f"GPU ATOM_DSPARK on m3-chain ({draft_dtype} draft pool): {same}/{len(ids)} greedy "
        f"outputs equal no speculation ({MAX_NEW} tokens); tokens/forward {tpf:.2f}"
    )
    assert ids == want
    assert tpf >= 4.0, "the distilled draft, fed the M3 target's taps, reaches 4 tokens/forward"
    assert "sparse index cache: 3 layers" in log, "the target ran its sparse layers"
    assert "ATOM_DSPARK: overlap scheduling on" in log
    assert re.search(r"ATOM_DSPARK draft KV pool: " + draft_dtype + " ", log), log[-3000:]
    # the draft's passes and its context writes replay from its CUDA graphs
    assert "ATOM_DSPARK draft CUDA graphs: captured" in log, log[-3000:]
    replayed = [int(n) for n in re.findall(r"draft passes: (\d+) replayed, 0 eager", log)]
    assert replayed and sum(replayed) > 0, log[-3000:]
    writes = [int(n) for n in re.findall(r"context writes: (\d+) replayed, 0 eager", log)]
    assert writes and sum(writes) > 0, log[-3000:]
