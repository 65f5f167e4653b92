"""ATOM_DSPARK on sgl_atom's MiniMax-M3 model: the M3 target's layer taps feed a DSpark draft,
its sparse layers verify the drafted chains, and the output stays exact.

Two servers of the tiny ``m3-chain`` target (the tiny M3 architecture trained on a word chain;
bf16, atom backend): one without speculation, one with the ``dspark-m3-chain`` draft distilled
against it and its pool at fp8. Under test: every M3 layer (dense layer 0, sparse layers 1-3
with index reuse) serves the target-verify step, the taps of layers 1 and 2 reach the draft
(a draft fed wrong taps or no context is rarely right, so tokens per forward would fall to about
1), and verification keeps greedy output identical. Short prompts: one 128-token block, so the
sparse layers attend every block here (block skipping is test_m3_serving's).
``SGL_ATOM_CPU_KERNELS=reference``: the atom backend's kernels are not under test here
(test_m3_serving and test_atom_serving run them).
"""

from __future__ import annotations

import re

import pytest
from e2e_utils import word_prompts

from sgl_atom.cpu_mode import cache_dir
from sgl_atom.speculative.dspark.algorithm import NAME
from sgl_atom.testing import DSPARK_M3_CHAIN, tiny

PROMPTS = word_prompts(8, seed=11, min_words=4, max_words=16)
MAX_NEW = 24
ARGS = ["--dtype", "bfloat16", "--attention-backend", "atom"]
ENV = {"SGL_ATOM_CPU_KERNELS": "reference", "SGLANG_EXTERNAL_MODEL_PACKAGE": "sgl_atom.models"}
POOL_LINE = re.compile(
    r"ATOM_DSPARK draft KV pool: (\w+) \((\S+)\), (\d+) slots .*?, (\d+) B/token"
)
DRAFT_LINE = re.compile(r"ATOM_DSPARK draft \S+ \(AtomDSparkDraftModel\): .*taps \[1, 2\]")


@pytest.fixture(scope="module")
def target():
    return tiny.build(cache_dir() / "tiny" / "m3-chain", "m3-chain")


@pytest.fixture(scope="module")
def draft():
    return DSPARK_M3_CHAIN


def _run(srv) -> tuple[list[list[int]], list[int]]:
    outs = srv.generate(PROMPTS, max_new_tokens=MAX_NEW)
    return [o["output_ids"] for o in outs], [o["meta_info"].get("spec_verify_ct") for o in outs]


@pytest.fixture(scope="module")
def baseline(servers, target) -> list[list[int]]:
    srv = servers.start(target, ARGS, env=ENV, name="m3-plain")
    ids, _ = _run(srv)
    srv.stop()
    return ids


@pytest.fixture(scope="module")
def spec_run(servers, target, draft, baseline):
    spec = ["--speculative-algorithm", NAME, "--speculative-draft-model-path", str(draft)]
    args = [*ARGS, *spec, "--spec-decode-kv-cache-dtype", "fp8"]  # ATOM spelling of fp8
    srv = servers.start(target, args, env=ENV, name="m3-dspark-fp8")
    ids, verify = _run(srv)
    log = srv.log_text()
    srv.stop()
    return ids, verify, log


def test_greedy_output_equals_no_speculation(spec_run, baseline, report):
    ids, verify, _ = spec_run
    same = sum(a == b for a, b in zip(ids, baseline, strict=True))
    assert all(v for v in verify), "every response reports spec_verify_ct"
    tpf = sum(len(i) for i in ids) / sum(verify)
    report(
        f"ATOM_DSPARK on m3-chain (dspark-m3-chain draft, fp8 pool): {same}/{len(ids)} greedy "
        f"outputs identical to no speculation ({MAX_NEW} tokens each); tokens/forward {tpf:.2f}"
    )
    assert all(len(i) == MAX_NEW for i in ids)
    assert ids == baseline
    assert tpf >= 4.0, "the distilled draft, fed the M3 target's taps, reaches 4 tokens/forward"


def test_taps_and_fp8_draft_pool_in_the_log(spec_run):
    _, _, log = spec_run
    assert DRAFT_LINE.search(log), "the draft was loaded with its taps armed on the M3 target"
    m = POOL_LINE.search(log)
    assert m, "the worker logs its draft pool"
    assert (m.group(1), m.group(2)) == ("fp8", "torch.float8_e4m3fn")
    # K+V, 2 layers, 2 KV heads, head_dim 64 at 1 byte, plus one fp32 scale per (token, head)
    assert int(m.group(4)) == 2 * 2 * 2 * 64 + 2 * 2 * 2 * 4
    assert "sparse index cache: 3 layers" in log, "the target ran its sparse layers"
