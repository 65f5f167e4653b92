"""The DSpark draft on CUDA against the float64 reference: the unit test's ragged batch (NaN
rows everywhere no context lives) through the served path, i.e. SGLang's fused q/k/v and
gate/up layers, its RMSNorm and rotary kernels, the Triton KV store and block attention at the
device's tiling."""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

UNIT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "unit")
sys.path[:0] = [UNIT, os.path.join(UNIT, "kernels")]
from helpers import assert_close_rel  # noqa: E402
from test_dspark_draft_model import TOL, Case, chain_draft, placed  # noqa: E402

from sgl_atom.speculative.dspark import reference as ref  # noqa: E402
from sgl_atom.speculative.dspark.markov import markov_refine  # noqa: E402


@pytest.fixture(scope="module")
def oracle():
    return chain_draft()


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_draft_pass_and_context_write_on_cuda(oracle, dtype, report):
    served = placed(oracle, torch.bfloat16, "cuda")
    case = Case(served, dtype, seed=21, device="cuda")
    case.write_context(served)
    for b, (t, s) in enumerate(zip(case.taps, case.slots, strict=True)):
        want = ref.reference_context_kv(
            oracle.checkpoint_weights(), oracle.dspark, t, torch.arange(t.shape[0])
        )
        for layer, (k, v) in enumerate(want):
            rk, rv = case.pool.read(layer, s.cuda())
            assert_close_rel(rk.cpu(), k, TOL[dtype], what=f"K layer {layer} context {b}")
            assert_close_rel(rv.cpu(), v, TOL[dtype], what=f"V layer {layer} context {b}")
    base = served.base_logits(**case.pass_args(served)).cpu()
    want = case.reference(oracle.checkpoint_weights(), oracle.dspark)
    for b, n in enumerate(case.LENS):
        assert_close_rel(base[b], want[b], TOL[dtype], what=f"base logits, context {n}")
    # the drafts are the Markov refinement of those logits (the fused kernel on CUDA against
    # the torch steps); how many blocks float64 drafts alike is reported (a near-tie may flip)
    args = case.pass_args(served)
    tokens = served.propose(**args)
    w1, w2 = served.markov_head.markov_w1.weight, served.markov_head.markov_w2.weight
    base = served.base_logits(**args)
    assert torch.equal(tokens, markov_refine(base, args["anchors"], w1, w2, return_logits=True)[0])
    expected = case.reference_drafts(oracle.checkpoint_weights(), oracle.dspark)
    same = sum(tokens[b].tolist() == e.tolist() for b, e in enumerate(expected))
    report(f"GPU DSpark draft, {dtype} pool: {same}/{len(expected)} blocks drafted as float64")
