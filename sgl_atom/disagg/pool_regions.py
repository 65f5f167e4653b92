"""Describe a live SGLang KV pool as P/D regions: what each buffer holds and where it is.

Both roles run this on their own pool, so a producer and a consumer compare what they really
hold: the K and V buffer of every layer (SGLang's token-major rows ``[slots, heads, head_dim]``,
one run per token), and, where the atom attention backend keeps fp8 scales beside the pool
(:mod:`sgl_atom.attention.kv_scales`), each layer's K and V scale buffer ``[slots, heads]``.
Layers are numbered globally (``pool.start_layer`` on a pipeline stage), so a stage and a
decode rank holding every layer agree.

A speculative draft's own KV pool (``draft_pool``: per draft layer lists ``k``, ``v`` of rows
``[slots, kv_heads, head_dim]`` indexed by the target's slot ids, plus ``k_scale``/``v_scale``
``[slots, kv_heads]`` when it is fp8) appends its regions after these: per draft layer
``draft_k``, ``draft_v`` and, for an fp8 draft, ``draft_k_scale``, ``draft_v_scale``, numbered
inside the draft and paired from the end of the list by the planner. The draft runs whole on
every TP rank (each rank holds every draft KV head), so its regions are replicated at any TP:
each decode rank receives the whole draft rows from one prefill rank.

A MiniMax-M3-style sparse model adds, per sparse layer that writes index keys, the atom backend's
index cache (:class:`sgl_atom.attention.sparse.IndexCache`, hung off the pool): ``index_k`` rows
``[slots, index_dim]`` (one head, replicated on every TP rank; packed 4-bit keys: ``[slots,
index_dim / 2]`` uint8) and, for fp8 and 4-bit keys, ``index_scale`` ``[slots]`` fp32, after the
layer's K/V and scales. SGLang serves such a model from a ``MiniMaxSparseKVPool``, whose K/V of
every layer live in its ``main_pool``; SGLang hands a transfer backend the sparse layers' K/V as
pages and the dense layers' K/V and its own index pool as per-request state. This description moves
them all as pages of the regions above (the same slot ids), so :attr:`PoolExport.covers` names those
state components.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sgl_atom.disagg.regions import (
    FP8_DTYPES,
    SCALE_DTYPE,
    SCALED_INDEX_DTYPES,
    RegionDesc,
    RegionError,
    RegionKind,
    build_rank_regions,
    canonical_dtype,
)
from sgl_atom.parallel_layout import heads_of_rank
from sgl_atom.pool_state import peek

# SGLang's per-request state components (StateType values) that a MiniMaxSparseKVPool's
# description moves as pages: the dense layers' K/V (main_pool layers) and the index keys
# (the atom backend's own index cache; SGLang's index_k_pool is not written by it).
DENSE_KV_STATE = "minimax_dense_kv"
INDEX_K_STATE = "minimax_index_k"


@dataclass(frozen=True)
class PoolExport:
    """One rank's regions, the tensor behind each (same order) and its PP stage's layers.

    covers: SGLang per-request state components (``StateType`` values) whose bytes these
    regions already move with the request's pages.
    """

    regions: tuple[RegionDesc, ...]
    tensors: tuple[torch.Tensor, ...]
    stage_layers: tuple[int, int]
    covers: frozenset[str] = frozenset()

    def spans(self) -> list[tuple[int, int]]:
        """(base address, bytes) of each region's buffer."""
        return [(t.data_ptr(), t.numel() * t.element_size()) for t in self.tensors]


def pool_dtype(pool: Any) -> str:
    """torch's name of the dtype the pool holds (fp8 stored as uint8 reads as fp8)."""
    return canonical_dtype(str(getattr(pool, "dtype", None) or pool.store_dtype))


def describe_pool(
    pool: Any,
    *,
    tp_rank: int,
    tp_size: int,
    total_kv_heads: int,
    draft_pool: Any | None = None,
) -> PoolExport:
    """The regions of ``pool`` (an MHA token pool, or a MiniMaxSparseKVPool) on TP rank
    ``tp_rank`` of ``tp_size``: per layer K, V, fp8 scales and index keys; then those of
    ``draft_pool`` when given."""
    kv, covers = _kv_pool(pool)
    k_bufs, v_bufs = (
        list(getattr(kv, "k_buffer", None) or []),
        list(getattr(kv, "v_buffer", None) or []),
    )
    if not k_bufs or len(k_bufs) != len(v_bufs):
        raise RegionError(
            f"{type(pool).__name__}: the atom transfer backend moves MHA token pools with one K "
            "and one V buffer per layer (k_buffer/v_buffer); this pool has none"
        )
    start = int(getattr(pool, "start_layer", 0) or 0)
    layers = range(start, start + len(k_bufs))
    _, per = heads_of_rank(total_kv_heads, tp_size, tp_rank)
    _check_buffers(pool, k_bufs, v_bufs, per)
    dtype = pool_dtype(pool)
    state = peek(pool)
    fp8_scales = state.kv_scales is not None and dtype in FP8_DTYPES
    index = describe_index_cache(state.index_cache, layers, len(k_bufs[0]))
    regions = build_rank_regions(
        layers=layers,
        tp_rank=tp_rank,
        tp_size=tp_size,
        kv_heads=total_kv_heads,
        head_dim=int(k_bufs[0].shape[-1]),
        dtype=dtype,
        page_size=int(pool.page_size),
        runs_per_page=None,  # SGLang's rows are token-major: one run per token
        fp8_scales=fp8_scales,
        index_dim=index.dim,
        index_layers=index.layers,
        index_dtype=index.dtype,
    )
    tensors: list[torch.Tensor] = []
    for i, layer in enumerate(layers):
        tensors += [k_bufs[i], v_bufs[i]]
        if fp8_scales:
            tensors += [state.kv_scales.k[i], state.kv_scales.v[i]]
        tensors += index.tensors.get(layer, [])
    if index.layers:
        covers |= {INDEX_K_STATE}
    if draft_pool is not None:
        d_regions, d_tensors = describe_draft_pool(
            draft_pool, page_size=int(pool.page_size), min_slots=len(k_bufs[0])
        )
        regions += d_regions
        tensors += d_tensors
    if len(tensors) != len(regions):
        raise RegionError(f"{len(regions)} regions described for {len(tensors)} buffers")
    return PoolExport(tuple(regions), tuple(tensors), (layers.start, layers.stop), covers)


def _kv_pool(pool: Any) -> tuple[Any, frozenset[str]]:
    """The pool holding every layer's K/V rows, and the SGLang state components that moving
    them covers: a MiniMaxSparseKVPool keeps all of them in its main_pool."""
    main = getattr(pool, "main_pool", None)
    if main is None:
        return pool, frozenset()
    name = type(pool).__name__
    if getattr(pool, "dense_pool", None) is not None:
        raise RegionError(
            f"{name}: its dense layers' K/V live in a pool of their own (hisparse); the atom "
            "transfer backend moves pools whose layers all live in main_pool: serve without "
            "hisparse, or with --disaggregation-transfer-backend mooncake/nixl"
        )
    if getattr(pool, "index_kv_pool", None) is not None:
        raise RegionError(
            f"{name}: sparse layers with an index value (index_kv_pool) are not moved by the "
            "atom transfer backend; it moves index keys only (sparse_disable_index_value)"
        )
    return main, frozenset({DENSE_KV_STATE})


@dataclass(frozen=True)
class IndexExport:
    """The index cache's part of a rank's regions: per writing layer, its buffers."""

    dim: int = 0
    dtype: str | None = None
    layers: tuple[int, ...] = ()
    tensors: dict[int, list[torch.Tensor]] = field(default_factory=dict)


def describe_index_cache(cache: Any | None, layers: range, min_slots: int) -> IndexExport:
    """The index keys (and fp8 scales) of the layers in ``cache.writers``; empty without a
    cache. Each key buffer must be contiguous ``[>= min_slots, index_dim]`` rows of one dtype
    shared by every layer, each fp8 scale buffer contiguous fp32 ``[>= min_slots]``."""
    if cache is None or not cache.writers:
        return IndexExport()
    outside = [lid for lid in cache.writers if lid not in layers]
    if outside:
        raise RegionError(
            f"index cache: layers {outside} write index keys but this pool holds layers "
            f"{layers.start}..{layers.stop - 1}"
        )
    first = cache.keys[cache.writers[0]]
    dtype, dim = canonical_dtype(str(first.dtype)), int(first.shape[-1])
    tensors = {}
    for lid in cache.writers:
        key = cache.keys[lid]
        _check_rows(f"index_k layer {lid}", key, (min_slots, dim), dtype)
        tensors[lid] = [key]
        if dtype in SCALED_INDEX_DTYPES:
            scale = cache.scales.get(lid)
            if scale is None:
                raise RegionError(
                    f"index_scale layer {lid}: {dtype} index keys need a per-token fp32 scale "
                    "buffer; the index cache has none"
                )
            _check_rows(f"index_scale layer {lid}", scale, (min_slots,), SCALE_DTYPE)
            tensors[lid].append(scale)
    return IndexExport(dim, dtype, tuple(cache.writers), tensors)


def _check_rows(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: str) -> None:
    """t is contiguous ``dtype`` rows of ``shape`` (at least shape[0] rows)."""
    ok = (
        t.dim() == len(shape)
        and int(t.shape[0]) >= shape[0]
        and tuple(t.shape[1:]) == shape[1:]
        and t.is_contiguous()
        and canonical_dtype(str(t.dtype)) == dtype
    )
    if not ok:
        want = ", ".join([f">= {shape[0]} slots", *map(str, shape[1:])])
        raise RegionError(
            f"{name}: expected contiguous {dtype} rows [{want}], got {t.dtype} "
            f"{tuple(t.shape)} (contiguous={t.is_contiguous()})"
        )


def describe_draft_pool(
    draft: Any, *, page_size: int, min_slots: int
) -> tuple[list[RegionDesc], list[torch.Tensor]]:
    """The draft pool's regions (appended kinds, draft layers 0..n-1) and their buffers, each
    replicated: the draft runs whole on every TP rank, so every rank holds all its KV heads."""
    name = type(draft).__name__
    ks, vs = list(getattr(draft, "k", None) or []), list(getattr(draft, "v", None) or [])
    k_sc, v_sc = list(getattr(draft, "k_scale", ())), list(getattr(draft, "v_scale", ()))
    if not ks or len(ks) != len(vs):
        raise RegionError(f"draft pool {name}: expected one K and one V buffer per draft layer")
    dtype = canonical_dtype(str(ks[0].dtype))
    fp8 = dtype in FP8_DTYPES
    if fp8 and (len(k_sc) != len(ks) or len(v_sc) != len(ks)):
        raise RegionError(
            f"draft pool {name}: an {dtype} draft needs a K and a V scale buffer per draft layer, "
            f"got {len(k_sc)} and {len(v_sc)} for {len(ks)} layers"
        )
    heads, head_dim = int(ks[0].shape[1]), int(ks[0].shape[-1])
    regions: list[RegionDesc] = []
    tensors: list[torch.Tensor] = []
    for i, (k, v) in enumerate(zip(ks, vs, strict=True)):
        layer = [("draft_k", k, dtype, head_dim), ("draft_v", v, dtype, head_dim)]
        if fp8:
            layer += [
                ("draft_k_scale", k_sc[i], SCALE_DTYPE, 1),
                ("draft_v_scale", v_sc[i], SCALE_DTYPE, 1),
            ]
        for kind, t, dt, unit in layer:
            scale = kind.endswith("_scale")
            rows_ok = t.dim() == (2 if scale else 3)
            if (
                not rows_ok
                or int(t.shape[1]) != heads
                or int(t.shape[0]) < min_slots
                or not t.is_contiguous()
                or canonical_dtype(str(t.dtype)) != dt
            ):
                raise RegionError(
                    f"draft pool {name} {kind} draft layer {i}: expected contiguous {dt} rows "
                    f"[>= {min_slots} slots, {heads} heads{'' if scale else ', head_dim'}], "
                    f"got {t.dtype} {tuple(t.shape)} (contiguous={t.is_contiguous()})"
                )
            regions.append(
                RegionDesc(RegionKind(kind), i, dt, unit, heads, heads, page_size, replicated=True)
            )
            tensors.append(t)
    return regions, tensors


def _check_buffers(pool: Any, k_bufs: list, v_bufs: list, per: int) -> None:
    for i, (k, v) in enumerate(zip(k_bufs, v_bufs, strict=True)):
        for name, t in (("k", k), ("v", v)):
            if t.dim() != 3 or int(t.shape[1]) != per or not t.is_contiguous():
                raise RegionError(
                    f"{type(pool).__name__} layer {i} {name}_buffer: expected contiguous "
                    f"[slots, {per} heads, head_dim] rows, got shape {tuple(t.shape)} "
                    f"(contiguous={t.is_contiguous()})"
                )
        if k.shape != v.shape:
            raise RegionError(
                f"{type(pool).__name__} layer {i}: K {tuple(k.shape)} and V {tuple(v.shape)} "
                "differ; the atom transfer backend moves pools whose K and V rows match"
            )
