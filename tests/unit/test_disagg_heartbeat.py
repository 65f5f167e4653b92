"""The atom P/D session heartbeat: the clock of prefill ranks, its wire message, both ends."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sgl_atom.disagg import wire
from sgl_atom.disagg.heartbeat import MissingRooms, PeerClock, RoomClaims, dialled_endpoints


def test_clock_gives_a_new_rank_a_full_timeout_and_loses_a_silent_one():
    clock = PeerClock(timeout_s=4.0)
    clock.track({"10.0.0.1:5000": "10.0.0.1:8998"}, now=100.0)
    assert clock.overdue(now=103.9) == {}
    clock.heard("10.0.0.1:5000", now=103.0)
    assert clock.overdue(now=106.9) == {}
    assert clock.overdue(now=107.5) == {"10.0.0.1:5000": ("10.0.0.1:8998", 4.5)}
    assert clock.overdue(now=200.0) == {}  # reported once, then no longer watched


def test_clock_watches_what_is_dialled_and_ignores_strangers():
    clock = PeerClock(timeout_s=2.0)
    clock.track({"a:1": "a:9", "b:1": "b:9"}, now=0.0)
    clock.track({"b:1": "b:9"}, now=1.0)  # a's connection was dropped: forgotten
    clock.heard("c:1", now=1.5)  # never dialled: ignored
    assert clock.overdue(now=10.0) == {"b:1": ("b:9", 10.0)}
    clock.track({"b:1": "b:9"}, now=10.0)  # dialled again (a new bootstrap): a fresh timeout
    assert clock.overdue(now=11.0) == {}


def test_dialled_endpoints_read_sglang_connection_pool():
    pool = {
        "127.0.0.1:8998_0_0_0": [
            {"rank_ip": "127.0.0.1", "rank_port": 5001},
            {"rank_ip": "127.0.0.1", "rank_port": "5002"},
        ],
        "[::1]:8999_0_0_1": [{"rank_ip": "::1", "rank_port": 6001}],
        "10.0.0.2:8998_0_0_0": None,
    }
    assert dialled_endpoints(pool) == {
        "127.0.0.1:5001": "127.0.0.1:8998",
        "127.0.0.1:5002": "127.0.0.1:8998",
        "::1:6001": "[::1]:8999",
    }


@pytest.mark.parametrize("reply", [False, True])
def test_heartbeat_round_trips_and_is_checked(reply):
    hb = wire.Heartbeat("atom-d0.0-x", "127.0.0.1:5001", reply=reply)
    assert wire.decode(wire.encode(hb)) == hb
    with pytest.raises(wire.WireError, match="agent_name"):
        wire.encode(wire.Heartbeat("x" * (wire.MAX_NAME + 1), "h:1"))


def test_room_claims_fail_rooms_no_live_decode_holds():
    claims = RoomClaims(timeout_s=4.0)
    assert claims.orphans({1, 2}, now=100.0) == {}  # no decode has sent a heartbeat: never
    claims.heard("d0", (1, 3), now=0.0)
    assert claims.orphans({1, 2}, now=1.0) == {}
    claims.heard("d0", (1,), now=4.0)
    assert claims.orphans({1, 2}, now=5.0) == {}  # 2 never held: it gets twice the timeout
    late = claims.orphans({1, 2}, now=9.5)  # d0 silent since 4.0; 2 unheld since 1.0
    assert set(late) == {1, 2}
    assert "stopped answering heartbeats 5.5s ago" in late[1] and "in 8.5s" in late[2]
    assert claims.orphans({1, 2}, now=9.6) == {}  # each room is failed once


def test_room_claims_keep_held_rooms_and_forget_finished_ones():
    claims = RoomClaims(timeout_s=2.0)
    for t in range(10):
        claims.heard("d0", (7,), now=float(t))
        assert claims.orphans({7, 8} if t < 3 else {7}, now=t + 0.5) == {}
    claims.heard("d1", (), now=10.0)  # another decode; d0 goes silent
    assert set(claims.orphans({7}, now=12.0)) == {7}


def test_room_claims_name_silent_decodes():
    claims = RoomClaims(timeout_s=2.0)
    claims.heard("d0", (), now=0.0)
    claims.heard("d1", (3,), now=1.5)
    assert claims.silent(["d0", "d1", "never"], now=1.9) == []
    # d0 silent past the timeout; a decode never heard from is not named (no heartbeats at all)
    assert claims.silent(["d0", "d1", "never"], now=2.5) == ["d0"]
    claims.heard("d0", (), now=3.0)
    assert claims.silent(["d0", "d1"], now=4.0) == ["d1"]


def test_missing_rooms_fail_once_after_twice_the_timeout():
    missing = MissingRooms(timeout_s=2.0)
    assert missing.report("p:1", (5, 6), now=0.0) == {}
    assert missing.report("p:1", (5,), now=3.0) == {}  # 6 reached the prefill meanwhile
    assert missing.report("p:1", (5, 6), now=4.5) == {5: 4.5}
    assert missing.report("p:1", (5, 6), now=9.0) == {6: 4.5}  # 6 missing again since 4.5
    assert missing.report("p:2", (5,), now=9.0) == {}  # another rank: its own clock


def _manager(role: str):
    """AtomKVManager without sockets: pushes and node failures are recorded."""
    from sgl_atom.disagg.conn import AtomKVManager

    mgr = object.__new__(AtomKVManager)
    mgr.pushed, mgr.failed = [], []
    mgr._push_now = lambda host, port, parts, own: mgr.pushed.append((f"{host}:{port}", parts))
    mgr._handle_node_failure = mgr.failed.append
    if role == "producer":
        mgr.peers, mgr.refused_targets = {}, {}
    return mgr


def test_producer_answers_known_agents_at_their_handshake_endpoint():
    mgr = _manager("producer")
    mgr.room_claims = RoomClaims(timeout_s=4.0)
    mgr.peers["d0"] = SimpleNamespace(target=("127.0.0.1", 4321))
    mgr.refused_targets["d1"] = ("127.0.0.1", 4322)
    for agent in ("d0", "d1", "forger"):
        mgr._on_control(wire.Heartbeat(agent, "127.0.0.1:5001", rooms=(5,)))
    mgr._on_control(wire.Heartbeat("d0", "127.0.0.1:5001", reply=True))  # not a probe
    assert [ep for ep, _ in mgr.pushed] == ["127.0.0.1:4321", "127.0.0.1:4322"]
    _, (tag, frame) = mgr.pushed[0]
    assert tag == b"ATOM" and wire.decode(frame) == wire.Heartbeat("d0", "127.0.0.1:5001", True)
    assert set(mgr.room_claims._claims) == {"d0", "d1"}  # the forger's claim is not noted
    mgr.sender_rooms = {5}
    mgr._on_control(wire.Heartbeat("d0", "127.0.0.1:5001", rooms=(5, 9)))
    assert wire.decode(mgr.pushed[-1][1][1]).rooms == (9,)  # no request here for room 9


@pytest.fixture(params=["dict", "pp_stage"])
def request_status(request):
    """An empty ``request_status`` as SGLang gives a prefill: a dict, or on a PP stage a
    ``PPConsensusStore`` (item access, no iteration)."""
    if request.param == "dict":
        yield {}
        return
    from sglang.srt.disaggregation.pp_consensus_store import PPConsensusStore

    store = PPConsensusStore(1, 0, SimpleNamespace(broadcast_object=lambda obj, src: obj))
    yield store
    store.close()


def test_producer_fails_every_room_held_for_a_decode_that_went_silent(request_status):
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = _manager("producer")
    mgr.attn_tp_rank, mgr.attn_tp_size = 0, 1
    mgr.room_claims = RoomClaims(timeout_s=2.0)
    mgr.request_status = request_status
    for room, status in {
        11: KVPoll.Bootstrapping,
        12: KVPoll.WaitingForInput,  # the decode sent its pages; the prefill computes its KV
        13: KVPoll.Transferring,  # its KV is being written
        14: KVPoll.Success,
    }.items():
        request_status[room] = status
    failures = {}
    mgr.record_failure = failures.__setitem__
    mgr.update_status = lambda room, st: mgr.request_status.__setitem__(room, st)
    mgr.room_claims.heard("d0", (11, 12, 13, 14), now=0.0)
    mgr.room_claims.heard("d1", (15,), now=0.0)
    mgr._sweep_orphans(1.0)
    assert failures == {}
    mgr.room_claims.heard("d1", (15,), now=2.5)  # d1 alive; room 15 is not this rank's
    mgr._sweep_orphans(3.0)  # d0 silent for 3 s: every room still held for it fails
    assert sorted(failures) == [11, 12, 13]
    assert all(mgr.request_status[r] == KVPoll.Failed for r in (11, 12, 13))
    assert mgr.request_status[14] == KVPoll.Success
    assert "held for its decode: its decode stopped answering" in failures[13]


def test_consumer_loses_a_silent_prefill_and_keeps_one_that_answers(monkeypatch):
    import threading

    import sgl_atom.disagg.conn as conn

    mgr = _manager("consumer")
    mgr.peer_clock, mgr.connection_lock = PeerClock(timeout_s=2.0), threading.Lock()
    mgr.missing_rooms = MissingRooms(timeout_s=2.0)
    mgr.engine = SimpleNamespace(name="d0")
    mgr.connection_pool = {
        "127.0.0.1:8998_0_0_0": [{"rank_ip": "127.0.0.1", "rank_port": 5001}],
        "127.0.0.1:8999_0_0_0": [{"rank_ip": "127.0.0.1", "rank_port": 6001}],
    }
    mgr.addr_to_rooms_tracker = {"127.0.0.1:8998": {41, 42}}
    now = [0.0]
    monkeypatch.setattr(conn.time, "monotonic", lambda: now[0])
    mgr._beat(0.0)
    probes = {ep: wire.decode(parts[1]) for ep, parts in mgr.pushed}
    assert sorted(probes) == ["127.0.0.1:5001", "127.0.0.1:6001"] and mgr.failed == []
    assert sorted(probes["127.0.0.1:5001"].rooms) == [41, 42] and not probes["127.0.0.1:6001"].rooms
    now[0] = 1.5
    mgr._on_heartbeat_answer(wire.encode(wire.Heartbeat("d0", "127.0.0.1:6001", reply=True)))
    mgr._on_heartbeat_answer(b"garbage")  # dropped, logged
    mgr._beat(2.5)
    assert mgr.failed == ["127.0.0.1:8998"]  # 6001 answered 1 s ago: kept


def test_consumer_fails_a_room_the_prefill_never_received(monkeypatch):
    from sglang.srt.disaggregation.base.conn import KVPoll

    import sgl_atom.disagg.conn as conn

    mgr = _manager("consumer")
    mgr.peer_clock, mgr.missing_rooms = PeerClock(timeout_s=2.0), MissingRooms(timeout_s=2.0)
    mgr.request_status = {41: KVPoll.WaitingForInput, 42: KVPoll.Success}
    failures = {}
    mgr.record_failure = failures.__setitem__
    mgr.update_status = lambda room, st: mgr.request_status.__setitem__(room, st)
    answer = wire.encode(wire.Heartbeat("d0", "127.0.0.1:5001", reply=True, rooms=(41, 42)))
    for t in (0.0, 2.0, 4.5):
        monkeypatch.setattr(conn.time, "monotonic", lambda t=t: t)
        mgr._on_heartbeat_answer(answer)
    assert list(failures) == [41] and mgr.request_status[41] == KVPoll.Failed
    assert "has had no request for room 41 for 4.5s" in failures[41]
