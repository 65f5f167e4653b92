"""sgl_atom's MiniMax-M3 model split into pipeline stages, without a server.

The hand-built decoder stack of test_m3_taps (real Gemma norms, stand-ins for attention and
MLP) cut into stage 0 (layers 0-1) and stage 1 (layers 2-3) as ``make_pp_layers`` cuts it:
the stages chained through their ``PPProxyTensors`` give the whole model's output; each stage
captures the taps whose layer it holds, keyed by HF layer id; the atom backend's top-k
selection crosses with the hidden states; a stage's index cache holds its own sparse layers and
names its writers by global layer id, and the P/D description of a stage names only those.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.utils import PPMissingLayer
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, PPProxyTensors
from test_disagg_backend import _Pool
from test_m3_taps import LAYERS, TOKENS, VOCAB, _layer_outputs, _Logits, _model
from torch import nn

from sgl_atom.attention.sparse import (
    PP_COUNT,
    PP_SELECTED,
    IndexCache,
    SparseAttention,
    SparseConfig,
)
from sgl_atom.disagg.pool_regions import describe_pool
from sgl_atom.models.minimax_m3 import (
    M3Model,
    MiniMaxM3SparseForCausalLM,
    StageTaps,
)

SPLIT = 2  # stage 0: layers [0, 2), stage 1: [2, 4)
SPARSE = (1, 2, 3)  # the tiny m3 kind: ordinals 0 and 2 score, ordinal 1 (layer 2) reuses
KV_HEADS, TOPK, INDEX_DIM, SLOTS, HEAD_DIM, PAGE = 2, 3, 128, 40, 64, 4


def _sparse_cfg(reuse: bool = True) -> SparseConfig:
    return SparseConfig(
        sparse_layer_ids=SPARSE,
        topk_blocks=TOPK,
        init_blocks=1,
        local_blocks=1,
        index_dim=INDEX_DIM,
        num_index_heads=KV_HEADS,
        use_index_cache=reuse,
        index_topk_freq=2 if reuse else 1,
        ordinal_of={lid: o for o, lid in enumerate(SPARSE)},
    )


def _stage(whole: M3Model, start: int, end: int) -> M3Model:
    """The stage of ``whole`` holding layers [start, end), as make_pp_layers builds it."""
    stage = M3Model.__new__(M3Model)
    nn.Module.__init__(stage)
    stage.embed_tokens = whole.embed_tokens if start == 0 else PPMissingLayer()
    stage.layers = nn.ModuleList(
        layer if start <= i < end else PPMissingLayer() for i, layer in enumerate(whole.layers)
    )
    stage.norm = whole.norm if end == LAYERS else PPMissingLayer(return_tuple=True)
    stage.start_layer, stage.end_layer = start, end
    stage.layers_to_capture = list(whole.layers_to_capture)
    return stage


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(1))


def _chain(whole: M3Model, ids, batch=None):
    """Run stage 0 then stage 1; (stage 0's proxy, final hidden, taps of stage 0, of stage 1)."""
    first, last = _stage(whole, 0, SPLIT), _stage(whole, SPLIT, LAYERS)
    taps0, taps1 = StageTaps(), StageTaps()
    with torch.no_grad():
        proxy = first(ids, None, batch, None, taps0)
        out = last(None, None, batch, None, taps1, pp_proxy_tensors=proxy)
    return proxy, out, taps0, taps1


def test_stages_chained_equal_the_whole_model(ids):
    whole = _model()
    with torch.no_grad():
        expected = whole(ids, None, None)
    proxy, out, _, _ = _chain(whole, ids)
    assert isinstance(proxy, PPProxyTensors)
    assert set(proxy.tensors) == {"hidden_states", "residual"}  # no sparse layers
    assert proxy["hidden_states"].shape == proxy["residual"].shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "taps, on_first, on_last",
    [((0,), [0], []), ((1, 2), [], [1, 2]), ((0, 1, 2), [0], [1, 2])],
    ids=["first-stage", "boundary-and-last", "both"],
)
def test_each_stage_captures_the_taps_of_the_layers_it_holds(ids, taps, on_first, on_last):
    """HF layer i's output enters layer i + 1: the stage holding layer i + 1 captures it, so
    HF layer 1 (stage 0's output) is captured by stage 1 as its input."""
    whole = _model()
    whole.layers_to_capture = [i + 1 for i in taps]
    _, _, taps0, taps1 = _chain(whole, ids)
    assert sorted(taps0) == on_first and sorted(taps1) == on_last
    expected = _layer_outputs(whole, ids)
    for hf_layer, got in {**taps0, **taps1}.items():
        torch.testing.assert_close(got.double(), expected[hf_layer], rtol=1e-5, atol=1e-5)


def _causal_lm(model: M3Model) -> MiniMaxM3SparseForCausalLM:
    lm = MiniMaxM3SparseForCausalLM.__new__(MiniMaxM3SparseForCausalLM)
    nn.Module.__init__(lm)
    lm.config = SimpleNamespace(num_hidden_layers=LAYERS)
    lm.model, lm.lm_head, lm.logits_processor = model, None, _Logits()
    lm.capture_aux_hidden_states = False
    return lm


def test_stage_models_leave_taps_by_hf_layer_and_the_last_packs_them_in_order(ids):
    whole = _model()
    first, last = _causal_lm(_stage(whole, 0, SPLIT)), _causal_lm(_stage(whole, SPLIT, LAYERS))
    for lm in (first, last):
        lm.set_dflash_layers_to_capture([0, 2])
    assert first.held_taps == [0] and last.held_taps == [2]
    batch = SimpleNamespace(capture_hidden_mode=CaptureHiddenMode.FULL)
    with torch.no_grad():
        proxy = first(ids, None, batch)
        assert isinstance(proxy, PPProxyTensors) and sorted(first.stage_taps) == [0]
        last(None, None, batch, pp_proxy_tensors=proxy)
        alone = last.logits_processor.aux  # its own tap only, as SGLang's Llama hands it
        last(None, None, batch, pp_proxy_tensors=proxy, carried_taps=first.stage_taps)
        packed = last.logits_processor.aux
    expected = _layer_outputs(whole, ids)
    assert len(alone) == 1 and sorted(last.stage_taps) == [2]
    torch.testing.assert_close(alone[0].double(), expected[2], rtol=1e-5, atol=1e-5)
    assert len(packed) == 2
    for got, hf_layer in zip(packed, (0, 2), strict=True):
        torch.testing.assert_close(got.double(), expected[hf_layer], rtol=1e-5, atol=1e-5)


def test_a_relay_can_wrap_the_layers_capture_hook(ids):
    """sgl_atom.speculative.dspark.pp_taps replaces a layer's ``capture_output`` keyword on an
    earlier stage; the model passes its hook by that keyword."""
    whole = _model()
    first = _stage(whole, 0, SPLIT)
    seen = []
    layer = first.layers[1]
    original = layer.forward

    def wrapped(*args, capture_output=None, **kwargs):
        return original(*args, capture_output=seen.append, **kwargs)

    layer.forward = wrapped
    with torch.no_grad():
        first(ids, None, None)
    assert len(seen) == 1
    torch.testing.assert_close(
        seen[0].double(), _layer_outputs(whole, ids)[0], rtol=1e-5, atol=1e-5
    )


# ---------------------------------------------------------------- the sparse path per stage


def _stage_pool(start: int, layers: int) -> _Pool:
    """An MHA pool stand-in of one stage: global layer ids start .. start + layers - 1."""

    def buf() -> torch.Tensor:
        return torch.full((SLOTS, KV_HEADS, HEAD_DIM), float("nan")).to(torch.bfloat16)

    pool = _Pool(
        k_buffer=[buf() for _ in range(layers)],
        v_buffer=[buf() for _ in range(layers)],
        dtype=torch.bfloat16,
        store_dtype=torch.bfloat16,
        page_size=PAGE,
        start_layer=start,
        layer_num=layers,
    )
    pool.get_key_buffer = lambda layer: pool.k_buffer[layer - start]
    return pool


def _sparse_step(start: int, layers: int, reuse: bool = True) -> SparseAttention:
    backend = SimpleNamespace(token_to_kv_pool=_stage_pool(start, layers), device="cpu")
    backend.forward_sparse = None  # what _backend looks for
    step = SparseAttention(backend, _sparse_cfg(reuse), torch.bfloat16)
    backend.sparse = step
    return step


@pytest.mark.parametrize(
    "start, writers",
    [(0, (1,)), (2, (3,))],
    ids=["stage0", "stage1"],
)
def test_stage_index_cache_holds_its_writing_layers_by_global_id(start, writers):
    """Stage 1 holds sparse layers 2 (reuses) and 3 (scores): keys for layer 3 only."""
    cache = IndexCache.for_pool(_stage_pool(start, SPLIT), _sparse_cfg(), torch.bfloat16)
    assert sorted(cache.keys) == list(writers) and cache.writers == writers


@pytest.mark.parametrize("start, writer", [(0, 1), (2, 3)], ids=["stage0", "stage1"])
def test_stage_pool_description_names_only_its_layers(start, writer):
    pool = _stage_pool(start, SPLIT)
    IndexCache.for_pool(pool, _sparse_cfg(), torch.bfloat16)
    export = describe_pool(pool, tp_rank=0, tp_size=1, total_kv_heads=KV_HEADS)
    assert export.stage_layers == (start, start + SPLIT)
    kinds = [(r.kind.value, r.global_layer) for r in export.regions]
    layers = range(start, start + SPLIT)
    expected = [(k, i) for i in layers for k in ("target_k", "target_v")] + [("index_k", writer)]
    assert sorted(kinds) == sorted(expected)


def _selection(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    selected = torch.randint(0, 5, (TOKENS, KV_HEADS, TOPK), generator=gen, dtype=torch.int32)
    return selected, torch.full((TOKENS, KV_HEADS), TOPK, dtype=torch.int32)


def test_selection_crosses_stages_with_the_hidden_states(ids):
    """Layer 2 (stage 1) reuses layer 1's selection (stage 0): stage 0's proxy carries it and
    stage 1 stores it before its first layer."""
    step0, step1 = _sparse_step(0, SPLIT), _sparse_step(SPLIT, SPLIT)
    step0.begin_forward()
    selected, count = _selection()
    step0._keep(0, selected, count)  # what layer 1's scoring stores
    whole = _model()
    whole.sparse = _sparse_cfg()
    first, last = _stage(whole, 0, SPLIT), _stage(whole, SPLIT, LAYERS)
    first.sparse = last.sparse = whole.sparse
    with torch.no_grad():
        proxy = first(ids, None, SimpleNamespace(attn_backend=step0.backend))
        assert torch.equal(proxy[PP_SELECTED], selected) and torch.equal(proxy[PP_COUNT], count)
        step1.begin_forward()
        with pytest.raises(RuntimeError, match="no earlier sparse layer scored"):
            step1.holder.reuse(1, TOKENS)
        last(None, None, SimpleNamespace(attn_backend=step1.backend), pp_proxy_tensors=proxy)
    got, got_count = step1.holder.reuse(1, TOKENS)
    assert torch.equal(got, selected) and torch.equal(got_count, count)
    assert step1.latest[0] == 0  # scored by sparse ordinal 0


def test_no_selection_is_sent_without_index_reuse():
    step = _sparse_step(0, SPLIT, reuse=False)
    step.begin_forward()
    step._keep(0, *_selection())
    assert step.pp_export() == {}
    step.begin_forward()
    assert step.latest is None and _sparse_step(0, SPLIT).pp_export() == {}
