"""What one rank exports (or accepts) for P/D transfer: a list of region descriptions.

A region is one buffer whose rows are token slots, `[num_slots, heads, *unit]` (see
`sgl_atom.kernels.kv_transfer.layout`): a layer's K or V, their fp32 scales, the index key, a
draft layer's K or V. :class:`RegionDesc` says what a region holds and how its pages are laid
out; both peers send theirs at handshake and :mod:`sgl_atom.disagg.plan` pairs them.

Numbering: mapped regions are named by (kind, global layer), so a pipeline stage holding layers
[16, 32) and a decode rank holding all layers agree. Draft regions are appended after every
mapped region and paired from the END of each side's list (draft layers are numbered inside the
draft, and the index of the first draft region differs per stage).

Sharded or whole: a region's heads are either cut over the TP ranks as SGLang cuts KV heads
(:func:`sgl_atom.parallel_layout.heads_of_rank`), or held whole on every rank (``replicated``:
heads_per_rank == total_heads). The sparse index key and its scale are always whole (1 head of 1); a
draft region may be either: the ATOM_DSPARK draft runs whole on every TP rank, so its pool holds
every draft KV head on every rank. Target K/V and their scales are always sharded.

Nothing here imports torch or SGLang.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..dtypes import ELEMENT_BYTES, FP8_TORCH_NAMES, torch_name
from ..parallel_layout import LayoutError, heads_of_rank


class RegionError(LayoutError):
    """A region description (or a rank's inputs to build one) is inconsistent."""


def _heads(total: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """:func:`heads_of_rank`, refusing as a region error."""
    try:
        return heads_of_rank(total, tp_size, tp_rank)
    except LayoutError as e:
        raise RegionError(str(e)) from None


class RegionKind(enum.StrEnum):
    TARGET_K = "target_k"
    TARGET_V = "target_v"
    K_SCALE = "k_scale"
    V_SCALE = "v_scale"
    INDEX_K = "index_k"
    INDEX_SCALE = "index_scale"
    DRAFT_K = "draft_k"
    DRAFT_V = "draft_v"
    DRAFT_K_SCALE = "draft_k_scale"
    DRAFT_V_SCALE = "draft_v_scale"

    @property
    def appended(self) -> bool:
        """Draft regions follow the mapped ones and are paired from the end of the list."""
        return self.value.startswith("draft_")

    @property
    def replicated(self) -> bool:
        """Always one head whole on every TP rank (the sparse index key and its scale)."""
        return self in (RegionKind.INDEX_K, RegionKind.INDEX_SCALE)

    @property
    def may_replicate(self) -> bool:
        """Whole on every rank is allowed: always for the index key, by choice for a draft."""
        return self.replicated or self.appended

    @property
    def is_scale(self) -> bool:
        return self.value.endswith("_scale")


# Bytes per element, by the dtype names both peers write (torch's names, without "torch.").
DTYPE_BYTES = ELEMENT_BYTES
FP8_DTYPES = FP8_TORCH_NAMES
# index keys stored with a per-token fp32 scale: fp8, and packed 4-bit ones (two dims per uint8)
SCALED_INDEX_DTYPES = FP8_TORCH_NAMES | {"uint8"}
SCALE_DTYPE = "float32"


def canonical_dtype(name: str) -> str:
    """torch's name for a dtype spelled as SGLang's CLI does ("bf16", "fp8_e4m3") or as torch."""
    canon = torch_name(name)
    if canon is None:
        name = name.removeprefix("torch.")
        raise RegionError(f"unknown dtype {name!r}; known: {', '.join(sorted(DTYPE_BYTES))}")
    return canon


@dataclass(frozen=True)
class RegionDesc:
    """One transferred region of one rank.

    kind: what it holds. global_layer: the model's layer id (a draft's own layer id for draft
    kinds). dtype: torch's dtype name. head_dim: elements per (slot, head) entry: the head dim for
    K/V, the index dim for the index key, 1 for a per-(token, head) scale. heads_per_rank /
    total_heads: heads this rank holds / the model holds. replicated: every TP rank holds all
    total_heads (heads_per_rank == total_heads; 1 / 1 for the index key, which always is; a
    draft region may be, a target region never is).
    tokens_per_page: slots per page. runs_per_page: head-major runs per page (1: a head-major
    page; 8: page-16 sub-pages of a 128-token page); None: SGLang's token-major layout, i.e.
    one run per token. unit_bytes: bytes per (slot, head); defaults to head_dim * itemsize and
    may be larger for a padded row (an inline scale), never smaller.
    """

    kind: RegionKind
    global_layer: int
    dtype: str
    head_dim: int
    heads_per_rank: int
    total_heads: int
    tokens_per_page: int
    runs_per_page: int | None = None
    replicated: bool = False
    unit_bytes: int = field(default=0)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", RegionKind(self.kind))
        except ValueError:
            kinds = ", ".join(k.value for k in RegionKind)
            raise RegionError(f"unknown region kind {self.kind!r}; known: {kinds}") from None
        problems = self._problems()
        if problems:
            raise RegionError(f"{self.name}: " + "; ".join(problems))
        if self.unit_bytes == 0:
            object.__setattr__(self, "unit_bytes", self.head_dim * DTYPE_BYTES[self.dtype])

    def _problems(self) -> list[str]:
        p = []
        ints = ("global_layer", "head_dim", "heads_per_rank", "total_heads", "tokens_per_page")
        for name in (*ints, "unit_bytes"):
            v, lo = getattr(self, name), 0 if name in ("global_layer", "unit_bytes") else 1
            if type(v) is not int or v < lo:
                p.append(f"{name} must be an int >= {lo}, got {v!r}")
        if type(self.replicated) is not bool:
            p.append(f"replicated must be a bool, got {self.replicated!r}")
        if self.dtype not in DTYPE_BYTES:
            p.append(f"dtype {self.dtype!r} is not one of {', '.join(sorted(DTYPE_BYTES))}")
        if p:
            return p
        p += self._replication_problems()
        if self.heads_per_rank > self.total_heads:
            p.append(f"heads_per_rank {self.heads_per_rank} exceeds total_heads {self.total_heads}")
        runs = self.runs_per_page
        if runs is not None and (type(runs) is not int or runs < 1 or self.tokens_per_page % runs):
            p.append(f"runs_per_page {runs!r} must divide tokens_per_page {self.tokens_per_page}")
        if self.kind.is_scale and self.dtype != SCALE_DTYPE:
            p.append(f"scale regions are {SCALE_DTYPE}, got {self.dtype}")
        if 0 < self.unit_bytes < self.head_dim * DTYPE_BYTES[self.dtype]:
            p.append(
                f"unit_bytes {self.unit_bytes} < head_dim {self.head_dim} x "
                f"{DTYPE_BYTES[self.dtype]} bytes of {self.dtype}"
            )
        return p

    def _replication_problems(self) -> list[str]:
        kind, got = self.kind.value, f"{self.heads_per_rank} of {self.total_heads}"
        if self.replicated and not self.kind.may_replicate:
            return [f"replicated=True, but {kind} regions are never replicated"]
        if self.kind.replicated and not self.replicated:
            return [f"replicated=False, but {kind} regions are always replicated"]
        if self.kind.replicated and (self.heads_per_rank, self.total_heads) != (1, 1):
            return [f"a replicated {kind} unit has 1 head of 1, got {got}"]
        if self.replicated and self.heads_per_rank != self.total_heads:
            return [f"a replicated region holds all its heads on every rank, got {got}"]
        return []

    @property
    def name(self) -> str:
        """How errors name the region: `target_k layer 12`, `draft_v draft layer 3`."""
        kind = self.kind.value if isinstance(self.kind, RegionKind) else str(self.kind)
        return (
            f"{kind} {'draft layer' if kind.startswith('draft_') else 'layer'} {self.global_layer}"
        )

    @property
    def key(self) -> tuple[RegionKind, int]:
        return (self.kind, self.global_layer)

    @property
    def runs(self) -> int:
        """Runs per page with token-major (None) spelled out: one run per token."""
        return self.tokens_per_page if self.runs_per_page is None else self.runs_per_page

    @property
    def run_tokens(self) -> int:
        return self.tokens_per_page // self.runs

    @property
    def chunk_bytes(self) -> int:
        """One head's bytes in one run."""
        return self.run_tokens * self.unit_bytes

    @property
    def page_bytes(self) -> int:
        return self.tokens_per_page * self.heads_per_rank * self.unit_bytes


def build_rank_regions(
    *,
    layers: Iterable[int],
    tp_rank: int,
    tp_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: str,
    page_size: int,
    runs_per_page: int | None = None,
    fp8_scales: bool = False,
    index_dim: int = 0,
    index_layers: Iterable[int] | None = None,
    index_dtype: str | None = None,
    draft_layers: int = 0,
    draft_dtype: str | None = None,
    draft_kv_heads: int | None = None,
    draft_head_dim: int | None = None,
    draft_runs_per_page: int | None = None,
    draft_whole: bool = False,
) -> list[RegionDesc]:
    """The regions of one rank, in the order it exports them.

    layers: the global layers this rank's PP stage holds. Per layer: target_k, target_v, then
    k_scale/v_scale (fp8_scales: one fp32 scale per (token, KV head); needs an fp8 dtype), then
    index_k (index_dim > 0, on index_layers, default every layer; index_dtype defaults to dtype) and
    index_scale when the index key is fp8 or packed 4-bit (uint8). Then the draft pool (draft_layers
    > 0, normally on the last stage only): draft_k, draft_v and, when fp8_scales and the draft is
    fp8, their scales, at draft_dtype (default dtype) with draft_kv_heads/draft_head_dim defaulting
    to the target's. draft_whole: every rank holds all draft heads (replicated, as the ATOM_DSPARK
    draft runs); otherwise the draft's heads are sharded like the target's.
    """
    dtype = canonical_dtype(dtype)
    if fp8_scales and dtype not in FP8_DTYPES:
        raise RegionError(f"fp8_scales needs an fp8 KV dtype, got {dtype}")
    layers = list(layers)
    if len(set(layers)) != len(layers):
        raise RegionError(f"layers {layers} repeat a layer")
    idx_layers = set(layers if index_layers is None else index_layers)
    if not idx_layers <= set(layers):
        raise RegionError(f"index_layers {sorted(idx_layers)} are not all in layers {layers}")
    _, per = _heads(kv_heads, tp_size, tp_rank)
    page = dict(tokens_per_page=page_size)
    out: list[RegionDesc] = []
    for layer in layers:
        out += _kv_regions(
            "target", layer, dtype, head_dim, per, kv_heads, runs_per_page, fp8_scales, page
        )
        if index_dim and layer in idx_layers:
            out += _index_regions(layer, canonical_dtype(index_dtype or dtype), index_dim, page)
    if draft_layers:
        d_dtype = canonical_dtype(draft_dtype or dtype)
        d_heads = draft_kv_heads or kv_heads
        d_per = d_heads if draft_whole else _heads(d_heads, tp_size, tp_rank)[1]
        d_scales = fp8_scales and d_dtype in FP8_DTYPES
        for layer in range(draft_layers):
            out += _kv_regions(
                "draft",
                layer,
                d_dtype,
                draft_head_dim or head_dim,
                d_per,
                d_heads,
                draft_runs_per_page,
                d_scales,
                page,
                replicated=draft_whole,
            )
    return out


def _kv_regions(which, layer, dtype, head_dim, per, total, runs, scales, page, replicated=False):
    k, v = ("target_k", "target_v") if which == "target" else ("draft_k", "draft_v")
    ks, vs = ("k_scale", "v_scale") if which == "target" else ("draft_k_scale", "draft_v_scale")
    kinds = [(k, dtype, head_dim), (v, dtype, head_dim)]
    layout = dict(runs_per_page=runs, replicated=replicated, **page)
    if scales:
        kinds += [(ks, SCALE_DTYPE, 1), (vs, SCALE_DTYPE, 1)]
    return [
        RegionDesc(RegionKind(kind), layer, dt, hd, per, total, **layout) for kind, dt, hd in kinds
    ]


def _index_regions(layer, dtype, index_dim, page):
    out = [RegionDesc(RegionKind.INDEX_K, layer, dtype, index_dim, 1, 1, replicated=True, **page)]
    if dtype in SCALED_INDEX_DTYPES:
        out.append(
            RegionDesc(RegionKind.INDEX_SCALE, layer, SCALE_DTYPE, 1, 1, 1, replicated=True, **page)
        )
    return out
