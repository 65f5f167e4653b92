"""Pair a producer rank's regions with a consumer rank's and say which bytes go where.

`plan_transfer` is run once per (producer rank, consumer rank) at handshake. It checks every
pairing first and raises :class:`HandshakeError` listing every problem, so a bad layout is
refused before a byte is written; otherwise it returns a :class:`TransferPlan` whose
:meth:`PairPlan.spans` turn page ids into (source offset, destination offset, length) copies.

Pairing: mapped regions by (kind, global layer); appended (draft) regions from the end of both
lists, the producer's k-th of n appended regions going to consumer index `-(n - k)`.

Head cuts: each side holds the global heads `heads_of_rank(total, tp, rank)`. A pair moves the
heads both hold, in every run of every page: a producer holding more heads than the consumer rank
sends the consumer's subset (split), one holding fewer writes at the consumer's head offset
(merge); both at once happen when neither TP divides the other (6 heads, TP2 -> TP3). Where
several producer ranks hold a head (heads < TP), one of them sends it. Replicated regions (held
whole on every rank: the index key's one head, a draft that runs whole on every rank with all its
heads) go whole, every head, from exactly one producer rank, `consumer_rank * producer_tp //
consumer_tp`, as whole pages where both sides' pages are laid out alike.

Refused, each naming the region and both values: a region one side lacks; two producer regions
on one consumer region; dtype, head_dim, unit bytes, total heads or replicated flag (one side
sharded, the other whole on every rank) that differ; heads that do not divide over a TP size (3
heads over TP2) or a heads-per-rank that contradicts it; runs_per_page that differ at equal page
sizes (page-16 declared as one run); page sizes that differ unless both sides' runs hold the
same number of tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from sgl_atom.disagg.regions import RegionDesc
from sgl_atom.parallel_layout import LayoutError, heads_of_rank


class HandshakeError(ValueError):
    """The peers' regions cannot be paired; `problems` lists every reason, one per line."""

    SHOWN = 16  # problems spelled out; the rest are counted (a handshake holds up to 8192)

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems[: self.SHOWN])
        more = len(self.problems) - self.SHOWN
        if more > 0:
            lines += f"\n  - ... and {more} more of the same kinds"
        super().__init__(f"P/D handshake refused, nothing was written ({len(problems)}):\n{lines}")


@dataclass(frozen=True)
class PairPlan:
    """What one producer region writes into one consumer region of one consumer rank.

    Heads are rank-local: the producer reads heads [src_head_start, +num_heads) of its
    src_heads, the consumer receives them at [dst_head_start, +num_heads) of its dst_heads.
    consumer_ref is the index as it travels: >= 0 for mapped regions, from the end (< 0) for
    appended ones; consumer_index is it resolved against the consumer's list.
    """

    producer_index: int
    consumer_index: int
    consumer_ref: int
    name: str
    mode: str  # "whole", "split", "merge", "regroup" or "replicated"
    src_head_start: int
    dst_head_start: int
    num_heads: int
    src_heads: int
    dst_heads: int
    unit_bytes: int
    run_tokens: int
    src_runs: int
    dst_runs: int

    @property
    def chunk_bytes(self) -> int:
        return self.run_tokens * self.unit_bytes

    @property
    def span_bytes(self) -> int:
        """Bytes copied per run: the moved heads of one run are contiguous on both sides."""
        return self.num_heads * self.chunk_bytes

    @property
    def src_page_bytes(self) -> int:
        return self.src_runs * self.src_heads * self.chunk_bytes

    @property
    def dst_page_bytes(self) -> int:
        return self.dst_runs * self.dst_heads * self.chunk_bytes

    @property
    def whole_pages(self) -> bool:
        """Pages are byte-identical on both sides, so a page is one copy."""
        same = self.src_runs == self.dst_runs and self.src_heads == self.dst_heads
        return same and self.num_heads == self.src_heads

    def spans(self, src_pages: Sequence[int], dst_pages: Sequence[int]) -> np.ndarray:
        """[N, 3] int64 rows (src byte offset, dst byte offset, length) into each side's region
        buffer, in token order; built with array operations (a 16K-token chunk of a 64-region
        pool is 64K rows at page 16, which a Python loop took tens of ms to build per request).

        src_pages/dst_pages hold the same tokens in order; with different page sizes they differ
        in length and the shorter one (in runs) bounds the copy.
        """
        src = np.asarray(src_pages, dtype=np.int64)
        dst = np.asarray(dst_pages, dtype=np.int64)
        if self.whole_pages:
            n, pb = min(len(src), len(dst)), self.src_page_bytes
            return np.stack([src[:n] * pb, dst[:n] * pb, np.full(n, pb, dtype=np.int64)], axis=1)
        n_runs = min(len(src) * self.src_runs, len(dst) * self.dst_runs)
        run = np.arange(n_runs, dtype=np.int64)
        sp, sj = np.divmod(run, self.src_runs)
        dp, dj = np.divmod(run, self.dst_runs)
        chunk = self.chunk_bytes
        src_head = (sj * self.src_heads + self.src_head_start) * chunk
        dst_head = (dj * self.dst_heads + self.dst_head_start) * chunk
        src_off = src[sp] * self.src_page_bytes + src_head
        dst_off = dst[dp] * self.dst_page_bytes + dst_head
        length = np.full(n_runs, self.span_bytes, dtype=np.int64)
        return np.stack([src_off, dst_off, length], axis=1)


@dataclass(frozen=True)
class TransferPlan:
    producer_rank: int
    producer_tp: int
    consumer_rank: int
    consumer_tp: int
    pairs: tuple[PairPlan, ...]

    @property
    def empty(self) -> bool:
        """This producer rank sends nothing to this consumer rank."""
        return not self.pairs


def plan_transfer(
    producer_regions: Sequence[RegionDesc],
    producer_rank: int,
    producer_tp: int,
    consumer_regions: Sequence[RegionDesc],
    consumer_rank: int,
    consumer_tp: int,
    *,
    stage_layers: Iterable[int] | None = None,
    holds_draft: bool = True,
) -> TransferPlan:
    """Check every pairing of one producer rank with one consumer rank, then plan it.

    stage_layers: the global layers the producer's PP stage owns; every consumer region on those
    layers must come from it. None: every layer the consumer maps (a producer without PP).
    holds_draft: this producer is the stage the consumer's appended (draft) regions come from
    (the last PP stage); other stages must export none and are not asked for any.
    """
    problems = _rank_problems(producer_rank, producer_tp, consumer_rank, consumer_tp)
    problems += _list_problems(producer_regions, "producer") + _list_problems(
        consumer_regions, "consumer"
    )
    if problems:
        raise HandshakeError(problems)
    pairs, pair_problems = _pair_regions(
        producer_regions, consumer_regions, stage_layers, holds_draft
    )
    problems += pair_problems
    for pi, ci, _ in pairs:
        problems += _compat_problems(
            producer_regions[pi], producer_tp, consumer_regions[ci], consumer_tp
        )
    if problems:
        raise HandshakeError(problems)
    ranks = (producer_rank, producer_tp, consumer_rank, consumer_tp)
    plans = (
        _plan_pair(producer_regions[pi], consumer_regions[ci], ranks, (pi, ci, ref))
        for pi, ci, ref in pairs
    )
    return TransferPlan(*ranks, tuple(p for p in plans if p is not None))


def check_stage_coverage(
    stage_layers: Sequence[Iterable[int]], consumer_regions: Sequence[RegionDesc]
) -> None:
    """Across all PP stages of a producer: each consumer layer comes from exactly one stage."""
    owner: dict[int, int] = {}
    problems = []
    for stage, layers in enumerate(stage_layers):
        for layer in layers:
            if layer in owner:
                problems.append(f"layer {layer}: stages {owner[layer]} and {stage} both export it")
            owner.setdefault(layer, stage)
    wanted = sorted({r.global_layer for r in consumer_regions if not r.kind.appended})
    problems += [
        f"layer {layer}: no producer stage exports it (consumer maps it)"
        for layer in wanted
        if layer not in owner
    ]
    problems += [
        f"layer {layer}: stage {owner[layer]} exports it, the consumer does not map it"
        for layer in sorted(set(owner) - set(wanted))
    ]
    if problems:
        raise HandshakeError(problems)


def _rank_problems(p_rank: int, p_tp: int, c_rank: int, c_tp: int) -> list[str]:
    out = []
    for who, rank, tp in (("producer", p_rank, p_tp), ("consumer", c_rank, c_tp)):
        if type(tp) is not int or type(rank) is not int or tp < 1 or not 0 <= rank < tp:
            out.append(f"{who} rank {rank!r} of TP{tp!r} is not a rank of that TP size")
    return out


def _list_problems(regions: Sequence[RegionDesc], who: str) -> list[str]:
    out, seen, appended_seen = [], {}, False
    for i, r in enumerate(regions):
        if r.kind.appended:
            appended_seen = True
        elif appended_seen:
            out.append(
                f"{who} lists {r.name} (index {i}) after its draft regions; "
                "draft regions must come last"
            )
        if r.key in seen:
            out.append(
                f"{who} lists {r.name} twice (indices {seen[r.key]} and {i}): two regions "
                "would map to one"
            )
        seen.setdefault(r.key, i)
    return out


def _pair_regions(producer, consumer, stage_layers, holds_draft):
    """[(producer index, consumer index, consumer ref)] and the problems found pairing them."""
    pairs, problems = [], []
    by_key = {r.key: i for i, r in enumerate(consumer) if not r.kind.appended}
    mapped_p = [(i, r) for i, r in enumerate(producer) if not r.kind.appended]
    layers = {layer for _, layer in by_key} if stage_layers is None else set(stage_layers)
    for i, r in mapped_p:
        if r.global_layer not in layers:
            problems.append(
                f"{r.name}: producer exports it, but its stage owns layers {_span(layers)}"
            )
        elif r.key not in by_key:
            problems.append(f"{r.name}: producer exports it, consumer has no such region")
        else:
            pairs.append((i, by_key[r.key], by_key[r.key]))
    sent = {r.key for _, r in mapped_p}
    problems += [
        f"{consumer[ci].name}: consumer expects it, producer (layers {_span(layers)}) "
        "does not export it"
        for key, ci in by_key.items()
        if key[1] in layers and key not in sent
    ]
    app_pairs, app_problems = _pair_appended(producer, consumer, holds_draft)
    return pairs + app_pairs, problems + app_problems


def _pair_appended(producer, consumer, holds_draft):
    pairs, problems = [], []
    app_p = [i for i, r in enumerate(producer) if r.kind.appended]
    n_p, n_c = len(app_p), sum(r.kind.appended for r in consumer)
    if not holds_draft:
        if n_p:
            problems.append(
                f"producer exports {n_p} draft regions, but only the stage holding "
                "the draft (the last PP stage) may"
            )
        return pairs, problems
    dtype_problems = _appended_dtype_problems(producer, consumer)
    if dtype_problems:  # the positions would not line up either; the dtype is the cause
        return pairs, dtype_problems
    for k, pi in enumerate(app_p):
        ref = k - n_p
        ci, r = len(consumer) + ref, producer[pi]
        if ci < 0 or not consumer[ci].kind.appended:
            where = consumer[ci].name if ci >= 0 else "nothing"
            problems.append(
                f"{r.name}: producer's draft region {ref} from the consumer's end "
                f"lands on {where} (producer {n_p} draft regions, consumer {n_c})"
            )
        elif consumer[ci].key != r.key:
            problems.append(
                f"{r.name}: numbered {ref} from the end, it meets consumer "
                f"{consumer[ci].name} (producer {n_p} draft regions, consumer {n_c})"
            )
        else:
            pairs.append((pi, ci, ref))
    for ci in range(len(consumer) - n_c, len(consumer) - n_p):
        problems.append(
            f"{consumer[ci].name}: consumer expects it, producer does not export "
            f"it (producer {n_p} draft regions, consumer {n_c})"
        )
    return pairs, problems


def _appended_dtype_problems(producer, consumer):
    """Draft regions both sides list under one name but at different dtypes (an fp8 draft pool
    against a bf16 one also differs in its scale regions, which shifts every position)."""
    theirs = {r.key: r for r in consumer if r.kind.appended}
    return [
        f"{r.name}: dtype producer {r.dtype}, consumer {theirs[r.key].dtype}"
        for r in producer
        if r.kind.appended and r.key in theirs and theirs[r.key].dtype != r.dtype
    ]


def _compat_problems(p: RegionDesc, p_tp: int, c: RegionDesc, c_tp: int) -> list[str]:
    out = []
    for field in ("dtype", "head_dim", "total_heads"):
        pv, cv = getattr(p, field), getattr(c, field)
        if pv != cv:
            out.append(f"{p.name}: {field} producer {pv}, consumer {cv}")
    if p.replicated != c.replicated:
        out.append(
            f"{p.name}: replicated producer {_held(p, p_tp)}, consumer {_held(c, c_tp)}; "
            "both sides must hold it the same way"
        )
    if not out and p.unit_bytes != c.unit_bytes:  # else it follows from a difference above
        out.append(f"{p.name}: unit_bytes producer {p.unit_bytes}, consumer {c.unit_bytes}")
    if not (p.replicated or c.replicated) and p.total_heads == c.total_heads:
        out += _head_problems(p, p_tp, "producer") + _head_problems(c, c_tp, "consumer")
    out += _page_problems(p, c)
    return out


def _head_problems(r: RegionDesc, tp: int, who: str) -> list[str]:
    try:
        _, per = heads_of_rank(r.total_heads, tp, 0)
    except LayoutError:
        return [
            f"{r.name}: {r.total_heads} heads do not divide over {who} TP{tp} "
            "(no even head cut: heads must be a multiple of TP or TP a multiple of heads)"
        ]
    if per != r.heads_per_rank:
        return [
            f"{r.name}: {who} declares {r.heads_per_rank} heads per rank, but "
            f"{r.total_heads} heads over TP{tp} is {per} per rank"
        ]
    return []


def _page_problems(p: RegionDesc, c: RegionDesc) -> list[str]:
    if p.tokens_per_page == c.tokens_per_page:
        if p.runs != c.runs:
            return [
                f"{p.name}: runs_per_page producer {_runs(p)}, consumer {_runs(c)} at "
                f"{p.tokens_per_page}-token pages; both sides must declare the cache's own "
                "head-major runs (page-16 sub-pages of a 128-token page are 8 runs)"
            ]
        return []
    if p.run_tokens != c.run_tokens:
        return [
            f"{p.name}: tokens_per_page producer {p.tokens_per_page}, consumer "
            f"{c.tokens_per_page} with runs of {p.run_tokens} vs {c.run_tokens} tokens; "
            "pages of different sizes re-split only when both sides' runs hold the same "
            "tokens (token-major regions at any page sizes; 128-token pages of 8 page-16 "
            "runs into 16-token pages)"
        ]
    return []


def _plan_pair(p: RegionDesc, c: RegionDesc, ranks, refs) -> PairPlan | None:
    p_rank, p_tp, c_rank, c_tp = ranks
    if p.replicated:
        if p_rank != c_rank * p_tp // c_tp:
            return None
        heads = (0, 0, p.heads_per_rank)
    else:
        heads = _head_cut(p.total_heads, p_rank, p_tp, c_rank, c_tp)
        if heads is None:
            return None
    src0, dst0, n = heads
    return PairPlan(
        *refs,
        name=p.name,
        mode=_mode(p, c, n),
        src_head_start=src0,
        dst_head_start=dst0,
        num_heads=n,
        src_heads=p.heads_per_rank,
        dst_heads=c.heads_per_rank,
        unit_bytes=p.unit_bytes,
        run_tokens=p.run_tokens,
        src_runs=p.runs,
        dst_runs=c.runs,
    )


def _head_cut(total, p_rank, p_tp, c_rank, c_tp) -> tuple[int, int, int] | None:
    """(src local start, dst local start, count) this producer rank sends this consumer rank."""
    ps, pn = heads_of_rank(total, p_tp, p_rank)
    cs, cn = heads_of_rank(total, c_tp, c_rank)
    lo, hi = max(ps, cs), min(ps + pn, cs + cn)
    if hi <= lo:
        return None
    p_replicas = max(1, p_tp // total)  # producer ranks holding the same head
    if p_rank % p_replicas != c_rank % p_replicas:
        return None
    return lo - ps, lo - cs, hi - lo


def _mode(p: RegionDesc, c: RegionDesc, n: int) -> str:
    if p.replicated:
        return "replicated"
    split, merge = p.heads_per_rank > n, c.heads_per_rank > n
    return {(False, False): "whole", (True, False): "split", (False, True): "merge"}.get(
        (split, merge), "regroup"
    )


def _held(r: RegionDesc, tp: int) -> str:
    if r.replicated:
        return f"True (all {r.total_heads} heads whole on every rank of TP{tp})"
    return f"False ({r.heads_per_rank} of {r.total_heads} heads per rank of TP{tp})"


def _runs(r: RegionDesc) -> str:
    return "None (token-major)" if r.runs_per_page is None else str(r.runs_per_page)


def _span(layers: set[int]) -> str:
    if not layers:
        return "none"
    lo, hi = min(layers), max(layers)
    return f"{lo}..{hi}" if len(layers) == hi - lo + 1 else ",".join(map(str, sorted(layers)))
