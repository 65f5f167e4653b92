"""The DSpark draft's fp8 GEMMs (``--speculative-draft-model-quantization fp8``): the GEMM
against float64 over its dequantized operands, the flag's resolution and refusals, and the
quantized draft's passes against the float64 reference of the weights it serves."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from sgl_atom.kernels.draft_markov import reference_markov_argmax

from sgl_atom.speculative.dspark.fp8_weights import (
    DraftFp8LinearMethod,
    Fp8Rows,
    draft_quantization,
    fp8_matmul,
    quant_rows,
    weight_rows,
)
from sgl_atom.speculative.dspark.weights import init_draft_weights

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "kernels"))
from helpers import assert_close_rel  # noqa: E402
from test_draft_markov import check_against_float64  # noqa: E402
from test_dspark_draft_model import Case, build, chain_draft, placed  # noqa: E402

# fp8 activations (3 mantissa bits, per-row scales) into every GEMM of two layers and the LM
# head, bf16 between them; the fp8 pool's K/V rows on top
TOL_FP8_WEIGHTS = {"bf16": 6e-2, "fp8": 7e-2}  # measured: 4.0-4.5e-2 both


@pytest.fixture(scope="module")
def model():
    return chain_draft()


@pytest.mark.parametrize("kernels", ["triton", "reference"])
def test_fp8_matmul_is_the_float64_product_of_its_quantized_operands(kernels, monkeypatch):
    monkeypatch.setenv("SGL_ATOM_CPU_KERNELS", kernels)
    gen = torch.Generator().manual_seed(29)
    w = Fp8Rows.of(torch.randn(96, 160, generator=gen).to(torch.bfloat16))
    x = (torch.randn(3, 7, 160, generator=gen) * torch.logspace(-2, 1, 7)[:, None]).bfloat16()
    out = fp8_matmul(x, w, torch.bfloat16)
    assert out.shape == (3, 7, 96) and out.dtype == torch.bfloat16
    xq, xs = quant_rows(x.reshape(-1, 160))
    want = (xq.double() * xs.double()) @ w.dequantized().double().T
    assert_close_rel(out.reshape(-1, 96), want, 2**-8, "fp8 GEMM")  # bf16 output rounding
    # row k onwards of a fused weight: the same rows of the product
    tail = fp8_matmul(x, w.rows(32), torch.bfloat16)
    assert torch.equal(tail, out[..., 32:])
    # the quantized x is close to x itself (per-row scales): what the draft's logits carry
    assert_close_rel((xq.double() * xs.double()).view(x.shape), x.double(), 4e-2, "x")
    assert fp8_matmul(x[:0], w, torch.bfloat16).shape == (0, 7, 96)


def test_fp8_rows_refuse_dimensions_the_gemm_cannot_take():
    with pytest.raises(ValueError, match=r"fc is \[24, 32\].*multiples of 16.*unquantized"):
        Fp8Rows.of(torch.randn(24, 32), "fc")


@pytest.mark.parametrize(
    "value,explicit,want",
    [
        ("fp8", True, "fp8"),
        ("fp8", None, "fp8"),  # before SGLang fills its default: given means explicit
        ("fp8", False, None),  # filled from the target's --quantization: not the draft's
        ("unquant", True, None),
        (None, None, None),
    ],
)
def test_draft_quantization_follows_only_an_explicit_flag(value, explicit, want):
    args = SimpleNamespace(
        speculative_draft_model_quantization=value,
        _speculative_draft_quantization_explicitly_set=explicit,
    )
    assert draft_quantization(args) == want


def test_draft_quantization_refuses_a_method_the_draft_does_not_take():
    args = SimpleNamespace(
        speculative_draft_model_quantization="awq",
        _speculative_draft_quantization_explicitly_set=True,
    )
    with pytest.raises(ValueError, match=r"--speculative-draft-model-quantization awq.*fp8"):
        draft_quantization(args)


def test_quantize_checks_every_layer_before_changing_any(model):
    m = build(torch.float32, intermediate_size=520)  # down_proj's input: 520 % 16 != 0
    w = init_draft_weights(m.dspark, seed=1, init_range=0.05, dtype=torch.float32)
    m.load_weights(w.items())
    m.place("cpu", torch.bfloat16)
    before = {n: p.clone() for n, p in m.named_parameters()}
    with pytest.raises(ValueError, match=r"layers.0.mlp.down_proj is \[256, 520\]"):
        m.quantize_fp8()
    assert m.weight_quantization is None
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())


def fp8_oracle(m) -> dict[str, torch.Tensor]:
    """The float64 reference's weights for a quantized draft: the dequantized rows it serves."""
    return {k: v.double().cpu() for k, v in m.checkpoint_weights().items()}


def fp8_pass(m, dtype: str, seed: int, device: str = "cpu") -> tuple:
    """A fresh Case for the quantized draft ``m`` (its pool at ``dtype``), its context written
    and one pass drafted with the case's LM head as fp8 rows; the case's ``head`` becomes those
    rows dequantized, what the oracle multiplies by. Returns (case, pass args, base logits)."""
    case = Case(m, dtype, seed=seed, device=device)
    head = Fp8Rows.of(case.head.to(device=device, dtype=torch.bfloat16))
    case.head = head.dequantized().double().cpu()
    case.write_context(m)
    args = {**case.pass_args(m), "lm_head": head}
    return case, args, m.base_logits(**args)


@pytest.mark.parametrize("kernels", ["triton", "reference"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_fp8_draft_matches_the_float64_reference_of_its_weights(model, dtype, kernels, monkeypatch):
    """Every GEMM of the pass and of the context write runs in fp8 (SGLang's layers carrying
    DraftFp8LinearMethod, the LM head as fp8 rows); the float64 oracle multiplies by the same
    dequantized weights, so what differs is the activations' fp8 rounding."""
    monkeypatch.setenv("SGL_ATOM_CPU_KERNELS", kernels)
    m = placed(model, torch.bfloat16)
    quantized = {**m.linear_layers(), "markov_w2": m.markov_head.markov_w2}
    bf16_bytes = sum(mod.weight.nbytes for mod in quantized.values())
    fp8_bytes = m.quantize_fp8()
    assert m.weight_quantization == "fp8" and fp8_bytes < 0.6 * bf16_bytes
    for name, mod in quantized.items():
        assert isinstance(mod.quant_method, DraftFp8LinearMethod), name
        assert mod.weight.dtype == torch.float8_e4m3fn, name
    assert m.markov_head.markov_w1.weight.dtype == torch.bfloat16  # an embedding: rows gathered
    case, args, base = fp8_pass(m, dtype, seed=31)
    want = case.reference(fp8_oracle(m), m.dspark)
    for b, n in enumerate(case.LENS):
        assert_close_rel(base[b], want[b], TOL_FP8_WEIGHTS[dtype], f"base logits, context {n}")
    # the Markov refinement walks from those logits with the fp8 w2 rows and their scales: the
    # float64 walk over the dequantized w2 wherever its picks are clear of float32 rounding
    tokens = m.propose(**args)
    w1, w2 = m.markov_head.markov_w1.weight, weight_rows(m.markov_head.markov_w2)
    prev = case.anchors
    for j in range(tokens.shape[1]):
        _, logits = reference_markov_argmax(base[:, j], prev, w1, w2.q, w2.scale)
        check_against_float64(tokens[:, j], logits, 1e-4 * logits.amax(-1).abs().clamp_min(1))
        prev = tokens[:, j]
    with pytest.raises(RuntimeError, match="before quantizing"):
        m.place("cpu", torch.bfloat16)
