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
from helpers import assert_close_rel, poisoned  # noqa: E402
from sgl_atom.kernels.row_quant import quant_rows_fp8, reference_quant_rows_fp8  # noqa: E402
from test_dspark_draft_model import TOL, Case, chain_draft, placed  # noqa: E402
from test_dspark_fp8_weights import TOL_FP8_WEIGHTS, fp8_oracle, fp8_pass  # noqa: E402

from sgl_atom.speculative.dspark import reference as ref  # noqa: E402
from sgl_atom.speculative.dspark.fp8_weights import Fp8Rows, fp8_matmul  # noqa: E402
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


def test_fp8_gemms_on_cuda(report):
    """The per-row quantization kernel writes the reference's bytes and scales on CUDA, and the
    fp8 GEMM (torch._scaled_mm) is the float64 product of its quantized operands, at a
    Llama-8B draft's widths."""
    x = torch.randn(256, 14336, device="cuda").bfloat16() * 3
    q, s = poisoned(x.shape, torch.float8_e4m3fn, "cuda"), poisoned((256, 1), torch.float32, "cuda")
    quant_rows_fp8(x, q, s)
    wq, ws = reference_quant_rows_fp8(x)
    assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(s, ws)
    w = Fp8Rows.of(torch.randn(4096, 14336, device="cuda").bfloat16() * 0.02)
    out = fp8_matmul(x, w, torch.bfloat16)
    want = (q.double() * s.double()) @ w.dequantized().double().T
    assert_close_rel(out, want, 2**-8, "fp8 GEMM")
    report("GPU fp8 draft GEMM: row quantization bytes equal the reference; GEMM vs float64 ok")


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_fp8_weight_draft_on_cuda(oracle, dtype, report):
    """--speculative-draft-model-quantization fp8 on CUDA: the quantized draft's context write
    and pass against the float64 reference of the weights it serves (the unit test's)."""
    served = placed(oracle, torch.bfloat16, "cuda")
    served.quantize_fp8()
    weights = fp8_oracle(served)
    case, args, base = fp8_pass(served, dtype, seed=23, device="cuda")
    for b, want in enumerate(case.reference(weights, served.dspark)):
        assert_close_rel(base[b].cpu(), want, TOL_FP8_WEIGHTS[dtype], f"base logits, context {b}")
    tokens = served.propose(**args)
    expected = case.reference_drafts(weights, served.dspark)
    same = sum(tokens[b].tolist() == e.tolist() for b, e in enumerate(expected))
    report(f"GPU DSpark fp8-weight draft, {dtype} pool: {same}/{len(expected)} blocks as float64")


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_draft_graphs_replay_the_eager_pass_and_write_on_cuda(oracle, dtype, report):
    """The draft's CUDA graphs (draft_graphs.capture) on the unit test's ragged batch: the
    propose replay, at its own size and padded into a larger graph, gives each request's anchor
    (the last of its accepted tokens) and, bit for bit, the drafts of the same pass launched
    eagerly (the unit test checks that pass against the per-step one); the context-write
    replay stores at the committed rows' slots what the eager write stores, and nothing
    elsewhere but SGLang's padding slot."""
    import copy

    from sgl_atom.speculative.dspark.draft_graphs import DraftPass, capture, verify_context_rows
    from sgl_atom.speculative.dspark.pool import write_context_kv

    served = placed(oracle, torch.bfloat16, "cuda")
    case = Case(served, dtype, seed=23, device="cuda")
    case.write_context(served)
    args = case.pass_args(served)
    want = served.propose(**args)
    bs, window, gen = len(case.LENS), served.dspark.block_size + 1, torch.Generator()
    gen.manual_seed(int(torch.randint(0, 1 << 30, ())))
    req_to_token = torch.zeros(bs + 6, max(case.LENS) + 9, dtype=torch.int32)
    rows = torch.randperm(bs + 6, generator=gen)[:bs]
    req_to_token[rows, : case.context_slots.shape[1]] = case.context_slots
    dpass = DraftPass(served, case.pool, args["embed"], args["lm_head"], req_to_token.cuda(),
                      bs + 2, window)  # fmt: skip
    graphs = capture(dpass, [bs, bs + 2])
    assert graphs is not None and graphs.writes, "capture failed (see the log)"
    accept_lens = torch.randint(1, window + 1, (bs,), generator=gen)
    accepted = torch.randint(0, served.dspark.vocab_size, (bs, window), generator=gen)
    accepted[torch.arange(bs), accept_lens - 1] = case.anchors
    lens = torch.tensor(case.LENS)
    inputs = [t.cuda() for t in (accepted.flatten(), accept_lens, lens, rows)]
    same = 0
    for size in (bs, bs + 2):  # the graph of the batch's own size, then padded into a larger
        graphs.sizes = [size]
        got = graphs.propose(*inputs)
        assert got is not None, f"no graph of {size} rows"
        got = got.clone()
        dpass.load(*inputs)  # the same pass launched eagerly: the same kernels, bit for bit
        assert torch.equal(got, dpass.run(size)[:bs]), f"graph of {size} rows"
        assert torch.equal(got[:, 0].cpu(), case.anchors), "the anchors: last accepted tokens"
        # against the per-step pass (another table width: a near-tie may flip), reported
        same += sum(a.tolist() == b.tolist() for a, b in zip(got[:, 1:], want, strict=True))
    graphs.sizes = sorted(graphs.graphs)

    # the context write of a verify: poisoned free slots of the pool, then the graph's write
    # against the eager write into a copy of the pool
    width = served.dspark.num_taps * served.dspark.tap_hidden_size
    taps = torch.randn(bs * window, width, generator=gen).to("cuda", served.dtype)
    free = torch.tensor(sorted(set(range(1, Case.SLOTS)) - set(torch.cat(case.slots).tolist())))
    # the pool has 23 free slots for 25 window rows: at most 3 rows committed per request, the
    # slots of rows past them repeat (they go to slot 0)
    window_slots = free[torch.randperm(free.numel(), generator=gen)].repeat(2)[: bs * window]
    write_lens = torch.randint(1, 4, (bs,), generator=gen)
    starts = torch.randint(0, 40, (bs,), generator=gen)
    cols = torch.arange(window)
    accept_index = torch.where(
        cols < write_lens[:, None], torch.arange(bs)[:, None] * window + cols, -1
    ).to(torch.int32)
    inputs = [t.cuda() for t in (accept_index, write_lens, starts, window_slots)]
    eager = copy.deepcopy(case.pool)
    r, p, s = verify_context_rows(*inputs, window)
    write_context_kv(served, eager, taps[r], p, s, dpass.max_position)
    assert graphs.write_context(taps, *inputs)
    torch.cuda.synchronize()
    written = s[s > 0]
    tol = 1e-2 if dtype == "bf16" else 4e-2
    for layer in range(served.dspark.num_hidden_layers):
        pair = zip(eager.read(layer, written), case.pool.read(layer, written), strict=True)
        for a, b in pair:
            assert_close_rel(b.float().cpu(), a.float().cpu(), tol, what=f"layer {layer} K/V")
    for a, b in zip(eager.k_all + eager.v_all, case.pool.k_all + case.pool.v_all, strict=True):
        rest = torch.ones(a.shape[0], dtype=torch.bool, device=a.device)
        rest[written], rest[0] = False, False
        assert torch.equal(a[rest].view(torch.uint8), b[rest].view(torch.uint8)), "other slots"
    report(f"GPU DSpark draft graphs, {dtype} pool: propose and context write replay as eager; "
           f"{same}/{2 * bs} blocks as the per-step pass")  # fmt: skip
