"""P/D with a draft that runs whole on every TP rank (ATOM_DSPARK): its pool's regions are
replicated, and each consumer rank gets every draft head from exactly one producer rank.

Bytes are moved for real: each rank describes a live pool (a stand-in for SGLang's MHA pool plus
a real :class:`DraftKVPool`) with :func:`describe_pool`; every producer rank's buffers are filled
with its own random bytes, every consumer's poisoned, the planned spans copied, and each
consumer rank must hold its target heads and the whole draft rows of exactly one producer rank
in the request's slots, every byte written once, and nothing outside them.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from sgl_atom import pool_state
from sgl_atom.disagg import HandshakeError, RegionDesc, RegionError, build_rank_regions, wire
from sgl_atom.disagg.plan import plan_transfer
from sgl_atom.disagg.pool_regions import PoolExport, describe_pool
from sgl_atom.disagg.regions import RegionKind
from sgl_atom.parallel_layout import heads_of_rank
from sgl_atom.speculative.dspark.pool import DraftKVPool

K = RegionKind
TARGET_HEADS, DRAFT_HEADS = 2, 2
SLOTS = 160
POISON = 0xA5
N_TOKENS = 37  # ragged: the last page is partly filled


class _Pool(SimpleNamespace):
    """A stand-in for SGLang's MHA token pool (weak-referenceable, like the real one)."""


def _export(tp_rank: int, tp_size: int, dtype: str, page: int) -> PoolExport:
    """One rank's pool: 2 target layers (this rank's heads), a 2-layer draft holding all heads."""
    fp8 = dtype == "fp8"
    store = torch.float8_e4m3fn if fp8 else torch.bfloat16
    _, per = heads_of_rank(TARGET_HEADS, tp_size, tp_rank)
    pool = _Pool(
        k_buffer=[torch.zeros(SLOTS, per, 16, dtype=store) for _ in range(2)],
        v_buffer=[torch.zeros(SLOTS, per, 16, dtype=store) for _ in range(2)],
        dtype=store,
        store_dtype=store,
        page_size=page,
        start_layer=0,
    )
    if fp8:
        pool_state.state_of(pool).kv_scales = SimpleNamespace(
            k=[torch.ones(SLOTS, per) for _ in range(2)],
            v=[torch.ones(SLOTS, per) for _ in range(2)],
        )
    draft = DraftKVPool(
        slots=SLOTS, layers=2, kv_heads=DRAFT_HEADS, head_dim=8, dtype=dtype, device="cpu"
    )
    return describe_pool(
        pool, tp_rank=tp_rank, tp_size=tp_size, total_kv_heads=TARGET_HEADS, draft_pool=draft
    )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's storage as flat bytes (a view: writes land in the tensor)."""
    return t.view(-1).view(torch.uint8)


def _rows(t: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """Rows ``[len(slots), heads, row bytes]`` as bytes."""
    return _bytes(t).view(t.shape[0], t.shape[1], -1)[slots]


def _page_ids(n_pages: int, spare: int, rng: random.Random) -> list[int]:
    ids = list(range(n_pages + spare))
    rng.shuffle(ids)  # page ids are not positions
    return ids[:n_pages]


def _slots(pages: list[int], page: int) -> list[int]:
    return [pages[i // page] * page + i % page for i in range(N_TOKENS)]


def _move(p_tp, c_tp, dtype, p_page=4, c_page=4, seed=0):
    """Plan and copy one request of N_TOKENS; returns the exports, slots and per-byte writes."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    prods = [_export(r, p_tp, dtype, p_page) for r in range(p_tp)]
    conss = [_export(r, c_tp, dtype, c_page) for r in range(c_tp)]
    for ex in prods:
        for t in ex.tensors:
            b = _bytes(t)
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))
    for ex in conss:
        for t in ex.tensors:
            _bytes(t).fill_(POISON)
    src = _page_ids(-(-N_TOKENS // p_page), 3, rng)
    dst = _page_ids(-(-N_TOKENS // c_page), 3, rng)
    writes = {
        (c, i): torch.zeros_like(_bytes(t), dtype=torch.int32)
        for c, ex in enumerate(conss)
        for i, t in enumerate(ex.tensors)
    }
    draft_from = {}
    for p, prod in enumerate(prods):
        for c, cons in enumerate(conss):
            plan = plan_transfer(prod.regions, p, p_tp, cons.regions, c, c_tp)
            for pair in plan.pairs:
                s = _bytes(prod.tensors[pair.producer_index])
                d = _bytes(cons.tensors[pair.consumer_index])
                if pair.name.startswith("draft_"):
                    assert pair.mode == "replicated", pair
                    draft_from.setdefault((c, pair.name), []).append(p)
                for so, do, n in pair.spans(src, dst):
                    d[do : do + n] = s[so : so + n]
                    writes[c, pair.consumer_index][do : do + n] += 1
    return prods, conss, _slots(src, p_page), _slots(dst, c_page), writes, draft_from


CASES = {
    "tp1-tp2-bf16": (1, 2, "bf16", 4, 4),
    "tp1-tp2-fp8": (1, 2, "fp8", 4, 4),
    "tp2-tp1-bf16": (2, 1, "bf16", 4, 4),
    "tp2-tp1-fp8": (2, 1, "fp8", 4, 4),
    "tp2-tp2-bf16": (2, 2, "bf16", 4, 4),
    "tp2-tp2-fp8": (2, 2, "fp8", 4, 4),
    "tp1-tp2-fp8-page4-into-page1": (1, 2, "fp8", 4, 1),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_each_consumer_rank_gets_the_whole_draft_from_one_producer_rank(case):
    p_tp, c_tp, dtype, p_page, c_page = case
    prods, conss, src, dst, writes, draft_from = _move(p_tp, c_tp, dtype, p_page, c_page)
    n_draft = 2 * (4 if dtype == "fp8" else 2)
    for c, cons in enumerate(conss):
        one = c * p_tp // c_tp
        cs, cn = heads_of_rank(TARGET_HEADS, c_tp, c)
        dst_pages = {s // c_page for s in dst}  # whole pages move, tail slots included
        outside = [s for s in range(SLOTS) if s // c_page not in dst_pages]
        for i, (r, t) in enumerate(zip(cons.regions, cons.tensors, strict=True)):
            if r.kind.appended:
                assert draft_from[c, r.name] == [one], (c, r.name)
                want = _rows(prods[one].tensors[i - len(cons.regions)], src)
            else:
                want = torch.cat(
                    [_target_head(prods, p_tp, r, g, src) for g in range(cs, cs + cn)], 1
                )
            assert torch.equal(_rows(t, dst), want), (c, r.name)
            assert (_rows(t, outside) == POISON).all(), f"{r.name} rank {c}: written outside"
            w = writes[c, i].view(t.shape[0], -1)
            assert (w[dst] == 1).all(), f"{r.name} rank {c}: a byte written twice or never"
        assert sum(r.kind.appended for r in cons.regions) == n_draft
        assert all(
            r.replicated and r.heads_per_rank == DRAFT_HEADS for r in cons.regions[-n_draft:]
        )


def _target_head(prods, p_tp, r: RegionDesc, head: int, src) -> torch.Tensor:
    """Global target head `head` of region r's rows as the producer rank holding it wrote them."""
    for p, prod in enumerate(prods):
        ps, pn = heads_of_rank(TARGET_HEADS, p_tp, p)
        if ps <= head < ps + pn:
            i = next(j for j, x in enumerate(prod.regions) if x.key == r.key)
            return _rows(prod.tensors[i], src)[:, head - ps : head - ps + 1]
    raise AssertionError(f"no producer rank holds head {head}")


def test_plans_pair_draft_regions_whole_pages_from_one_rank():
    cases = {(1, 2): [[0], [0]], (2, 1): [[0]], (2, 2): [[0], [1]]}
    for (p_tp, c_tp), want in cases.items():
        got = [[] for _ in range(c_tp)]
        for p in range(p_tp):
            prod = _export(p, p_tp, "fp8", 4)
            for c in range(c_tp):
                plan = plan_transfer(
                    prod.regions, p, p_tp, _export(c, c_tp, "fp8", 4).regions, c, c_tp
                )
                drafts = [x for x in plan.pairs if x.name.startswith("draft_")]
                if drafts:
                    got[c].append(p)
                    assert len(drafts) == 8 and all(x.whole_pages for x in drafts)
                    assert {(x.num_heads, x.src_heads, x.dst_heads) for x in drafts} == {(2, 2, 2)}
        assert got == want, (p_tp, c_tp)


def test_describe_pool_exports_the_draft_whole_at_tp2():
    for rank in range(2):
        export = _export(rank, 2, "fp8", 4)
        target, draft = export.regions[:8], export.regions[8:]
        assert {(r.heads_per_rank, r.total_heads, r.replicated) for r in target} == {(1, 2, False)}
        assert [r.kind for r in draft[:4]] == [
            K.DRAFT_K,
            K.DRAFT_V,
            K.DRAFT_K_SCALE,
            K.DRAFT_V_SCALE,
        ]
        assert {(r.heads_per_rank, r.total_heads, r.replicated) for r in draft} == {(2, 2, True)}
        assert draft[0].unit_bytes == 8 and draft[2].unit_bytes == 4
        assert export.tensors[8].shape == (SLOTS, DRAFT_HEADS, 8)


# ---------------------------------------------------------------- refusals


def _rank(tp_rank, tp_size, **over) -> list[RegionDesc]:
    args = dict(
        layers=range(2),
        tp_rank=tp_rank,
        tp_size=tp_size,
        kv_heads=2,
        head_dim=4,
        dtype="fp8",
        fp8_scales=True,
        page_size=4,
        draft_layers=2,
        draft_whole=True,
    )
    return build_rank_regions(**{**args, **over})


def _refusal(*args) -> str:
    with pytest.raises(HandshakeError) as e:
        plan_transfer(*args)
    return str(e.value)


def test_sharded_against_whole_is_refused_naming_region_and_both_values():
    sharded = _rank(0, 2, draft_whole=False)
    msg = _refusal(sharded, 0, 2, _rank(0, 1), 0, 1)
    for name in ("draft_k draft layer 0", "draft_v_scale draft layer 1"):
        assert (
            f"{name}: replicated producer False (1 of 2 heads per rank of TP2), consumer True "
            "(all 2 heads whole on every rank of TP1)" in msg
        ), msg
    assert "heads per rank, but" not in msg  # the flag is the cause; no head-cut noise
    msg = _refusal(_rank(0, 1), 0, 1, _rank(1, 2, draft_whole=False), 1, 2)
    assert (
        "draft_v draft layer 0: replicated producer True (all 2 heads whole on every rank " in msg
    )
    assert "consumer False (1 of 2 heads per rank of TP2)" in msg
    # at TP1 both forms hold the same bytes; the declarations must still agree
    assert "replicated producer False" in _refusal(
        _rank(0, 1, draft_whole=False), 0, 1, _rank(0, 1), 0, 1
    )


def test_draft_head_count_mismatch_is_refused():
    msg = _refusal(_rank(0, 2), 0, 2, _rank(0, 1, draft_kv_heads=4), 0, 1)
    assert "draft_k draft layer 0: total_heads producer 2, consumer 4" in msg, msg
    assert "draft_k_scale draft layer 1: total_heads producer 2, consumer 4" in msg, msg


@pytest.mark.parametrize(
    "over, match",
    [
        (
            dict(heads_per_rank=1),
            "a replicated region holds all its heads on every rank, got 1 of 2",
        ),
        (dict(kind="target_v"), "replicated=True, but target_v regions are never replicated"),
        (
            dict(kind="index_k", replicated=False, heads_per_rank=1, total_heads=1),
            "always replicated",
        ),
        (dict(kind="index_k"), "a replicated index_k unit has 1 head of 1, got 2 of 2"),
    ],
    ids=["draft-missing-heads", "target-whole", "index-sharded", "index-two-heads"],
)
def test_region_validation_of_whole_regions(over, match):
    args = dict(
        kind=K.DRAFT_K,
        global_layer=0,
        dtype="bfloat16",
        head_dim=8,
        heads_per_rank=2,
        total_heads=2,
        tokens_per_page=4,
        replicated=True,
    )
    with pytest.raises(RegionError, match=match):
        RegionDesc(**{**args, **over})
    assert RegionDesc(**args).replicated  # the draft form itself is valid


def test_whole_draft_regions_round_trip_the_wire():
    regions = tuple(_export(1, 2, "fp8", 4).regions)
    hs = wire.Handshake("consumer", 1, 2, 0, 1, (0, 2), regions, (), "d1", b"m")
    assert wire.decode(wire.encode(hs)) == hs
    assert [r.replicated for r in hs.regions] == [False] * 8 + [True] * 8
