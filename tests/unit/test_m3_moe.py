"""sgl_atom's MiniMax-M3 MoE block (routing, SGLang's FusedMoE, shared expert) against float64.

The block is built with SGLang's real layers in a scoped runtime context (no server). On CPU
FusedMoE runs its native per-expert path, which returns a new tensor. On CUDA the unquantised
FusedMoE runs the Triton runner, which with the layer's ``moe_runner_config.inplace`` set writes
the routed output over its input (SGLang 0.5.23 layers/moe/moe_runner/triton_utils/fused_moe.py:
619, ``out_hidden_states = hidden_states``). That runner cannot run here (its block alignment is
a CUDA op), so a stand-in does the same experts math and honours the same flag: the block must
match the float64 reference on both, i.e. the shared expert must see the normed hidden states,
not the routed output.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from m3_reference import route
from sgl_atom.testing.tiny import KINDS, m3_config

HIDDEN, EXPERTS, TOP_K, INTER, TOKENS, SCALE = 64, 4, 2, 32, 37, 2.0
TOL = 1e-2  # bf16 activations and weights vs float64: measured 4.3e-3 and 4.7e-3


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    """A runtime context of a CPU server for a small m3 config (FusedMoE reads it when built)."""
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    path = tmp_path_factory.mktemp("m3-moe")
    spec = dict(KINDS["m3"][0], hidden=HIDDEN, experts=EXPERTS, intermediate=INTER)
    (path / "config.json").write_text(json.dumps(m3_config(512, spec)))
    args = ServerArgs(
        model_path=str(path), device="cpu", attention_backend="atom", dtype="bfloat16"
    )
    return rc.create_context(args, role="scheduler", ranks=rc.SpawnRanks(world_rank=0))


@contextmanager
def _active(context):
    from sglang.srt import runtime_context as rc

    with rc.use_context(context), context.parallel.override(tp_group=None):
        yield


def _build(context, quant_config=None):
    """An M3MoE as SGLang's model loader builds it: bf16 default dtype (router bias float32)."""
    from sgl_atom.models.minimax_m3 import M3MoE

    cfg = SimpleNamespace(
        hidden_size=HIDDEN,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        intermediate_size=INTER,
        scoring_func="sigmoid",
        routed_scaling_factor=SCALE,
        use_routing_bias=True,
        n_shared_experts=1,
    )
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with _active(context):
            return M3MoE(cfg, layer_id=1, quant_config=quant_config)
    finally:
        torch.set_default_dtype(before)


def _moe(context, seed: int):
    """An unquantised M3MoE with random weights."""
    moe = _build(context)
    gen = torch.Generator().manual_seed(seed)
    for p in moe.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return moe


def _cuda_runner_stand_in(moe):
    """FusedMoE.run_moe_core as the CUDA Triton runner behaves: experts as SGLang computes them,
    written over the input when the layer's runner config says ``inplace``."""
    from sglang.srt.layers.moe.fused_moe_native import moe_forward_native
    from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

    layer = moe.experts

    def run(dispatch_output):
        x = dispatch_output.hidden_states
        out = moe_forward_native(layer, x, dispatch_output.topk_output, layer.moe_runner_config)
        if layer.moe_runner_config.inplace:
            out = x.copy_(out)
        return StandardCombineInput(hidden_states=out)

    layer.run_moe_core = run


def _reference(moe, x: torch.Tensor) -> torch.Tensor:
    """Routed experts (the reference's routing) plus the shared expert, in float64."""
    d = torch.float64
    x = x.to(d)
    weights, ids = route(
        x @ moe.gate.weight.to(d).T, moe.e_score_correction_bias, TOP_K, "sigmoid", SCALE
    )
    w13, w2 = moe.experts.w13_weight.to(d), moe.experts.w2_weight.to(d)
    out = torch.zeros_like(x)
    for slot in range(TOP_K):
        e = ids[:, slot]
        gate_up = torch.einsum("th,tih->ti", x, w13[e])
        h = F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]
        out += torch.einsum("ti,thi->th", h, w2[e]) * weights[:, slot, None].to(d)
    shared = moe.shared_experts
    gate_up = x @ shared.gate_up_proj.weight.to(d).T
    h = F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]
    return out + h @ shared.down_proj.weight.to(d).T


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("path", ["cpu-native", "cuda-triton-contract"])
@pytest.mark.parametrize("seed", [0, 1])
def test_moe_block_matches_float64(context, path, seed):
    moe = _moe(context, seed)
    if path == "cuda-triton-contract":
        _cuda_runner_stand_in(moe)
    gen = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16()
    ref = _reference(moe, x)
    with _active(context), torch.no_grad():
        out = moe(x.clone())
    assert out.dtype == torch.bfloat16 and out.shape == (TOKENS, HIDDEN)
    assert _rel_err(out, ref) < TOL, f"relative error {_rel_err(out, ref):.4f}"


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_route_margin_is_the_gap_to_the_first_expert_left_out(scoring):
    """The e2e's fp8-vs-bf16 rule trusts this margin to name expert-routing near-ties: it is the
    last picked expert's choice score minus the best unpicked one's, computed here by hand, and
    0 where two experts tie across the cut."""
    from m3_reference import route_margin

    torch.manual_seed(0)
    logits, bias = torch.randn(6, 8), torch.randn(8) * 0.1
    logits[5, 2] = logits[5, 6] = 3.0  # one token with a tie across the top-2 cut
    bias[2] = bias[6] = 0.0
    logits[5, [0, 1, 3, 4, 5, 7]] = -5.0
    logits[5, 0] = 4.0  # picked first; experts 2 and 6 tie for the second pick
    margin = route_margin(logits, bias, 2, scoring)
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(-1)
    choice = scores + bias
    _, ids = route(logits, bias, 2, scoring, 1.0)
    for t in range(6):
        picked = choice[t, ids[t]].min()
        left = choice[t, [e for e in range(8) if e not in ids[t].tolist()]].max()
        assert margin[t].item() == pytest.approx(float(picked - left), abs=1e-7)
    assert margin[5].item() == 0.0
    assert (margin[:5] > 0).all()
    assert route_margin(logits, bias, 8, scoring).isinf().all()


# ---- --quantization fp8: what the block builds and how an fp8 checkpoint loads into it ------


def _fp8_moe(context):
    """An M3MoE built for a per-tensor fp8 checkpoint (SGLang's Fp8Config, dynamic activations)."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    quant = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic")
    return _build(context, quant)


def test_fp8_reaches_the_experts_and_the_shared_expert_not_the_router(context):
    moe = _fp8_moe(context)
    methods = {
        n: type(m.quant_method).__name__
        for n, m in moe.named_modules()
        if getattr(m, "quant_method", None) is not None
    }
    assert methods["experts"] == "Fp8MoEMethod"
    assert methods["shared_experts.gate_up_proj"] == "Fp8LinearMethod"
    assert methods["shared_experts.down_proj"] == "Fp8LinearMethod"
    assert methods["gate"] == "UnquantizedLinearMethod"
    assert moe.experts.w13_weight.dtype == torch.float8_e4m3fn
    assert moe.gate.weight.dtype == torch.bfloat16


def _stack(moe):
    """The model class around one MoE layer (layer 1 of two), for its load_weights."""
    from torch import nn

    from sgl_atom.models.minimax_m3 import MiniMaxM3SparseForCausalLM

    lm = MiniMaxM3SparseForCausalLM.__new__(MiniMaxM3SparseForCausalLM)
    nn.Module.__init__(lm)
    lm.model = nn.Module()
    lm.model.layers = nn.ModuleList([nn.Module(), nn.Module()])
    lm.model.layers[1].mlp = moe
    lm.model.start_layer, lm.model.end_layer = 0, 2
    return lm


def _bf16_checkpoint(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Layer 1's MoE weights as a bf16 checkpoint names them (no scales)."""
    p = "model.layers.1.block_sparse_moe."
    ckpt = {p + "gate.weight": torch.randn(EXPERTS, HIDDEN, generator=gen).bfloat16()}
    ckpt[p + "e_score_correction_bias"] = torch.randn(EXPERTS, generator=gen)
    for e in range(EXPERTS):
        for w, shape in (("w1", (INTER, HIDDEN)), ("w3", (INTER, HIDDEN)), ("w2", (HIDDEN, INTER))):
            ckpt[f"{p}experts.{e}.{w}.weight"] = torch.randn(*shape, generator=gen).bfloat16()
    for w, shape in (
        ("gate_proj", (INTER, HIDDEN)),
        ("up_proj", (INTER, HIDDEN)),
        ("down_proj", (HIDDEN, INTER)),
    ):
        ckpt[f"{p}shared_experts.{w}.weight"] = torch.randn(*shape, generator=gen).bfloat16()
    return ckpt


def test_fp8_over_a_bf16_checkpoint_loads_without_the_scales_it_makes_itself(context):
    """--quantization fp8 over a bf16 checkpoint (quantised at load): the expert scales FusedMoE
    creates as parameters are not asked of the checkpoint, every weight lands, and a weight the
    checkpoint lacks is still refused by name; an fp8 checkpoint must bring its scales."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    gen = torch.Generator().manual_seed(11)
    online = Fp8Config(is_checkpoint_fp8_serialized=False, activation_scheme="dynamic")
    moe = _build(context, online)
    lm = _stack(moe)
    ckpt = _bf16_checkpoint(gen)
    with _active(context):
        loaded = lm.load_weights(ckpt.items())
    scales = {n for n, _ in lm.named_parameters() if n.endswith("_scale")}
    assert scales >= {"model.layers.1.mlp.experts.w13_weight_scale"}
    assert loaded == {n for n, _ in lm.named_parameters()} - scales
    w1 = ckpt["model.layers.1.block_sparse_moe.experts.2.w1.weight"]
    assert torch.equal(moe.experts.w13_weight[2, :INTER], w1)

    gone = "model.layers.1.block_sparse_moe.shared_experts.down_proj.weight"
    with _active(context), pytest.raises(KeyError, match="shared_experts.down_proj.weight"):
        _stack(_build(context, online)).load_weights((n, t) for n, t in ckpt.items() if n != gone)
    with _active(context), pytest.raises(KeyError, match="w13_weight_scale"):
        _stack(_fp8_moe(context)).load_weights(
            (n, t.to(torch.float8_e4m3fn) if t.dtype == torch.bfloat16 else t)
            for n, t in ckpt.items()
        )


def test_an_fp8_checkpoint_loads_every_expert_weight_and_scale_into_its_slot(context):
    """load_weights of the model class, on a stack holding one fp8 MoE layer: each expert's
    w1/w3/w2 bytes and per-tensor scales land in FusedMoE's w13/w2 slots (w1 first), the
    shared expert's in its merged projection, and nothing is left unloaded."""
    moe = _fp8_moe(context)
    lm = _stack(moe)
    gen = torch.Generator().manual_seed(7)

    def fp8(*shape):
        return (torch.randn(*shape, generator=gen) * 0.5).to(torch.float8_e4m3fn)

    def scale():
        return torch.rand((), generator=gen) + 0.5

    p = "model.layers.1.block_sparse_moe."
    ckpt = {p + "gate.weight": torch.randn(EXPERTS, HIDDEN, generator=gen).bfloat16()}
    ckpt[p + "e_score_correction_bias"] = torch.randn(EXPERTS, generator=gen)
    for e in range(EXPERTS):
        for w, shape in (("w1", (INTER, HIDDEN)), ("w3", (INTER, HIDDEN)), ("w2", (HIDDEN, INTER))):
            ckpt[f"{p}experts.{e}.{w}.weight"] = fp8(*shape)
            ckpt[f"{p}experts.{e}.{w}.weight_scale"] = scale()
    for w, shape in (("gate_proj", (INTER, HIDDEN)), ("up_proj", (INTER, HIDDEN))):
        ckpt[f"{p}shared_experts.{w}.weight"] = fp8(*shape)
        ckpt[f"{p}shared_experts.{w}.weight_scale"] = scale()
    ckpt[f"{p}shared_experts.down_proj.weight"] = fp8(HIDDEN, INTER)
    ckpt[f"{p}shared_experts.down_proj.weight_scale"] = scale()

    with _active(context):
        loaded = lm.load_weights(ckpt.items())
    assert loaded == {n for n, _ in lm.named_parameters()}
    ex = moe.experts

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    for e in range(EXPERTS):
        c = f"{p}experts.{e}."
        assert same(ex.w13_weight[e, :INTER], ckpt[c + "w1.weight"])
        assert same(ex.w13_weight[e, INTER:], ckpt[c + "w3.weight"])
        assert same(ex.w2_weight[e], ckpt[c + "w2.weight"])
        assert ex.w13_weight_scale[e].tolist() == [
            ckpt[c + "w1.weight_scale"].item(),
            ckpt[c + "w3.weight_scale"].item(),
        ]
        assert ex.w2_weight_scale[e].item() == ckpt[c + "w2.weight_scale"].item()
    shared = moe.shared_experts.gate_up_proj
    assert same(shared.weight[:INTER], ckpt[p + "shared_experts.gate_proj.weight"])
    assert same(shared.weight[INTER:], ckpt[p + "shared_experts.up_proj.weight"])
    assert shared.weight_scale.tolist() == [
        ckpt[p + "shared_experts.gate_proj.weight_scale"].item(),
        ckpt[p + "shared_experts.up_proj.weight_scale"].item(),
    ]


def test_a_quantization_other_than_fp8_is_refused_naming_fp8():
    from sgl_atom.models.minimax_m3 import M3ServingError, check_quantization

    check_quantization(None)
    check_quantization(SimpleNamespace(get_name=lambda: "fp8"))
    with pytest.raises(M3ServingError, match="got quantization 'awq'.*--quantization fp8"):
        check_quantization(SimpleNamespace(get_name=lambda: "awq"))
