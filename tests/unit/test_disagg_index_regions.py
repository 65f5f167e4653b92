"""The M3 sparse index cache through the atom transfer backend: described from the live pool,
paired by the planner, moved with the request's pages, refused by name when a peer lacks it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_disagg_backend import _consumer, _Pool

from sgl_atom import pool_state
from sgl_atom.attention.sparse import IndexCache, SparseConfig
from sgl_atom.disagg.conn import check_state_types, plan_for_peer, region_counts
from sgl_atom.disagg.plan import HandshakeError
from sgl_atom.disagg.pool_regions import describe_index_cache, describe_pool
from sgl_atom.disagg.regions import RegionError, RegionKind

LAYERS, SLOTS, HEADS, HEAD_DIM, INDEX_DIM, PAGE = 4, 36, 2, 64, 128, 4
SPARSE, WRITERS = (1, 2, 3), (1, 3)  # the tiny m3 kind: ordinal 1 (layer 2) reuses
AUX = [(0, 64, 8)]
FP8 = torch.float8_e4m3fn


def _nan(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan")).to(dtype)


def _sparse_cfg() -> SparseConfig:
    return SparseConfig(
        sparse_layer_ids=SPARSE,
        topk_blocks=2,
        init_blocks=1,
        local_blocks=1,
        index_dim=INDEX_DIM,
        num_index_heads=HEADS,
        use_index_cache=True,
        index_topk_freq=2,
        ordinal_of={lid: o for o, lid in enumerate(SPARSE)},
    )


def _pool(fp8: bool, index: bool = True, index_fp8: bool | str | None = None) -> _Pool:
    """An MHA pool stand-in with what the atom backend hangs off it: fp8 KV scales, and the
    index cache built by the backend's own IndexCache.for_pool (NaN-poisoned; index_fp8 "int4":
    packed 4-bit keys)."""
    dtype = FP8 if fp8 else torch.bfloat16
    pool = _Pool(
        k_buffer=[_nan((SLOTS, HEADS, HEAD_DIM), dtype) for _ in range(LAYERS)],
        v_buffer=[_nan((SLOTS, HEADS, HEAD_DIM), dtype) for _ in range(LAYERS)],
        dtype=dtype,
        store_dtype=dtype,
        page_size=PAGE,
        start_layer=0,
        layer_num=LAYERS,
    )
    pool.get_key_buffer = lambda layer: pool.k_buffer[layer]
    if fp8:
        pool_state.state_of(pool).kv_scales = SimpleNamespace(
            k=[torch.ones(SLOTS, HEADS) for _ in range(LAYERS)],
            v=[torch.ones(SLOTS, HEADS) for _ in range(LAYERS)],
        )
    if index:
        idx_fp8 = fp8 if index_fp8 is None else index_fp8
        idx_dtype = torch.uint8 if idx_fp8 == "int4" else FP8 if idx_fp8 else torch.bfloat16
        cache = IndexCache.for_pool(pool, _sparse_cfg(), idx_dtype)
        for lid in cache.keys:
            cache.keys[lid].copy_(_nan(tuple(cache.keys[lid].shape), cache.keys[lid].dtype))
    return pool


def _export(pool, tp_rank=0, tp_size=1):
    return describe_pool(pool, tp_rank=tp_rank, tp_size=tp_size, total_kv_heads=HEADS)


def _kinds(export) -> list[tuple[str, int]]:
    return [(r.kind.value, r.global_layer) for r in export.regions]


# ---------------------------------------------------------------- the description


def test_index_cache_records_the_layers_that_write_index_keys():
    cache = pool_state.peek(_pool(fp8=False)).index_cache
    assert cache.writers == WRITERS  # only the scoring sparse layers write index keys ...
    assert sorted(cache.keys) == list(WRITERS) != list(SPARSE)  # ... and only they hold them


def test_bf16_index_keys_follow_their_layer():
    pool = _pool(fp8=False)
    export = _export(pool)
    assert _kinds(export) == [
        ("target_k", 0), ("target_v", 0),
        ("target_k", 1), ("target_v", 1), ("index_k", 1),
        ("target_k", 2), ("target_v", 2),
        ("target_k", 3), ("target_v", 3), ("index_k", 3),
    ]  # fmt: skip
    cache = pool_state.peek(pool).index_cache
    idx = [i for i, r in enumerate(export.regions) if r.kind is RegionKind.INDEX_K]
    assert [export.tensors[i] for i in idx] == [cache.keys[1], cache.keys[3]]
    r = export.regions[idx[0]]
    assert (r.dtype, r.head_dim, r.heads_per_rank, r.total_heads) == ("bfloat16", 128, 1, 1)
    assert r.replicated and r.tokens_per_page == PAGE and r.runs_per_page is None
    assert r.unit_bytes == INDEX_DIM * 2 and r.page_bytes == PAGE * INDEX_DIM * 2
    assert export.spans()[idx[0]] == (cache.keys[1].data_ptr(), SLOTS * INDEX_DIM * 2)
    assert export.covers == {"minimax_index_k"}
    assert region_counts(export) == "target_k 4, target_v 4, index_k 2"


def test_fp8_index_keys_carry_their_scales():
    pool = _pool(fp8=True)
    export = _export(pool)
    assert _kinds(export) == [
        ("target_k", 0), ("target_v", 0), ("k_scale", 0), ("v_scale", 0),
        ("target_k", 1), ("target_v", 1), ("k_scale", 1), ("v_scale", 1),
        ("index_k", 1), ("index_scale", 1),
        ("target_k", 2), ("target_v", 2), ("k_scale", 2), ("v_scale", 2),
        ("target_k", 3), ("target_v", 3), ("k_scale", 3), ("v_scale", 3),
        ("index_k", 3), ("index_scale", 3),
    ]  # fmt: skip
    pairs = zip(export.regions, export.tensors, strict=True)
    by_kind = {(r.kind, r.global_layer): (r, t) for r, t in pairs}
    key, key_t = by_kind[(RegionKind.INDEX_K, 1)]
    scale, scale_t = by_kind[(RegionKind.INDEX_SCALE, 1)]
    cache = pool_state.peek(pool).index_cache
    assert key_t is cache.keys[1] and scale_t is cache.scales[1]
    assert (key.dtype, key.unit_bytes) == ("float8_e4m3fn", INDEX_DIM)
    assert (scale.dtype, scale.head_dim, scale.unit_bytes) == ("float32", 1, 4)
    assert scale.replicated
    assert (RegionKind.INDEX_K, 2) not in by_kind  # layer 2 reuses: nothing to move
    assert region_counts(export) == (
        "target_k 4, target_v 4, k_scale 4, v_scale 4, index_k 2, index_scale 2"
    )


def test_int4_index_keys_move_as_packed_bytes_with_their_scales():
    """Packed 4-bit index keys: half a byte per dim, then their per-token scale, as fp8's."""
    pool = _pool(fp8=False, index_fp8="int4")
    export = _export(pool)
    pairs = zip(export.regions, export.tensors, strict=True)
    by_kind = {(r.kind, r.global_layer): (r, t) for r, t in pairs}
    cache = pool_state.peek(pool).index_cache
    key, key_t = by_kind[(RegionKind.INDEX_K, 3)]
    scale, scale_t = by_kind[(RegionKind.INDEX_SCALE, 3)]
    assert key_t is cache.keys[3] and scale_t is cache.scales[3]
    assert tuple(key_t.shape) == (SLOTS, INDEX_DIM // 2)
    assert (key.dtype, key.head_dim, key.unit_bytes) == ("uint8", INDEX_DIM // 2, INDEX_DIM // 2)
    assert (scale.dtype, scale.unit_bytes) == ("float32", 4)
    assert region_counts(export) == "target_k 4, target_v 4, index_k 2, index_scale 2"


def test_minimax_sparse_pool_is_described_through_its_main_pool():
    main = _pool(fp8=False, index=False)
    wrapper = _Pool(
        main_pool=main,
        dense_pool=None,
        index_kv_pool=None,
        dtype=main.dtype,
        store_dtype=main.dtype,
        page_size=PAGE,
        start_layer=0,
        layer_num=LAYERS,
        get_key_buffer=main.get_key_buffer,
    )
    IndexCache.for_pool(wrapper, _sparse_cfg(), torch.bfloat16)
    export = _export(wrapper)
    assert export.tensors[0] is main.k_buffer[0] and export.tensors[-1] is not None
    assert [r.global_layer for r in export.regions if r.kind is RegionKind.INDEX_K] == [1, 3]
    assert export.covers == {"minimax_dense_kv", "minimax_index_k"}
    check_state_types(["minimax_index_k", "minimax_dense_kv"], export, "MiniMaxSparseKVPool")
    with pytest.raises(RuntimeError, match=r"per-request state \['mamba'\].*mooncake or nixl"):
        check_state_types(["minimax_index_k", "mamba"], export, "MiniMaxSparseKVPool")
    for field, match in (("dense_pool", "hisparse"), ("index_kv_pool", "index value")):
        with pytest.raises(RegionError, match=match):
            _export(_Pool(**{**wrapper.__dict__, field: object()}))


def test_a_pool_without_index_cache_does_not_cover_sglang_index_state():
    export = _export(_pool(fp8=False, index=False))
    assert RegionKind.INDEX_K not in {r.kind for r in export.regions}
    with pytest.raises(RuntimeError, match=r"\['minimax_index_k'\]"):
        check_state_types(["minimax_index_k"], export, "MiniMaxSparseKVPool")


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda c: c.keys.__setitem__(1, torch.zeros(SLOTS - 1, INDEX_DIM)), "index_k layer 1"),
        (lambda c: c.keys.__setitem__(3, torch.zeros(INDEX_DIM, SLOTS).t()), "contiguous"),
        (lambda c: c.scales.__setitem__(3, None), "index_scale layer 3: float8_e4m3fn"),
        (lambda c: setattr(c, "writers", (1, 7)), r"layers \[7\] write index keys"),
    ],
    ids=["too-few-slots", "not-contiguous", "fp8-without-scales", "layer-outside-pool"],
)
def test_index_cache_problems_are_named(mutate, match):
    pool = _pool(fp8=True)
    mutate(pool_state.peek(pool).index_cache)
    with pytest.raises(RegionError, match=match):
        describe_index_cache(pool_state.peek(pool).index_cache, range(LAYERS), SLOTS)


# ---------------------------------------------------------------- pairing and moving


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).reshape(-1)


def _move(plan, producer, consumer, src_pages, dst_pages) -> None:
    """What the NIXL writes do, span by span, on CPU tensors."""
    for pair in plan.pairs:
        src = _as_bytes(producer.tensors[pair.producer_index])
        dst = _as_bytes(consumer.tensors[pair.consumer_index])
        for s, d, n in pair.spans(src_pages, dst_pages):
            dst[d : d + n] = src[s : s + n]


def _slots(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)])


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_matching_index_regions_are_paired_and_moved_with_the_pages(fp8):
    prod_pool, cons_pool = _pool(fp8), _pool(fp8)
    producer = _export(prod_pool)
    plan = plan_for_peer(producer, 0, 1, True, AUX, _consumer(cons_pool, aux=tuple(AUX)))
    index_pairs = [p for p in plan.pairs if p.name.startswith("index_")]
    want = ["index_k layer 1", "index_k layer 3"]
    if fp8:
        want = ["index_k layer 1", "index_scale layer 1", "index_k layer 3", "index_scale layer 3"]
    assert [p.name for p in index_pairs] == want
    assert {p.mode for p in index_pairs} == {"replicated"}
    src_cache = pool_state.peek(prod_pool).index_cache
    dst_cache = pool_state.peek(cons_pool).index_cache
    g = torch.Generator().manual_seed(0)
    for lid in WRITERS:
        rows = torch.randn(SLOTS, INDEX_DIM, generator=g)
        src_cache.keys[lid].copy_(rows.to(src_cache.keys[lid].dtype))
        if fp8:
            src_cache.scales[lid].copy_(torch.rand(SLOTS, generator=g) + 0.5)
            dst_cache.scales[lid].fill_(float("nan"))
    src_pages, dst_pages = [5, 2, 7], [1, 8, 3]
    _move(plan, producer, _export(cons_pool), src_pages, dst_pages)
    src_slots, dst_slots = _slots(src_pages), _slots(dst_pages)
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[dst_slots] = False
    for lid in WRITERS:
        got, sent = dst_cache.keys[lid].float(), src_cache.keys[lid].float()
        assert torch.equal(got[dst_slots], sent[src_slots])
        assert got[untouched].isnan().all()  # nothing outside the request's pages
        if fp8:
            assert torch.equal(dst_cache.scales[lid][dst_slots], src_cache.scales[lid][src_slots])
            assert dst_cache.scales[lid][untouched].isnan().all()
    assert 2 not in dst_cache.keys  # the reusing layer holds no index keys to move


def test_index_keys_go_whole_to_each_tp2_consumer_rank():
    producer = _export(_pool(fp8=False))
    for rank in (0, 1):
        cons = _pool(fp8=False)
        cons.k_buffer = [b[:, :1].contiguous() for b in cons.k_buffer]
        cons.v_buffer = [b[:, :1].contiguous() for b in cons.v_buffer]
        hs = _consumer(cons, tp_rank=rank, tp_size=2, total=HEADS, aux=tuple(AUX))
        plan = plan_for_peer(producer, 0, 1, True, AUX, hs)
        index = [(p.name, p.mode, p.num_heads) for p in plan.pairs if p.name.startswith("index")]
        assert index == [("index_k layer 1", "replicated", 1), ("index_k layer 3", "replicated", 1)]
        assert {p.mode for p in plan.pairs if p.name.startswith("target")} == {"split"}


def test_a_consumer_without_the_index_regions_is_refused_naming_them():
    producer = _export(_pool(fp8=True))
    hs = _consumer(_pool(fp8=True, index=False), aux=tuple(AUX))
    with pytest.raises(HandshakeError) as e:
        plan_for_peer(producer, 0, 1, True, AUX, hs)
    text = str(e.value)
    assert "nothing was written" in text
    for name in ("index_k layer 1", "index_scale layer 1", "index_k layer 3"):
        assert f"{name}: producer exports it, consumer has no such region" in text, text


def test_a_producer_without_the_index_regions_is_refused_naming_them():
    producer = _export(_pool(fp8=False, index=False))
    with pytest.raises(HandshakeError) as e:
        plan_for_peer(producer, 0, 1, True, AUX, _consumer(_pool(fp8=False), aux=tuple(AUX)))
    assert "index_k layer 3: consumer expects it, producer (layers 0..3) does not export it" in (
        str(e.value)
    )


def test_an_index_dtype_mismatch_is_refused_naming_region_and_values():
    producer = _export(_pool(fp8=True))
    hs = _consumer(_pool(fp8=True, index_fp8=False), aux=tuple(AUX))
    with pytest.raises(HandshakeError) as e:
        plan_for_peer(producer, 0, 1, True, AUX, hs)
    text = str(e.value)
    assert "index_k layer 1: dtype producer float8_e4m3fn, consumer bfloat16" in text, text
    assert "index_scale layer 1: producer exports it, consumer has no such region" in text


def test_an_int4_index_against_fp8_is_refused():
    producer = _export(_pool(fp8=True, index_fp8="int4"))
    hs = _consumer(_pool(fp8=True), aux=tuple(AUX))
    with pytest.raises(HandshakeError) as e:
        plan_for_peer(producer, 0, 1, True, AUX, hs)
    assert "index_k layer 1: dtype producer uint8, consumer float8_e4m3fn" in str(e.value)
