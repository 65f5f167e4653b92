"""P/D transfer core: region descriptions, handshake pairing and head cuts, the control wire.

Head cuts are checked by moving bytes: every producer rank's buffers are filled with a marker per
(token, global head, byte) through the region's own page layout, every planned span is copied,
and each consumer rank must read back exactly its heads, each cell written once.
"""

from __future__ import annotations

import json
import pickle
import random
import struct

import pytest

from sgl_atom.disagg import (
    Handshake,
    HandshakeError,
    RegionDesc,
    RegionError,
    RegionKind,
    TransferRequest,
    TransferStatus,
    WireError,
    build_rank_regions,
    check_stage_coverage,
    decode,
    encode,
    plan_transfer,
    wire,
)
from sgl_atom.disagg.wire import CudaIpcRegion
from sgl_atom.parallel_layout import heads_of_rank

K = RegionKind


def _rank(tp_rank=0, tp_size=1, **over) -> list[RegionDesc]:
    args = dict(
        layers=range(2),
        tp_rank=tp_rank,
        tp_size=tp_size,
        kv_heads=4,
        head_dim=2,
        dtype="bf16",
        page_size=16,
        runs_per_page=4,
    )
    args.update(over)
    return build_rank_regions(**args)


def _by_name(plan):
    return {p.name: p for p in plan.pairs}


def _refusal(*args, **kw) -> str:
    with pytest.raises(HandshakeError) as e:
        plan_transfer(*args, **kw)
    return str(e.value)


# ---------------------------------------------------------------- byte-level simulation


def _offset(r: RegionDesc, page: int, tok: int, head: int, byte: int) -> int:
    """Byte of (token, local head) in region r, straight from the layout's definition."""
    run, t = divmod(tok, r.run_tokens)
    return (
        page * r.tokens_per_page * r.heads_per_rank * r.unit_bytes
        + ((run * r.heads_per_rank + head) * r.run_tokens + t) * r.unit_bytes
        + byte
    )


def _pages(n_tokens: int, page: int, rng: random.Random) -> list[int]:
    n = -(-n_tokens // page)
    ids = list(range(n + 2))  # spare pages, shuffled: page ids are not positions
    rng.shuffle(ids)
    return ids[:n]


def _simulate(prod_kw, p_tp, cons_kw, c_tp, n_tokens=37, seed=0):
    rng = random.Random(seed)
    prods = [_rank(p, p_tp, **prod_kw) for p in range(p_tp)]
    conss = [_rank(c, c_tp, **cons_kw) for c in range(c_tp)]
    sp = _pages(n_tokens, prods[0][0].tokens_per_page, rng)
    dp = _pages(n_tokens, conss[0][0].tokens_per_page, rng)
    src = {}
    for p, regions in enumerate(prods):
        for i, r in enumerate(regions):
            buf = [None] * ((max(sp) + 1) * r.page_bytes)
            h0 = 0 if r.replicated else heads_of_rank(r.total_heads, p_tp, p)[0]
            for tok in range(len(sp) * r.tokens_per_page):
                for h in range(r.heads_per_rank):
                    for b in range(r.unit_bytes):
                        page, t = divmod(tok, r.tokens_per_page)
                        buf[_offset(r, sp[page], t, h, b)] = (r.name, tok, h0 + h, b)
            src[p, i] = buf
    dst = {
        (c, i): [None] * ((max(dp) + 1) * r.page_bytes)
        for c, regions in enumerate(conss)
        for i, r in enumerate(regions)
    }
    writes = {key: [0] * len(buf) for key, buf in dst.items()}
    for p in range(p_tp):
        for c in range(c_tp):
            for pair in plan_transfer(prods[p], p, p_tp, conss[c], c, c_tp).pairs:
                s_buf, key = src[p, pair.producer_index], (c, pair.consumer_index)
                for s_off, d_off, n in pair.spans(sp, dp):
                    dst[key][d_off : d_off + n] = s_buf[s_off : s_off + n]
                    for j in range(d_off, d_off + n):
                        writes[key][j] += 1
    for c, regions in enumerate(conss):
        for i, r in enumerate(regions):
            h0 = 0 if r.replicated else heads_of_rank(r.total_heads, c_tp, c)[0]
            for tok in range(n_tokens):
                page, t = divmod(tok, r.tokens_per_page)
                for h in range(r.heads_per_rank):
                    for b in range(r.unit_bytes):
                        off = _offset(r, dp[page], t, h, b)
                        assert dst[c, i][off] == (r.name, tok, h0 + h, b), (c, r.name, tok, h)
                        assert writes[c, i][off] == 1, f"{r.name} rank {c} written twice"


SIM_CASES = {
    "tp1-tp4-split": (dict(), 1, dict(), 4),
    "tp4-tp1-merge-index": (dict(index_dim=3), 4, dict(index_dim=3), 1),
    "tp2-tp1-merge": (dict(), 2, dict(), 1),
    "tp2-tp4": (dict(), 2, dict(), 4),
    "tp4-tp2": (dict(), 4, dict(), 2),
    "6heads-tp2-tp3-regroup": (dict(kv_heads=6), 2, dict(kv_heads=6), 3),
    "2heads-tp1-tp4-replicated-heads": (dict(kv_heads=2), 1, dict(kv_heads=2), 4),
    "2heads-tp4-tp1": (dict(kv_heads=2), 4, dict(kv_heads=2), 1),
    "token-major-tp1-tp2": (dict(runs_per_page=None), 1, dict(runs_per_page=None), 2),
    "page16-runs-128-tp1-tp4": (
        dict(page_size=128, runs_per_page=8),
        1,
        dict(page_size=128, runs_per_page=8),
        4,
    ),
    "resplit-128x8-into-16": (
        dict(page_size=128, runs_per_page=8),
        1,
        dict(page_size=16, runs_per_page=1),
        4,
    ),
    "resplit-token-major-16-into-4": (
        dict(runs_per_page=None),
        2,
        dict(page_size=4, runs_per_page=None),
        1,
    ),
    "fp8-scales-index-draft": (
        dict(dtype="fp8", fp8_scales=True, index_dim=3, draft_layers=2),
        1,
        dict(dtype="fp8", fp8_scales=True, index_dim=3, draft_layers=2),
        2,
    ),
}


@pytest.mark.parametrize("case", SIM_CASES.values(), ids=SIM_CASES.keys())
def test_head_cut_moves_each_consumer_rank_its_heads(case):
    prod_kw, p_tp, cons_kw, c_tp = case
    n_tokens = 150 if prod_kw.get("page_size") == 128 else 37
    _simulate(prod_kw, p_tp, cons_kw, c_tp, n_tokens=n_tokens)


# ---------------------------------------------------------------- pairing and cuts


def test_tp1_to_tp4_splits_heads_and_copies_index_whole():
    prod = _rank(index_dim=8)
    for c in range(4):
        plan = _by_name(plan_transfer(prod, 0, 1, _rank(c, 4, index_dim=8), c, 4))
        k = plan["target_k layer 1"]
        assert (k.mode, k.src_head_start, k.dst_head_start, k.num_heads) == ("split", c, 0, 1)
        idx = plan["index_k layer 0"]
        assert (idx.mode, idx.num_heads, idx.whole_pages) == ("replicated", 1, True)
        assert idx.spans([2], [5]).tolist() == [
            [2 * idx.src_page_bytes, 5 * idx.dst_page_bytes, 256]
        ]


@pytest.mark.parametrize("p_tp", [4, 2], ids=["tp4-tp1", "tp2-tp1"])
def test_merge_writes_at_the_consumer_head_offset(p_tp):
    cons = _rank(0, 1, index_dim=8)
    per = 4 // p_tp
    for p in range(p_tp):
        plan = plan_transfer(_rank(p, p_tp, index_dim=8), p, p_tp, cons, 0, 1)
        k = _by_name(plan)["target_v layer 0"]
        assert (k.mode, k.src_head_start, k.dst_head_start, k.num_heads) == (
            "merge",
            0,
            p * per,
            per,
        )
        # the replicated index key comes from producer rank 0 only
        assert ("index_k layer 0" in _by_name(plan)) == (p == 0)


def test_tp2_to_tp4_pairs_only_ranks_sharing_heads():
    plans = {
        (p, c): plan_transfer(_rank(p, 2), p, 2, _rank(c, 4), c, 4)
        for p in range(2)
        for c in range(4)
    }
    assert [(p, c) for (p, c), t in plans.items() if not t.empty] == [
        (0, 0),
        (0, 1),
        (1, 2),
        (1, 3),
    ]
    k = _by_name(plans[1, 3])["target_k layer 0"]
    assert (k.mode, k.src_head_start, k.dst_head_start, k.num_heads) == ("split", 1, 0, 1)


def test_draft_fp8_under_bf16_target_numbered_from_the_end_per_stage():
    """PP2 stages of 3 and 5 layers; the draft (2 layers, fp8) sits on the last stage."""
    draft = dict(draft_layers=2, draft_dtype="fp8", fp8_scales=False)
    cons = _rank(1, 2, layers=range(8), **draft)
    stage0 = _rank(0, 1, layers=range(3))
    stage1 = _rank(0, 1, layers=range(3, 8), **draft)
    check_stage_coverage([range(3), range(3, 8)], cons)
    plan0 = plan_transfer(stage0, 0, 1, cons, 1, 2, stage_layers=range(3), holds_draft=False)
    assert {p.name for p in plan0.pairs} == {
        f"target_{x} layer {i}" for x in "kv" for i in range(3)
    }
    plan1 = plan_transfer(stage1, 0, 1, cons, 1, 2, stage_layers=range(3, 8))
    drafts = [p for p in plan1.pairs if p.name.startswith("draft")]
    assert [p.consumer_ref for p in drafts] == [-4, -3, -2, -1]
    for p in drafts:
        c = cons[p.consumer_index]
        assert c.name == p.name and c.dtype == "float8_e4m3fn" and c.unit_bytes == 2
        assert p.producer_index != p.consumer_index  # counted from the start they would not meet
    for p in plan1.pairs:
        if not p.name.startswith("draft"):
            assert (
                cons[p.consumer_index].name == p.name and cons[p.consumer_index].dtype == "bfloat16"
            )
            assert cons[p.consumer_index].global_layer >= 3


def test_pp_stages_number_units_by_global_layer():
    cons = _rank(0, 1, layers=range(6), index_dim=4, index_layers=[1, 4])
    for layers in (range(0, 2), range(2, 6)):
        stage = _rank(
            0, 1, layers=layers, index_dim=4, index_layers=[x for x in (1, 4) if x in layers]
        )
        plan = plan_transfer(stage, 0, 1, cons, 0, 1, stage_layers=layers)
        for p in plan.pairs:
            assert cons[p.consumer_index] == stage[p.producer_index]
        assert {cons[p.consumer_index].global_layer for p in plan.pairs} == set(layers)


def test_stage_coverage_refuses_gaps_and_overlaps():
    cons = _rank(layers=range(6))
    msg = str(
        pytest.raises(HandshakeError, check_stage_coverage, [range(3), range(2, 5)], cons).value
    )
    assert "layer 2: stages 0 and 1 both export it" in msg
    assert "layer 5: no producer stage exports it" in msg


# ---------------------------------------------------------------- refusals


def test_missing_region_on_either_side_is_named():
    with_scales = _rank(dtype="fp8", fp8_scales=True)
    without = _rank(dtype="fp8")
    msg = _refusal(with_scales, 0, 1, without, 0, 1)
    assert "k_scale layer 0: producer exports it, consumer has no such region" in msg
    msg = _refusal(without, 0, 1, with_scales, 0, 1)
    assert "v_scale layer 1: consumer expects it, producer (layers 0..1) does not export it" in msg


def test_missing_draft_and_draft_on_a_non_last_stage_are_refused():
    cons = _rank(draft_layers=1)
    msg = _refusal(_rank(), 0, 1, cons, 0, 1)
    assert "draft_k draft layer 0: consumer expects it, producer does not export it" in msg
    msg = _refusal(cons, 0, 1, cons, 0, 1, holds_draft=False)
    assert "only the stage holding the draft" in msg


def test_two_producer_regions_on_one_consumer_region():
    prod = _rank()
    msg = _refusal(prod + [prod[0]], 0, 1, _rank(), 0, 1)
    assert "producer lists target_k layer 0 twice (indices 0 and 4)" in msg
    # more draft regions than the consumer has: the extra one lands on a mapped region
    msg = _refusal(_rank(draft_layers=2), 0, 1, _rank(draft_layers=1), 0, 1)
    assert (
        "draft_k draft layer 0: producer's draft region -4 from the consumer's end lands on "
        "target_k layer 1" in msg
    )


def test_dtype_and_head_dim_mismatch_name_both_values():
    msg = _refusal(_rank(draft_layers=1), 0, 1, _rank(draft_layers=1, draft_dtype="fp8"), 0, 1)
    assert "draft_k draft layer 0: dtype producer bfloat16, consumer float8_e4m3fn" in msg
    assert "unit_bytes" not in msg
    msg = _refusal(_rank(), 0, 1, _rank(head_dim=4), 0, 1)
    assert "target_v layer 1: head_dim producer 2, consumer 4" in msg


def test_draft_dtype_mismatch_with_scales_on_one_side_names_the_dtypes():
    """An fp8 draft (with its scale regions) against a bf16 one: the region counts differ too,
    but the refusal names the draft regions' dtypes, not the positions that no longer meet."""
    fp8 = _rank(dtype="fp8", fp8_scales=True, draft_layers=2, draft_dtype="fp8")
    bf16 = _rank(dtype="fp8", fp8_scales=True, draft_layers=2, draft_dtype="bf16")
    for prod, cons, pv, cv in (
        (fp8, bf16, "float8_e4m3fn", "bfloat16"),
        (bf16, fp8, "bfloat16", "float8_e4m3fn"),
    ):
        msg = _refusal(prod, 0, 1, cons, 0, 1)
        for name in ("draft_k draft layer 0", "draft_v draft layer 1"):
            assert f"{name}: dtype producer {pv}, consumer {cv}" in msg, msg
        assert "from the end" not in msg and "lands on" not in msg, msg


def test_every_problem_is_reported_at_once():
    cons = _rank(1, 2, head_dim=4, draft_layers=1, draft_dtype="fp8", runs_per_page=2)
    err = pytest.raises(HandshakeError, plan_transfer, _rank(draft_layers=1), 0, 1, cons, 1, 2)
    problems = err.value.problems
    assert len(problems) >= 8
    assert any("target_k layer 0: head_dim" in p for p in problems)
    assert any("target_v layer 1: runs_per_page producer 4, consumer 2" in p for p in problems)
    assert any("draft_v draft layer 0: dtype" in p for p in problems)


def test_page16_declared_as_one_run_is_refused():
    page16 = dict(page_size=128, runs_per_page=8)
    one_run = dict(page_size=128, runs_per_page=1)
    for c_tp in (2, 4):  # a consumer with several heads per rank, and one with a single head
        msg = _refusal(_rank(**one_run), 0, 1, _rank(0, c_tp, **page16), 0, c_tp)
        assert "target_k layer 0: runs_per_page producer 1, consumer 8 at 128-token pages" in msg
    msg = _refusal(_rank(**page16), 0, 1, _rank(0, 2, runs_per_page=None, page_size=128), 0, 2)
    assert "runs_per_page producer 8, consumer None (token-major)" in msg


def test_incompatible_page_sizes_say_what_can_be_resplit():
    msg = _refusal(_rank(page_size=128, runs_per_page=1), 0, 1, _rank(page_size=16), 0, 1)
    assert "tokens_per_page producer 128, consumer 16 with runs of 128 vs 4 tokens" in msg
    assert "re-split only when both sides' runs hold the same tokens" in msg


def test_heads_that_do_not_divide_are_refused():
    with pytest.raises(RegionError, match="3 heads do not divide over TP2"):
        _rank(0, 2, kv_heads=3)
    prod = _rank(kv_heads=3)
    cons = [
        RegionDesc(
            r.kind, r.global_layer, r.dtype, r.head_dim, 1, 3, r.tokens_per_page, r.runs_per_page
        )
        for r in prod
    ]
    msg = _refusal(prod, 0, 1, cons, 0, 2)
    assert "target_k layer 0: 3 heads do not divide over consumer TP2" in msg
    wrong = [
        RegionDesc(
            r.kind, r.global_layer, r.dtype, r.head_dim, 1, 4, r.tokens_per_page, r.runs_per_page
        )
        for r in _rank()
    ]
    msg = _refusal(wrong, 0, 1, _rank(), 0, 1)
    assert "target_k layer 0: producer declares 1 heads per rank, but 4 heads over TP1 is 4" in msg


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(runs_per_page=3), "runs_per_page 3 must divide tokens_per_page 16"),
        (dict(kind="draft_q"), "unknown region kind 'draft_q'"),
        (dict(dtype="bf16"), "dtype 'bf16' is not one of"),
        (dict(replicated=True), "target_k regions are never replicated"),
        (dict(heads_per_rank=8), "heads_per_rank 8 exceeds total_heads 4"),
        (dict(unit_bytes=3), "unit_bytes 3 < head_dim 2 x 2 bytes"),
        (dict(global_layer=True), "global_layer must be an int"),
    ],
)
def test_region_validation(over, match):
    args = dict(
        kind=K.TARGET_K,
        global_layer=0,
        dtype="bfloat16",
        head_dim=2,
        heads_per_rank=4,
        total_heads=4,
        tokens_per_page=16,
        runs_per_page=4,
    )
    args.update(over)
    with pytest.raises(RegionError, match=match):
        RegionDesc(**args)
    with pytest.raises(RegionError, match="fp8_scales needs an fp8 KV dtype"):
        _rank(fp8_scales=True)


# ---------------------------------------------------------------- wire


def _messages() -> list:
    regions = tuple(_rank(dtype="fp8", fp8_scales=True, index_dim=4, draft_layers=1))
    return [
        Handshake(
            "producer",
            0,
            1,
            1,
            2,
            (3, 8),
            regions,
            tuple(range(len(regions))),
            "p0",
            bytes(range(256)) * 3,
            region_devices=tuple(i % 3 - 1 for i in range(len(regions))),  # host, cuda:0, cuda:1
        ),
        Handshake("consumer", 3, 4, 0, 1, (0, 0), (), (), "", b""),
        Handshake(
            "consumer",
            0,
            1,
            0,
            1,
            (0, 4),
            regions[:2],
            (1 << 40, 2 << 40),
            "d0",
            b"m",
            region_bytes=(4096, 8192),
            device_uuid="GPU-1234",
            ipc_regions=tuple(
                CudaIpcRegion(
                    0, bytes([i]) * 64, 1 << 30, 512, 4096 * i, n, b"/torch_rc", 8, b"", i == 1
                )
                for i, n in enumerate((4096, 8192))
            ),
        ),  # fmt: skip
        TransferRequest(2**64 - 1, 3, (5, 0, 2**31 - 1), 1, 1),
        TransferRequest(0, 0, (), 0, 4),
        TransferStatus(7, "done"),
        TransferStatus.failed(8, "x" * 5000),
    ]


@pytest.mark.parametrize("msg", _messages(), ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert decode(encode(msg)) == msg


def test_failed_status_is_cut_to_the_cap():
    assert len(TransferStatus.failed(1, "é" * 9999).error) == wire.MAX_ERROR


_HS = ("producer", 0, 1, 0, 1, (0, 1), (), (), "")


@pytest.mark.parametrize(
    "bad, match",
    [
        (TransferStatus(1, "done", "but an error"), "a done transfer carries no error text"),
        (TransferStatus(1, "failed", "x" * (wire.MAX_ERROR + 1)), r"\.error: .*at most 1024"),
        (TransferRequest(-1, 0, (), 0, 1), r"\.room: .*greater than or equal to 0"),
        (TransferRequest(1, 0, (1.5,), 0, 1), "wrong type.*field_name='page_ids'"),
        (TransferRequest(1, 0, 7, 0, 1), "wrong type.*field_name='page_ids'"),
        (TransferRequest(1, 0, (3, True), 0, 1), r"\.page_ids\[1\]: .*valid integer, got bool"),
        (TransferRequest(1, 0, (), 0, 1, peers=0), r"\.peers: .*greater than or equal to 1"),
        (wire.Heartbeat("a", "h:1", rooms=(2**64,)), r"\.rooms\[0\]: .*less than or equal"),
        (Handshake("router", *_HS[1:], b""), r"Handshake\.role: .*'producer' or 'consumer'"),
        (Handshake(*_HS, "not bytes"), "wrong type.*_to_base64.*bytes-like"),
        (Handshake(*_HS[:6], ("region",), (), "", b""), "wrong type.*_region_json"),
        ("not a message", "not a control message: str"),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, str) else None,
)
def test_encode_refuses_what_decode_would(bad, match):
    with pytest.raises(WireError, match=match):
        encode(bad)


def _frame(obj, code=3, version=wire.VERSION, magic=wire.MAGIC, raw=None) -> bytes:
    body = raw if raw is not None else json.dumps(obj).encode()
    return wire.HEADER.pack(magic, version, code, 0, len(body)) + body


_REQUEST = json.loads(encode(TransferRequest(5, 0, (1, 2), 0, 2))[wire.HEADER.size :])


class _Boom:
    ran = False

    def __reduce__(self):
        return (setattr, (_Boom, "ran", True))


@pytest.mark.parametrize(
    "frame, match",
    [
        (b"", "shorter than"),
        (_frame({}, magic=b"NOPE"), "bad magic"),
        (_frame({}, version=wire.VERSION + 1), f"version {wire.VERSION + 1}"),
        (_frame({}, version=1), "version 1, this side speaks"),
        (_frame({}, code=9), "unknown message type 9"),
        (_frame({"room": 1, "status": "done", "error": ""})[:-1], "does not match"),
        (_frame({"room": 1.0, "status": "done", "error": ""}), "non-integer"),
        (_frame(None, raw=b'{"room": NaN, "status": "done", "error": ""}'), "non-integer"),
        (_frame(None, raw=b'{"room":1,"room":2,"status":"done","error":""}'), "duplicate key"),
        (_frame({"room": True, "status": "done", "error": ""}), r"\.room: .*valid integer"),
        (_frame({"room": 1, "status": "done", "error": "", "x": 1}), r"\.x: unknown field"),
        (_frame({"room": 1, "status": "done"}), r"missing fields \['error'\]"),
        (_frame({"room": 1, "status": "maybe", "error": ""}), r"\.status: .*'done' or 'failed'"),
        (_frame(None, raw=b"[" * 100_000), "not valid JSON"),
        (_frame(None, raw=b'{"room": 1' + b"0" * 5000 + b"}"), "not valid JSON"),
        (_frame(None, raw=b"\xff\xfe"), "not valid JSON"),
        (_frame(None, raw=pickle.dumps(_Boom())), "not valid JSON"),
        (pickle.dumps(_Boom()), "bad magic|shorter"),
        ("SAPD" + "\0" * 8, "a frame is bytes, got str"),
        (wire.HEADER.pack(wire.MAGIC, wire.VERSION, 3, 1, 2) + b"{}", "reserved field 1"),
        (_frame({"status": "done", "error": ""}), r"missing fields \['room'\]"),
        (_frame([]), r"TransferStatus: input should be a dictionary"),
        (_frame({"room": 2**64, "status": "done", "error": ""}), r"\.room: .*less than or equal"),
        (_frame({"room": 1, "status": 5, "error": ""}), r"\.status: .*'done' or 'failed'"),
        (_frame({"room": 1, "status": "failed", "error": "\ud800"}), r"\.error: .*unicode"),
        (_frame({"room": 1, "status": "failed", "error": "e" * 1025}), r"\.error: .*at most 1024"),
        (_frame({"room": 1, "status": "done", "error": "e"}), "done transfer carries no error"),
        (
            _frame({"agent_name": "a", "endpoint": "h", "reply": 1, "rooms": []}, code=4),
            r"Heartbeat\.reply: .*valid boolean",
        ),
        (
            _frame({"agent_name": "a", "endpoint": "h", "reply": False, "rooms": [0] * 65537}, 4),
            r"Heartbeat\.rooms: .*at most 65536 items",
        ),
        (_frame({**_REQUEST, "page_ids": [0, 2**31]}, 2), r"\.page_ids\[1\]: .*less than or"),
        (
            _frame({**_REQUEST, "page_ids": [0] * (wire.MAX_PAGE_IDS + 1)}, 2),
            r"\.page_ids: .*at most 1048576 items",
        ),
        (_frame({**_REQUEST, "head_count": 0}, 2), r"\.head_count: .*greater than or equal"),
        (_frame({**_REQUEST, "aux_index": -2}, 2), r"\.aux_index: .*greater than or equal"),
        (_frame({**_REQUEST, "agent_name": None}, 2), r"\.agent_name: .*valid string"),
    ],
)
def test_decode_refuses(frame, match):
    with pytest.raises(WireError, match=match):
        decode(frame)
    assert not _Boom.ran


def test_body_cap_holds_both_ways(monkeypatch):
    frame = encode(TransferStatus.failed(3, "e" * 100))
    monkeypatch.setattr(wire, "MAX_BODY", 64)
    with pytest.raises(WireError, match="TransferStatus body is 1.. bytes, cap 64"):
        encode(TransferStatus.failed(3, "e" * 100))
    with pytest.raises(WireError, match=r"body length 1.. does not match .*\(cap 64\)"):
        decode(frame)


def _handshake_body() -> dict:
    return json.loads(encode(_messages()[0])[wire.HEADER.size :])


_B64_CAP = 4 * ((wire.MAX_AGENT_METADATA + 2) // 3)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("tp_rank", 1, "rank tp 1/1"),
        ("pp_rank", 2, "pp 2/2"),
        ("tp_rank", 1024, r"\.tp_rank: .*less than or equal to 1023"),
        ("stage_layers", [5, 3], "is not \\[first, end\\)"),
        ("stage_layers", [0], r"\.stage_layers\[1\]: field required"),
        ("stage_layers", [0, 65537], r"\.stage_layers\[1\]: .*less than or equal"),
        ("region_addrs", [1, 2], "2 region_addrs for"),
        ("region_bytes", [1], "1 region_bytes for"),
        ("region_devices", [0], "1 region_devices for"),
        ("region_devices", [-2], r"\.region_devices\[0\]: .*greater than or equal to -1"),
        ("agent_metadata", "!!!", "agent_metadata: not valid base64"),
        ("agent_metadata", "A" * (_B64_CAP + 4), "agent_metadata: expected base64 of at most"),
        ("agent_metadata", 7, "agent_metadata: expected base64"),
        ("agent_name", "n" * 257, r"\.agent_name: .*at most 256"),
        ("status_port", 65536, r"\.status_port: .*less than or equal to 65535"),
        ("aux", [[1, 2]], r"\.aux\[0\]\[2\]: field required"),
        ("aux", [[1, 2, 3]] * 65, r"\.aux: .*at most 64 items"),
        ("role", "router", r"\.role: .*'producer' or 'consumer'"),
        ("extra", 1, r"Handshake\.extra: unknown field"),
    ],
)
def test_decode_refuses_bad_handshakes(key, value, match):
    with pytest.raises(WireError, match=match):
        decode(_frame({**_handshake_body(), key: value}, code=1))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(runs_per_page=5), r"regions\[0\]: .*runs_per_page 5 must divide"),
        (dict(dtype="int7"), r"regions\[0\]: .*dtype 'int7' is not one of"),
        (dict(kind="nope"), r"regions\[0\]\.kind: input should be 'target_k'"),
        (dict(layer=1 << 16), r"regions\[0\]\.layer: .*less than or equal to 65535"),
        (dict(replicated=1), r"regions\[0\]\.replicated: .*valid boolean"),
        (dict(head_dim=True), r"regions\[0\]\.head_dim: .*valid integer"),
        (dict(dtype=None), r"regions\[0\]\.dtype: .*valid string"),
        (dict(extra=1), r"regions\[0\]\.extra: unknown field"),
    ],
)
def test_decode_refuses_bad_regions(change, match):
    good = _handshake_body()
    region = {**good["regions"][0], **change}
    bad = {**good, "regions": [region], "region_addrs": [], "region_devices": []}
    with pytest.raises(WireError, match=match):
        decode(_frame(bad, code=1))


def test_decode_refuses_a_region_missing_a_field_and_too_many_regions():
    good = _handshake_body()
    short = {k: v for k, v in good["regions"][0].items() if k != "tokens_per_page"}
    with pytest.raises(WireError, match=r"regions\[0\]\.tokens_per_page: field required"):
        decode(_frame({**good, "regions": [short], "region_addrs": [], "region_devices": []}, 1))
    many = good["regions"][:1] * (wire.MAX_REGIONS + 1)
    with pytest.raises(WireError, match=r"Handshake\.regions: .*at most 8192 items"):
        decode(_frame({**good, "regions": many, "region_addrs": [], "region_devices": []}, 1))


def _random_json(rng: random.Random, depth: int = 0):
    choices = [
        lambda: rng.randint(-(2**70), 2**70),
        lambda: rng.choice([0, 1, -1, 2**31, 2**63, 2**64]),
        lambda: rng.random(),
        lambda: rng.choice([True, False, None]),
        lambda: "".join(chr(rng.randint(0, 0x2FF)) for _ in range(rng.randint(0, 12))),
        lambda: rng.choice(["producer", "done", "failed", "target_k", "bfloat16", "AAAA"]),
    ]
    if depth < 3:
        choices += [
            lambda: [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))],
            lambda: {rng.choice(["room", "kind", "x"]): _random_json(rng, depth + 1)},
        ]
    return rng.choice(choices)()


def _mutate_obj(rng: random.Random, obj):
    """Replace, drop or add one field somewhere in a valid message's JSON."""
    if isinstance(obj, dict) and obj:
        key = rng.choice(list(obj))
        roll = rng.random()
        if roll < 0.15:
            return {k: v for k, v in obj.items() if k != key}
        if roll < 0.25:
            return {**obj, "extra": _random_json(rng)}
        if roll < 0.6 and isinstance(obj[key], dict | list):
            return {**obj, key: _mutate_obj(rng, obj[key])}
        return {**obj, key: _random_json(rng)}
    if isinstance(obj, list) and obj:
        i = rng.randrange(len(obj))
        return obj[:i] + [_mutate_obj(rng, obj[i])] + obj[i + 1 :]
    return _random_json(rng)


def _mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    roll = rng.random()
    if roll < 0.3:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif roll < 0.5:
        b = b[: rng.randrange(len(b))]
    elif roll < 0.7:
        i = rng.randrange(len(b) + 1)
        b[i:i] = rng.randbytes(rng.randint(1, 8))
    elif roll < 0.85:  # a header that stays consistent with a mangled body
        body = b[wire.HEADER.size :]
        i = rng.randrange(len(body) + 1)
        body[i : i + rng.randint(0, 3)] = rng.randbytes(rng.randint(0, 3))
        b = bytearray(wire.HEADER.pack(wire.MAGIC, wire.VERSION, b[5], 0, len(body))) + body
    else:
        struct.pack_into("!B", b, rng.choice([4, 5]), rng.randrange(256))
    return bytes(b)


def test_fuzz_decode_returns_a_message_or_raises_wire_error():
    rng = random.Random(1234)
    good = [encode(m) for m in _messages()]
    frames = [rng.randbytes(rng.randint(0, 64)) for _ in range(150)]
    frames += [_mutate_bytes(rng, rng.choice(good)) for _ in range(300)]
    for _ in range(300):
        frame = rng.choice(good)
        obj = json.loads(frame[wire.HEADER.size :])
        frames.append(_frame(_mutate_obj(rng, obj), code=frame[5]))
    accepted = 0
    for frame in frames:
        try:
            msg = decode(frame)
        except WireError:
            continue
        accepted += 1
        assert isinstance(msg, Handshake | TransferRequest | TransferStatus)
        assert decode(encode(msg)) == msg
    assert len(frames) >= 750 and 0 < accepted < len(frames)
