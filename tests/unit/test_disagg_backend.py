"""The atom transfer backend's SGLang wiring: the three hooks, pool descriptions, peer checks."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from sgl_atom import pool_state
from sgl_atom.disagg import wire
from sgl_atom.disagg.plan import HandshakeError
from sgl_atom.disagg.pool_regions import describe_pool
from sgl_atom.disagg.regions import RegionError, RegionKind
from sgl_atom.patches import disagg_backend_enum, disagg_kv_class, disagg_pool_registry


class _Pool(SimpleNamespace):
    """A stand-in for SGLang's MHA token pool (weak-referenceable, like the real one)."""


def _pool(layers=4, slots=33, heads=2, head_dim=64, dtype=torch.float16, start=0, page=1):
    def buf() -> torch.Tensor:
        return torch.full((slots, heads, head_dim), float("nan")).to(dtype)

    return _Pool(
        k_buffer=[buf() for _ in range(layers)],
        v_buffer=[buf() for _ in range(layers)],
        dtype=dtype,
        store_dtype=dtype,
        page_size=page,
        start_layer=start,
        layer_num=layers,
    )


def _draft(dtype: str, layers=2, slots=33, heads=2, head_dim=64):
    from sgl_atom.speculative.dspark.pool import DraftKVPool

    return DraftKVPool(
        slots=slots, layers=layers, kv_heads=heads, head_dim=head_dim, dtype=dtype, device="cpu"
    )


def _consumer(
    pool, *, tp_rank=0, tp_size=1, total=2, aux=((0, 64, 8),), draft=None
) -> wire.Handshake:
    export = describe_pool(
        pool, tp_rank=tp_rank, tp_size=tp_size, total_kv_heads=total, draft_pool=draft
    )
    spans = export.spans()
    return wire.Handshake(
        role="consumer",
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        stage_layers=export.stage_layers,
        regions=export.regions,
        region_addrs=tuple(a for a, _ in spans),
        agent_name="d0",
        agent_metadata=b"meta",
        region_bytes=tuple(n for _, n in spans),
        aux=aux,
        status_host="127.0.0.1",
        status_port=4321,
    )


# ---------------------------------------------------------------- the hooks


def test_enum_hook_answers_declared_values_only():
    from sglang.srt.disaggregation.utils import TransferBackend

    member = disagg_backend_enum.add_backend("atom")
    assert disagg_backend_enum.add_backend("atom") is member
    assert isinstance(member, TransferBackend) and member.value == "atom"
    assert member != TransferBackend.NIXL

    def original(value):
        raise ValueError(f"{value!r} is not a valid TransferBackend")

    assert disagg_backend_enum.missing_with_sgl_atom_backends(original, "atom") is member
    with pytest.raises(ValueError, match="'nope' is not a valid"):
        disagg_backend_enum.missing_with_sgl_atom_backends(original, "nope")


def test_kv_class_hook_answers_atom_and_passes_the_rest():
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend

    from sgl_atom.disagg import backend

    calls = []

    def original(tb, kind):
        calls.append((tb, kind))
        return "upstream"

    backend.register()  # declares the classes (hooks are applied by SGLang, not here)
    atom = disagg_backend_enum.add_backend("atom")
    hook = disagg_kv_class.kv_class_with_sgl_atom_backends
    from sgl_atom.disagg import conn

    assert hook(original, atom, KVClassType.MANAGER) is conn.AtomKVManager
    assert hook(original, atom, KVClassType.RECEIVER) is conn.AtomKVReceiver
    assert hook(original, atom, KVClassType.BOOTSTRAP_SERVER) is conn.AtomKVBootstrapServer
    assert hook(original, atom, KVClassType.KVARGS) == "upstream"
    assert hook(original, TransferBackend.NIXL, KVClassType.SENDER) == "upstream"
    assert calls == [(atom, KVClassType.KVARGS), (TransferBackend.NIXL, KVClassType.SENDER)]


def test_pool_registry_records_the_pool_and_returns_nothing_new():
    pool = _pool()
    result = ([pool.k_buffer[0].data_ptr(), 7], [1, 1], [1, 1])
    assert disagg_pool_registry.record_pool(result, pool) is None
    assert pool_state.pool_with_transfer_buffer(pool.k_buffer[0].data_ptr()) is pool
    assert pool_state.pool_with_transfer_buffer(12345) is None


# ---------------------------------------------------------------- pool descriptions


def test_describe_pool_names_k_v_per_global_layer():
    pool = _pool(layers=2, start=2)
    export = describe_pool(pool, tp_rank=0, tp_size=1, total_kv_heads=2)
    kinds = [(r.kind, r.global_layer) for r in export.regions]
    assert kinds == [
        (RegionKind.TARGET_K, 2),
        (RegionKind.TARGET_V, 2),
        (RegionKind.TARGET_K, 3),
        (RegionKind.TARGET_V, 3),
    ]
    assert export.stage_layers == (2, 4)
    assert export.tensors[1] is pool.v_buffer[0]
    r = export.regions[0]
    assert (r.dtype, r.head_dim, r.heads_per_rank, r.total_heads) == ("float16", 64, 2, 2)
    assert r.runs_per_page is None and r.unit_bytes == 128
    assert export.spans()[0] == (pool.k_buffer[0].data_ptr(), 33 * 2 * 64 * 2)


def test_describe_pool_adds_fp8_scales_hung_off_the_pool():
    pool = _pool(layers=2, heads=1, dtype=torch.float8_e4m3fn)
    pool_state.state_of(pool).kv_scales = SimpleNamespace(
        k=[torch.ones(33, 1) for _ in range(2)], v=[torch.ones(33, 1) for _ in range(2)]
    )
    export = describe_pool(pool, tp_rank=1, tp_size=2, total_kv_heads=2)
    assert [r.kind for r in export.regions[:4]] == [
        RegionKind.TARGET_K,
        RegionKind.TARGET_V,
        RegionKind.K_SCALE,
        RegionKind.V_SCALE,
    ]
    assert export.tensors[2] is pool_state.peek(pool).kv_scales.k[0]
    assert export.regions[2].dtype == "float32" and export.regions[0].dtype == "float8_e4m3fn"


@pytest.mark.parametrize(
    "pool, kw, match",
    [
        (_pool(heads=2), dict(tp_rank=0, tp_size=2, total_kv_heads=2), "expected contiguous"),
        (_Pool(page_size=1), dict(tp_rank=0, tp_size=1, total_kv_heads=2), "this pool has none"),
        (
            _pool(),
            dict(tp_rank=0, tp_size=1, total_kv_heads=2, draft_pool=object()),
            "draft pool object: expected one K and one V buffer per draft layer",
        ),
    ],
    ids=["heads-per-rank", "not-mha", "not-a-draft-pool"],
)
def test_describe_pool_refuses_what_it_cannot_move(pool, kw, match):
    with pytest.raises(RegionError, match=match):
        describe_pool(pool, **kw)


def test_describe_pool_appends_an_fp8_draft_pool_with_its_scales():
    pool, draft = _pool(layers=2, page=4, slots=36), _draft("fp8", slots=36)
    export = describe_pool(pool, tp_rank=0, tp_size=1, total_kv_heads=2, draft_pool=draft)
    assert len(export.regions) == len(export.tensors) == 4 + 2 * 4
    tail = [(r.kind, r.global_layer, r.dtype) for r in export.regions[4:8]]
    assert tail == [
        (RegionKind.DRAFT_K, 0, "float8_e4m3fn"),
        (RegionKind.DRAFT_V, 0, "float8_e4m3fn"),
        (RegionKind.DRAFT_K_SCALE, 0, "float32"),
        (RegionKind.DRAFT_V_SCALE, 0, "float32"),
    ]
    assert export.tensors[4] is draft.k[0] and export.tensors[7] is draft.v_scale[0]
    assert export.tensors[11] is draft.v_scale[1]
    r = export.regions[4]
    assert (r.head_dim, r.heads_per_rank, r.total_heads, r.tokens_per_page) == (64, 2, 2, 4)
    assert export.regions[6].unit_bytes == 4
    assert export.stage_layers == (0, 2)


def test_describe_pool_appends_a_bf16_draft_pool_without_scales():
    draft = _draft("bf16")
    export = describe_pool(_pool(), tp_rank=0, tp_size=1, total_kv_heads=2, draft_pool=draft)
    kinds = [r.kind for r in export.regions[8:]]
    assert kinds == [RegionKind.DRAFT_K, RegionKind.DRAFT_V] * 2
    assert {r.dtype for r in export.regions[8:]} == {"bfloat16"}


def test_pool_state_hands_the_draft_pool_to_the_backend():
    """The worker records its draft pool with the target's pool; the backend, handed the target
    pool's transfer buffers, finds both (and another pool has no draft)."""
    target, other, draft = _pool(), _pool(), _draft("bf16")
    pool_state.state_of(target).draft_pool = draft
    disagg_pool_registry.record_pool(([target.k_buffer[0].data_ptr()], [1], [1]), target)
    found = pool_state.pool_with_transfer_buffer(target.k_buffer[0].data_ptr())
    assert found is target and pool_state.peek(found).draft_pool is draft
    assert pool_state.peek(other).draft_pool is None and "_sgl_atom_state" not in other.__dict__


# ---------------------------------------------------------------- peer checks


def _producer(pool, tp_rank=0, tp_size=1, total=2):
    return describe_pool(pool, tp_rank=tp_rank, tp_size=tp_size, total_kv_heads=total)


def test_plan_for_peer_accepts_a_matching_decode_and_splits_heads():
    from sgl_atom.disagg.conn import plan_for_peer

    plan = plan_for_peer(_producer(_pool()), 0, 1, True, [(0, 64, 8)], _consumer(_pool()))
    assert len(plan.pairs) == 8 and {p.mode for p in plan.pairs} == {"whole"}
    hs = _consumer(_pool(heads=1), tp_rank=1, tp_size=2)
    plan = plan_for_peer(_producer(_pool()), 0, 1, True, [(0, 64, 8)], hs)
    assert {(p.mode, p.src_head_start, p.num_heads) for p in plan.pairs} == {("split", 1, 1)}


def test_plan_for_peer_refuses_another_layout_naming_region_and_values():
    from sgl_atom.disagg.conn import plan_for_peer

    other = _consumer(_pool(layers=2, head_dim=32))
    with pytest.raises(HandshakeError) as e:
        plan_for_peer(_producer(_pool()), 0, 1, True, [(0, 64, 8)], other)
    text = str(e.value)
    assert "nothing was written" in text
    assert "target_k layer 0: head_dim producer 64, consumer 32" in text
    assert "target_k layer 2: producer exports it, consumer has no such region" in text


def test_plan_for_peer_refuses_other_metadata_rows():
    from sgl_atom.disagg.conn import AtomTransferError, plan_for_peer

    hs = _consumer(_pool(), aux=((0, 64, 16),))
    with pytest.raises(AtomTransferError, match="metadata buffer 0: bytes per request"):
        plan_for_peer(_producer(_pool()), 0, 1, True, [(0, 64, 8)], hs)
    # a stage that does not hold the last layers sends no metadata, so it does not compare it
    plan_for_peer(_producer(_pool()), 0, 1, False, [(0, 64, 8)], hs)


def test_plan_for_peer_moves_a_matching_draft_pool_with_the_target():
    from sgl_atom.disagg.conn import plan_for_peer

    producer = describe_pool(
        _pool(), tp_rank=0, tp_size=1, total_kv_heads=2, draft_pool=_draft("fp8")
    )
    hs = _consumer(_pool(), draft=_draft("fp8"))
    plan = plan_for_peer(producer, 0, 1, True, [(0, 64, 8)], hs)
    assert len(plan.pairs) == 8 + 8
    draft_pairs = [p for p in plan.pairs if p.name.startswith("draft_")]
    assert [p.consumer_index for p in draft_pairs] == list(range(8, 16))
    # the draft is whole on every rank: replicated units, each page one copy
    assert {(p.mode, p.whole_pages) for p in draft_pairs} == {("replicated", True)}


def test_plan_for_peer_refuses_a_draft_dtype_mismatch_naming_region_and_values():
    from sgl_atom.disagg.conn import plan_for_peer

    producer = describe_pool(
        _pool(), tp_rank=0, tp_size=1, total_kv_heads=2, draft_pool=_draft("fp8")
    )
    for consumer_draft in (_draft("bf16"), None):
        hs = _consumer(_pool(), draft=consumer_draft)
        with pytest.raises(HandshakeError) as e:
            plan_for_peer(producer, 0, 1, True, [(0, 64, 8)], hs)
        text = str(e.value)
        assert "nothing was written" in text
        if consumer_draft is not None:
            assert "draft_k draft layer 0: dtype producer float8_e4m3fn, consumer bfloat16" in text
        else:
            assert "draft_k draft layer 0: producer's draft region" in text, text


def test_handshake_with_backend_fields_round_trips():
    hs = _consumer(_pool(layers=1))
    assert wire.decode(wire.encode(hs)) == hs
    req = wire.TransferRequest(5, 0, (1, 2, 3), 0, 2, aux_index=4, agent_name="d0", peers=2)
    assert wire.decode(wire.encode(req)) == req
    with pytest.raises(wire.WireError, match="region_bytes for"):
        wire.encode(wire.Handshake(**{**hs.__dict__, "region_bytes": (1,)}))


def test_dspark_decode_first_step_input_is_what_an_extend_returns(monkeypatch):
    """A P/D decode server's prebuilt batch gets the worker's after-extend verify input."""
    import sglang.srt.runtime_context as rc

    from sgl_atom.speculative.dspark.algorithm import AtomDSparkAlgo

    monkeypatch.setattr(rc, "get_spec", lambda: SimpleNamespace(speculative_num_draft_tokens=5))
    batch = SimpleNamespace(
        reqs=[object(), object()],
        seq_lens=torch.tensor([7, 9]),
        req_pool_indices=torch.tensor([3, 1]),
        enable_overlap=False,
    )
    algo = AtomDSparkAlgo.__new__(AtomDSparkAlgo)
    info = algo.build_disagg_draft_input(batch, torch.tensor([11, 22]), future_map=None)
    assert info.draft_token_num == 5 and info.future_indices is None
    assert info.accept_tokens.tolist() == [11, 0, 0, 0, 0, 22, 0, 0, 0, 0]
    assert info.accept_lens.tolist() == [1, 1] and info.new_seq_lens is batch.seq_lens


def test_peer_kinds_mark_the_consumer_regions_that_are_gpu_memory():
    from dataclasses import replace

    from sgl_atom.disagg.conn import peer_kinds

    hs = _consumer(_pool())
    assert peer_kinds(hs) == {}  # a CPU pool: every region host memory (NIXL DRAM)
    devices = tuple((i % 3) - 1 for i in range(len(hs.regions)))  # host, cuda:0, cuda:1, ...
    kinds = peer_kinds(replace(hs, region_devices=devices))
    want = {a: ("VRAM", d) for a, d in zip(hs.region_addrs, devices, strict=True) if d >= 0}
    assert kinds == want and len(kinds) == sum(d >= 0 for d in devices) > 0


def _producer_manager():
    """The producer side of AtomKVManager without its sockets and NIXL agent."""
    from sgl_atom.disagg.conn import AtomKVManager

    mgr = object.__new__(AtomKVManager)
    mgr.export = describe_pool(_pool(), tp_rank=0, tp_size=1, total_kv_heads=2)
    mgr.attn_tp_rank, mgr.attn_tp_size, mgr.pp_rank, mgr.pp_size = 0, 1, 0, 1
    mgr.is_last_stage, mgr.aux = True, [(0, 64, 8)]
    mgr.peers, mgr.refused, mgr.refused_targets = {}, {}, {}
    added = []
    mgr.engine = SimpleNamespace(add_peer=lambda name, *a: added.append(name))
    return mgr, added


def test_agent_name_is_bound_to_its_first_handshake():
    """A forged handshake reusing an accepted decode's agent name (printed in its log) changes
    nothing: the real decode stays accepted and its failure notices keep their endpoint."""
    mgr, added = _producer_manager()
    real = _consumer(_pool())
    mgr._on_handshake(real)
    assert "d0" in mgr.peers and added == ["d0"]
    forged = _consumer(_pool(layers=1))  # a layout that would be refused
    forged = wire.Handshake(**{**forged.__dict__, "status_port": 9999})
    mgr._on_handshake(forged)
    assert mgr.peers["d0"].hs == real and "d0" not in mgr.refused and added == ["d0"]
    mgr._on_handshake(real)  # the same decode registering again: a no-op
    assert mgr.peers["d0"].hs == real and added == ["d0"]


def test_refused_agent_keeps_its_first_endpoint():
    mgr, added = _producer_manager()
    bad = _consumer(_pool(layers=1))
    mgr._on_handshake(bad)
    assert "d0" in mgr.refused and mgr.refused_targets["d0"] == ("127.0.0.1", 4321)
    mgr._on_handshake(wire.Handshake(**{**_consumer(_pool()).__dict__, "status_port": 9999}))
    assert "d0" not in mgr.peers and mgr.refused_targets["d0"] == ("127.0.0.1", 4321)
    assert added == []


def test_refusal_of_a_huge_handshake_is_summarised():
    err = HandshakeError([f"region {i}: dtype mismatch" for i in range(8192)])
    text = str(err)
    assert len(text.splitlines()) == HandshakeError.SHOWN + 2
    assert "(8192)" in text and f"and {8192 - HandshakeError.SHOWN} more" in text
    assert len(err.problems) == 8192  # every problem stays available to callers


def test_control_socket_drops_frames_over_the_wire_limit():
    """An oversized frame disconnects its sender on arrival; later frames still arrive."""
    import zmq

    from sgl_atom.disagg.conn import limit_inbound_frames

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    limit_inbound_frames(pull)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    big, small = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
    try:
        big.connect(f"tcp://127.0.0.1:{port}")
        big.send_multipart([b"ATOM", b"x" * (wire.MAX_INBOUND_FRAME + 1)])
        small.connect(f"tcp://127.0.0.1:{port}")
        small.send_multipart([b"ATOM", b"ok"])
        assert pull.poll(5000), "the small frame never arrived"
        assert pull.recv_multipart() == [b"ATOM", b"ok"]
        assert not pull.poll(500), "the oversized frame was delivered"
    finally:
        for s in (big, small, pull):
            s.close(linger=0)
        ctx.term()


def test_transfer_stats_sum_the_writes_of_every_chunk():
    from sgl_atom.disagg.conn import TransferStats
    from sgl_atom.disagg.ipc import IpcWrite

    rng = random.Random()
    stats, total, descs, secs, writes, posting, copies = TransferStats(), 0, 0, 0.0, 0, 0.0, 0
    for _ in range(rng.randint(1, 5)):  # chunks
        handles = [
            SimpleNamespace(nbytes=rng.randint(1, 1 << 30), spans=rng.randint(1, 64))
            for _ in range(rng.randint(0, 4))
        ] + [
            IpcWrite("d", rng.randint(1, 64), rng.randint(1, 1 << 30), None, "DONE")
            for _ in range(rng.randint(0, 2))
        ]
        dt = rng.uniform(1e-4, 0.1)
        post = rng.uniform(0, dt)
        stats.add(handles, dt, post)
        total += sum(h.nbytes for h in handles)
        descs += sum(h.spans for h in handles)
        ipc = sum(isinstance(h, IpcWrite) for h in handles)
        secs, writes, posting = secs + dt, writes + len(handles) - ipc, posting + post
        copies += ipc
    line = stats.describe(2)
    assert (stats.nbytes, stats.descriptors, stats.writes, stats.ipc) == (
        total,
        descs,
        writes,
        copies,
    )
    assert stats.seconds == pytest.approx(secs) and stats.posting == pytest.approx(posting)
    assert line.startswith(f"{total} KV bytes in {descs} descriptors to 2 decode rank(s), ")
    assert f"({total / secs / 1e9:.3g} GB/s; {writes} NIXL writes, " in line
    assert line.endswith(f", {posting * 1e3:.2f} ms posting; {copies} CUDA IPC copies)")
    ((back, ranks),) = TransferStats.logged(f"atom P/D: room 7: {line}").values()
    assert ranks == 2 and (back.nbytes, back.writes, back.ipc) == (total, writes, copies)


def test_ipc_peer_is_refused_when_its_shares_disagree_with_its_regions():
    """A handshake whose shared buffers do not match its regions is refused before any mapping
    (the producer then writes through NIXL); one without shares, or without a UUID this
    process sees, maps nothing."""
    from sgl_atom.disagg import ipc
    from sgl_atom.disagg.wire import CudaIpcRegion, Handshake

    share = CudaIpcRegion(0, b"h" * 64, 1 << 20, 0, 0, 4096, b"/rc", 0, b"", False)
    base = dict(role="consumer", tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, stage_layers=(0, 2),
                regions=(), region_addrs=(), agent_name="d0", agent_metadata=b"")  # fmt: skip
    assert ipc.open_peer(Handshake(**base)) is None
    hs = Handshake(**base, region_bytes=(), device_uuid="GPU-x", ipc_regions=(share,))
    with pytest.raises(ipc.IpcError, match="1 shared buffers and 0 sizes for 0 regions"):
        ipc.open_peer(hs)
    with pytest.raises(ipc.IpcError, match="overruns its storage"):
        ipc.open_region(CudaIpcRegion(0, b"h", 100, 0, 64, 64, b"", 0, b"", False), 0)


def test_prefill_maps_shared_pools_only_where_it_can_and_closes_silent_ones():
    """A decode that shares its pool through CUDA IPC: shares that disagree with its regions
    leave it on NIXL (the handshake is still accepted); a GPU this process does not have leaves
    it on NIXL; a mapped decode silent past the heartbeat timeout has its mappings closed."""
    from dataclasses import replace

    from sgl_atom.disagg.heartbeat import RoomClaims
    from sgl_atom.disagg.ipc import IpcWriter

    mgr, added = _producer_manager()
    mgr.ipc = IpcWriter([torch.zeros(256, dtype=torch.uint8)])
    hs = _consumer(_pool())
    share = wire.CudaIpcRegion(0, b"h" * 64, 1 << 20, 0, 0, 64, b"/rc", 0, b"", False)
    assert mgr._map_peer(hs) == "NIXL"  # shares nothing
    wrong = replace(hs, device_uuid="GPU-0", ipc_regions=(share,))  # 1 share for 8 regions
    assert mgr._map_peer(wrong) == "NIXL" and not mgr.ipc.has("d0")
    shares = tuple(replace(share, nbytes=n) for n in hs.region_bytes)
    elsewhere = replace(hs, device_uuid="GPU-elsewhere", ipc_regions=shares)
    assert mgr._map_peer(elsewhere).startswith("NIXL (its GPU is not")
    mgr._on_handshake(elsewhere)
    assert "d0" in mgr.peers and added == ["d0"]
    # a decode mapped earlier, then silent
    mgr.ipc.add("d0", [torch.zeros(64, dtype=torch.uint8)])
    mgr.request_status, mgr.room_claims = {}, RoomClaims(timeout_s=2.0)
    mgr.room_claims.heard("d0", (), now=0.0)
    mgr._sweep_orphans(1.5)
    assert mgr.ipc.has("d0")
    mgr._sweep_orphans(2.5)
    assert not mgr.ipc.has("d0") and "d0" in mgr.peers  # its KV goes through NIXL from now on
