"""Layer taps of sgl_atom's MiniMax-M3 model (what ATOM_DSPARK's worker reads from the target).

The model's decoder stack runs here with its own residual plumbing and real Gemma norms, and
stand-ins for attention and MLP (building the SGLang layers needs a server's runtime context;
the served taps are covered by tests/e2e/test_m3_dspark_serving.py): the capture must be the
output of each tapped HF layer, SGLang's Llama convention, and leave the forward unchanged.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.aux_hidden_states import AuxHiddenStateList, pack_aux_hidden_states
from sglang.srt.layers.layernorm import GemmaRMSNorm
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from torch import nn

from sgl_atom.models.minimax_m3 import M3DecoderLayer, M3Model, MiniMaxM3SparseForCausalLM
from sgl_atom.speculative.dspark.loader import arm_taps

HIDDEN, LAYERS, VOCAB, TOKENS, EPS = 16, 4, 37, 7, 1e-6


class _Mix(nn.Module):
    """Stand-in for attention / MLP: a fixed nonlinear map (positions and batch unused)."""

    def __init__(self, gen: torch.Generator):
        super().__init__()
        self.w = torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5

    def forward(self, *args):
        x = args[1] if len(args) == 3 else args[0]  # attention: (positions, x, batch)
        return torch.tanh(x @ self.w)


def _norm(gen: torch.Generator) -> GemmaRMSNorm:
    n = GemmaRMSNorm(HIDDEN, eps=EPS)
    n.weight.data.copy_(torch.randn(HIDDEN, generator=gen) * 0.1)
    return n


def _layer(gen: torch.Generator) -> M3DecoderLayer:
    layer = M3DecoderLayer.__new__(M3DecoderLayer)
    nn.Module.__init__(layer)
    layer.self_attn, layer.mlp = _Mix(gen), _Mix(gen)
    layer.input_layernorm, layer.post_attention_layernorm = _norm(gen), _norm(gen)
    return layer


def _model() -> M3Model:
    gen = torch.Generator().manual_seed(0)
    model = M3Model.__new__(M3Model)
    nn.Module.__init__(model)
    model.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
    model.embed_tokens.weight.data.copy_(torch.randn(VOCAB, HIDDEN, generator=gen))
    model.layers = nn.ModuleList(_layer(gen) for _ in range(LAYERS))
    model.norm = _norm(gen)
    model.start_layer, model.end_layer, model.layers_to_capture = 0, LAYERS, []
    return model


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * (1 + w)


def _layer_outputs(model: M3Model, ids: torch.Tensor) -> list[torch.Tensor]:
    """The residual stream after each layer, written out as a plain pre-norm loop."""
    stream, outs = model.embed_tokens.weight[ids].double(), []
    for layer in model.layers:
        attn, mlp = layer.self_attn.w.double(), layer.mlp.w.double()
        stream = stream + torch.tanh(_rms(stream, layer.input_layernorm.weight.double()) @ attn)
        stream = stream + torch.tanh(
            _rms(stream, layer.post_attention_layernorm.weight.double()) @ mlp
        )
        outs.append(stream)
    return outs


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("taps", [(0,), (1, 2), (0, 1, 2)], ids=["first", "middle", "all"])
def test_captures_the_output_of_each_tapped_layer(ids, taps):
    model = _model()
    model.layers_to_capture = [i + 1 for i in taps]
    aux = AuxHiddenStateList()
    with torch.no_grad():
        model(ids, None, None, None, aux)
    expected = _layer_outputs(model, ids)
    assert len(aux) == len(taps)
    for got, tap in zip(aux, taps, strict=True):
        torch.testing.assert_close(got.double(), expected[tap], rtol=1e-5, atol=1e-5)
    packed = pack_aux_hidden_states(aux)  # what the LogitsProcessor hands the worker
    assert packed.shape == (TOKENS, len(taps) * HIDDEN)


def test_embedding_is_layer_zeros_input(ids):
    model = _model()
    model.layers_to_capture = [0]
    aux = AuxHiddenStateList()
    with torch.no_grad():
        model(ids, None, None, None, aux)
    assert torch.equal(aux[0], model.embed_tokens.weight[ids])


def test_capturing_leaves_the_forward_unchanged(ids):
    model = _model()
    with torch.no_grad():
        plain = model(ids, None, None)
        model.layers_to_capture = [1, 2, 3]
        aux = AuxHiddenStateList()
        tapped = model(ids, None, None, None, aux)
    assert torch.equal(plain, tapped) and len(aux) == 3


class _Logits:
    def __call__(self, input_ids, hidden, lm_head, forward_batch, aux=None):
        self.aux = aux
        return hidden


def _causal_lm() -> MiniMaxM3SparseForCausalLM:
    lm = MiniMaxM3SparseForCausalLM.__new__(MiniMaxM3SparseForCausalLM)
    nn.Module.__init__(lm)
    lm.config = SimpleNamespace(num_hidden_layers=LAYERS)
    lm.model, lm.lm_head, lm.logits_processor = _model(), None, _Logits()
    lm.capture_aux_hidden_states = False
    return lm


@pytest.mark.parametrize(
    "mode, captured",
    [(CaptureHiddenMode.FULL, 2), (CaptureHiddenMode.LAST, 2), (CaptureHiddenMode.NULL, 0)],
    ids=["full", "last", "null"],
)
def test_armed_taps_reach_the_logits_processor_when_asked(ids, mode, captured):
    lm = _causal_lm()
    with torch.no_grad():
        plain = lm(ids, None, SimpleNamespace(capture_hidden_mode=mode))
    assert lm.logits_processor.aux is None
    arm_taps(lm, (1, 2), LAYERS)  # the worker's loader arms the taps through this hook
    assert lm.model.layers_to_capture == [2, 3]
    with torch.no_grad():
        out = lm(ids, None, SimpleNamespace(capture_hidden_mode=mode))
    assert torch.equal(out, plain)
    aux = lm.logits_processor.aux
    assert (0 if aux is None else len(aux)) == captured


@pytest.mark.parametrize("taps", [[1, 3], [], [-1, 1]], ids=["last", "none", "negative"])
def test_uncapturable_taps_are_refused(taps):
    with pytest.raises(ValueError, match=r"give layer ids in \[0, 3\)"):
        _causal_lm().set_dflash_layers_to_capture(taps)


def test_embed_and_head_are_the_targets():
    lm = _causal_lm()
    lm.lm_head = SimpleNamespace(weight=torch.zeros(VOCAB, HIDDEN))
    embed, head = lm.get_embed_and_head()
    assert embed is lm.model.embed_tokens.weight and head is lm.lm_head.weight
