"""The atom backend's MiniMax-M3-style sparse path over a real SGLang pool: config refusals,
sparse == dense when top-k covers every block, block skipping against the float64 reference,
and index-selection reuse across layers (``use_index_cache``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_atom.attention.sparse import SparseConfig, SparseConfigError

HEADS, KV_HEADS, DIM, IDX = 4, 2, 128, 64
LAYERS = 2


def _hf(**over):
    sc = dict(
        sparse_attention_freq=[1] * LAYERS,
        sparse_block_size=128,
        sparse_init_block=1,
        sparse_local_block=1,
        sparse_topk_blocks=8,
        sparse_num_index_heads=KV_HEADS,
        sparse_index_dim=IDX,
        sparse_score_type="max",
    )
    top = {k: over.pop(k) for k in ("use_index_cache", "index_topk_freq") if k in over}
    sc.update(over)
    return dict(sparse_attention_config=sc, **top)


@pytest.mark.parametrize(
    "over, head_dim, needle",
    [
        (dict(sparse_block_size=64), DIM, "sparse_block_size=64 is not supported.*128"),
        (dict(sparse_num_index_heads=1), DIM, "sparse_num_index_heads=1 must equal the KV"),
        ({}, 64, r"head_dim=64 is not supported.*\(128,\)"),
        (dict(sparse_score_type="lse"), DIM, r"sparse_score_type='lse' is not supported.*max"),
        (dict(sparse_topk_blocks=1), DIM, "exceed sparse_topk_blocks"),
        (dict(sparse_index_dim=None), DIM, "sparse_index_dim is missing"),
    ],
    ids=["block64", "index_heads", "head_dim64", "lse", "topk_small", "missing"],
)
def test_unservable_sparse_configs_are_named(over, head_dim, needle):
    with pytest.raises(SparseConfigError, match=needle):
        SparseConfig.from_hf(_hf(**over), KV_HEADS, head_dim)


def test_every_unservable_field_is_named_at_once():
    bad = _hf(sparse_block_size=64, sparse_num_index_heads=1, sparse_score_type="lse")
    with pytest.raises(SparseConfigError, match="^4 unsupported fields: ") as err:
        SparseConfig.from_hf(bad, KV_HEADS, 64)
    fields = [p.split("=", 1)[0] for p in str(err.value).split(": ", 1)[1].split(" | ")]
    assert fields == [
        "sparse_attention_config.sparse_block_size",
        "sparse_attention_config.sparse_num_index_heads",
        "head_dim",
        "sparse_attention_config.sparse_score_type",
    ]


def test_token_counts_become_blocks():
    hf = _hf(sparse_init_block=None, sparse_local_block=None)
    hf["sparse_attention_config"].update(sparse_init_tokens=128, sparse_local_tokens=200)
    cfg = SparseConfig.from_hf(hf, KV_HEADS, DIM)
    assert (cfg.init_blocks, cfg.local_blocks) == (1, 3)


@pytest.fixture(autouse=True)
def _parallel():
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_tp_size=1):
        yield


def _backend(hf: dict, kv_dtype=torch.bfloat16, page_size: int = 16, slots: int = 2048):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sgl_atom.attention.backend import AtomAttnBackend

    pool = MHATokenToKVPool(slots, page_size, kv_dtype, KV_HEADS, DIM, LAYERS, "cpu", False)
    cfg = SimpleNamespace(
        get_max_num_attention_heads=lambda: HEADS,
        get_num_kv_heads=lambda tp: KV_HEADS,
        get_total_num_kv_heads=lambda: KV_HEADS,
        head_dim=DIM,
        context_len=4096,
        is_encoder_decoder=False,
        hf_config=hf,
    )
    runner = SimpleNamespace(
        model_config=cfg,
        device="cpu",
        token_to_kv_pool=pool,
        page_size=page_size,
        req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(2, 4096, dtype=torch.int32)),
        dtype=torch.bfloat16,
        kv_cache_dtype=kv_dtype,
    )
    return AtomAttnBackend(runner), runner


def _layer(layer_id: int):
    return SimpleNamespace(
        tp_q_head_num=HEADS,
        tp_k_head_num=KV_HEADS,
        tp_v_head_num=KV_HEADS,
        qk_head_dim=DIM,
        v_head_dim=DIM,
        scaling=DIM**-0.5,
        layer_id=layer_id,
        logit_cap=0,
        sliding_window_size=-1,
        is_cross_attention=False,
    )


def _extend_batch(runner, length: int):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    ps = runner.page_size
    pages = (torch.randperm(runner.token_to_kv_pool.size // ps - 1) + 1)[: -(-length // ps)]
    slots = torch.tensor([int(pages[i // ps]) * ps + i % ps for i in range(length)])
    runner.req_to_token_pool.req_to_token[0, :length] = slots.to(torch.int32)
    seq = torch.tensor([length])
    return SimpleNamespace(
        forward_mode=ForwardMode.EXTEND,
        seq_lens=seq,
        seq_lens_cpu=seq,
        req_pool_indices=torch.tensor([0]),
        extend_seq_lens=seq,
        extend_seq_lens_cpu=[length],
        out_cache_loc=slots.to(torch.int64),
        spec_info=None,
    )


def _inputs(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    return (
        r(n, HEADS * DIM),
        r(n, KV_HEADS, DIM),
        r(n, KV_HEADS, DIM),
        r(n, KV_HEADS, IDX),
        r(n, IDX),
    )


def _rel(a, b):
    assert not torch.isnan(a).any()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_topk_covering_every_block_equals_dense():
    backend, runner = _backend(_hf(sparse_topk_blocks=8))
    fb = _extend_batch(runner, 260)  # 3 blocks
    q, k, v, iq, ik = _inputs(260, 0)
    backend.init_forward_metadata(fb)
    sparse = backend.forward_sparse(q, k, v, iq, ik, _layer(0), fb)
    dense = backend.forward_extend(q, k, v, _layer(0), fb)
    assert _rel(sparse, dense) < 1e-2
    assert backend.sparse.stats.skipped_blocks == 0


def test_blocks_are_skipped_and_match_the_reference():
    from sgl_atom.kernels.sparse_attention import (
        reference_block_scores,
        reference_select_blocks,
        reference_sparse_attention,
    )

    backend, runner = _backend(_hf(sparse_topk_blocks=2))
    fb = _extend_batch(runner, 400)  # 4 blocks; top-2 = the init block + the local block
    q, k, v, iq, ik = _inputs(400, 1)
    backend.init_forward_metadata(fb)
    out = backend.forward_sparse(q, k, v, iq, ik, _layer(0), fb)
    meta = backend.forward_metadata
    kc, vc, _, _ = backend._cache(_layer(0))
    icache = backend.sparse.index.keys[0]
    scores = reference_block_scores(
        iq, icache, meta.page_table, meta.kv_lens, meta.qo_indptr, runner.page_size, IDX**-0.5
    )
    sel, _ = reference_select_blocks(scores, meta.kv_lens, meta.qo_indptr, 2, 1, 1)
    ref = reference_sparse_attention(
        q.view(-1, HEADS, DIM),
        kc,
        vc,
        meta.page_table,
        meta.kv_lens,
        meta.qo_indptr,
        sel,
        runner.page_size,
        DIM**-0.5,
    )
    assert _rel(out.view(-1, HEADS, DIM), ref) < 2e-2
    assert backend.sparse.stats.skipped_blocks > 0


def test_reusing_layers_write_no_index_key_and_share_the_selection():
    backend, runner = _backend(_hf(sparse_topk_blocks=2, use_index_cache=True, index_topk_freq=2))
    fb = _extend_batch(runner, 140)
    q, k, v, iq, ik = _inputs(140, 2)
    backend.init_forward_metadata(fb)
    with pytest.raises(RuntimeError, match="no earlier sparse layer scored"):
        backend.forward_sparse(q, k, v, iq, ik, _layer(1), fb)  # ordinal 1 reuses: nothing yet
    backend.init_forward_metadata(fb)
    backend.forward_sparse(q, k, v, iq, ik, _layer(0), fb)
    backend.forward_sparse(q, k, v, iq, ik, _layer(1), fb)
    assert backend.sparse.index.writers == (0,)
    assert set(backend.sparse.index.keys) == {0}  # a reusing layer holds no index keys
    assert backend.sparse.index.keys[0].abs().sum() > 0


def test_dense_model_has_no_sparse_path():
    from sgl_atom.attention.backend import AtomConfigError

    backend, runner = _backend({})
    assert backend.sparse is None
    fb = _extend_batch(runner, 10)
    backend.init_forward_metadata(fb)
    q, k, v, iq, ik = _inputs(10, 3)
    with pytest.raises(AtomConfigError, match="without sparse_attention_config"):
        backend.forward_sparse(q, k, v, iq, ik, _layer(0), fb)


def test_sparse_model_opts_out_of_prefill_cuda_graphs():
    """Sparse layers call forward_sparse outside RadixAttention's eager section, so a captured
    prefill body must not replay them; a dense model keeps SGLang's prefill graphs."""
    sparse, runner = _backend(_hf())
    assert not sparse.can_run_prefill_cuda_graph(_extend_batch(runner, 10))
    dense, runner = _backend({})
    assert dense.can_run_prefill_cuda_graph(_extend_batch(runner, 10))


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_reference_cpu_kernels_serve_the_sparse_path_like_triton(monkeypatch, kv_dtype):
    """SGL_ATOM_CPU_KERNELS=reference swaps the sparse launchers too: the same index keys
    written (fp8: up to e4m3 rounding), as many blocks attended, the same output as the Triton
    kernels within rounding (bf16; fp8 also carries the key rounding)."""
    out = {}
    for choice in ("triton", "reference"):
        monkeypatch.setenv("SGL_ATOM_CPU_KERNELS", choice)
        torch.manual_seed(5)  # the same pages for both
        backend, runner = _backend(_hf(sparse_topk_blocks=3), kv_dtype)
        assert backend.ops.name == choice
        fb = _extend_batch(runner, 400)  # 4 blocks: 1 chosen by score among blocks 1 and 2
        q, k, v, iq, ik = _inputs(400, 6)
        backend.init_forward_metadata(fb)
        o = backend.forward_sparse(q, k, v, iq, ik, _layer(0), fb)
        keys = backend.sparse.index.keys[0][fb.out_cache_loc].float()
        out[choice] = (o, keys, backend.sparse.stats.attended_blocks)
    (o_t, k_t, n_t), (o_r, k_r, n_r) = out["triton"], out["reference"]
    if kv_dtype == torch.bfloat16:
        assert torch.equal(k_t, k_r)
    else:  # the interpreter's e4m3 rounding differs from torch's (as in the kernel tests)
        assert _rel(k_r, k_t) < 5e-2
    assert n_t == n_r and n_t < 400 * KV_HEADS * 4
    assert _rel(o_r, o_t) < (2e-2 if kv_dtype == torch.bfloat16 else 5e-2)
