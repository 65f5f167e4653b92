"""Liveness of both ends of an atom P/D transfer session, asked on the session itself.

SGLang's decode heartbeat asks each prefill's bootstrap HTTP server for ``/health``: with its
defaults (5 s, 2 misses) a stopped prefill is noticed after 11-16 s, and the HTTP process
answering says nothing of the scheduler process that moves the KV. Nothing tells a prefill that
its decode died: the prefill's half of a request waits SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT
(300 s) for a decode that will never ask, and SGLang's PD router waits for both halves.

Here each decode rank sends a :class:`~sgl_atom.disagg.wire.Heartbeat` to the control socket of
every prefill rank it shook hands with, each ``SGL_ATOM_PD_HEARTBEAT_INTERVAL_MS``, listing the
bootstrap rooms it holds for that prefill; the prefill rank's control thread, in its scheduler
process, answers on the decode's status socket.

- Decode: a prefill rank silent for ``SGL_ATOM_PD_HEARTBEAT_TIMEOUT_MS`` is lost. SGLang's
  node-failure path fails its bootstrap address's in-flight rooms ("Lost connection with
  prefill instance") and drops the cached connection, so the next request to that prefill
  bootstraps (and shakes hands) again: that is the recovery once it answers.
- Prefill: a room still waiting for its decode (Bootstrapping) that no decode heard within the
  timeout holds any more, or that none has claimed within twice the timeout, fails naming why.
  Only once some decode has sent a heartbeat: a fleet without them keeps SGLang's timeout.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from sgl_atom import envs
from sgl_atom.disagg import wire
from sgl_atom.log import get_logger

logger = get_logger("sgl_atom.disagg")

TAG = b"ATOM"


@dataclass
class _Watch:
    bootstrap_addr: str
    last_heard: float  # when the rank last answered, or when it was first dialled


class PeerClock:
    """When each prefill rank (by control endpoint ``host:port``) last answered, and which
    are overdue. Thread-safe: the heartbeat thread tracks and sweeps, the status thread hears."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._watch: dict[str, _Watch] = {}
        self._lock = threading.Lock()

    def track(self, endpoints: dict[str, str], now: float) -> None:
        """Watch exactly ``endpoints`` (endpoint -> bootstrap address): a new one is given a
        full timeout from now, one no longer dialled is forgotten."""
        with self._lock:
            for ep in set(self._watch) - set(endpoints):
                del self._watch[ep]
            for ep, addr in endpoints.items():
                if ep not in self._watch or self._watch[ep].bootstrap_addr != addr:
                    self._watch[ep] = _Watch(addr, now)

    def heard(self, endpoint: str, now: float) -> None:
        """An answer from ``endpoint``; one from a rank not watched is ignored."""
        with self._lock:
            if endpoint in self._watch:
                self._watch[endpoint].last_heard = now

    def overdue(self, now: float) -> dict[str, tuple[str, float]]:
        """Ranks silent past the timeout, endpoint -> (bootstrap address, seconds silent); they
        stop being watched (``track`` watches them afresh once they are dialled again)."""
        with self._lock:
            late = {
                ep: (w.bootstrap_addr, now - w.last_heard)
                for ep, w in self._watch.items()
                if now - w.last_heard > self.timeout_s
            }
            for ep in late:
                del self._watch[ep]
        return late


class RoomClaims:
    """Prefill side: which waiting rooms some live decode still holds. Thread-safe."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._claims: dict[str, tuple[float, frozenset[int]]] = {}  # agent -> (when, rooms)
        self._held: dict[int, tuple[float, bool]] = {}  # room -> (last claimed or first seen, held)
        self._lock = threading.Lock()

    def heard(self, agent: str, rooms: tuple[int, ...], now: float) -> None:
        with self._lock:
            self._claims[agent] = (now, frozenset(rooms))

    def silent(self, agents: list[str], now: float) -> list[str]:
        """Of ``agents``, those that sent a heartbeat once and none within the timeout."""
        with self._lock:
            return [
                a for a in agents if a in self._claims and now - self._claims[a][0] > self.timeout_s
            ]

    def orphans(self, waiting: set[int], now: float) -> dict[int, str]:
        """Of the rooms ``waiting`` for their decode, those to fail, room -> why: held by no
        decode heard within the timeout after one did hold it, or never held for twice the
        timeout. None before any decode has sent a heartbeat."""
        with self._lock:
            if not self._claims:
                return {}
            live: dict[int, float] = {}  # room -> the latest live claim holding it
            for when, rooms in self._claims.values():
                if now - when <= self.timeout_s:
                    for room in rooms:
                        live[room] = max(when, live.get(room, when))
            for room in set(self._held) - waiting:
                del self._held[room]
            out = {}
            for room in waiting:
                since, held = self._held.get(room, (now, False))
                if room in live:
                    self._held[room] = (live[room], True)
                elif held and now - since > self.timeout_s:
                    out[room] = f"its decode stopped answering heartbeats {now - since:.1f}s ago"
                elif not held and now - since > 2 * self.timeout_s:
                    out[room] = f"no decode has held it in {now - since:.1f}s"
                else:
                    self._held[room] = (since, held)
            for room in out:
                del self._held[room]
        return out


class MissingRooms:
    """Decode side: rooms a prefill rank says it has no request for, by endpoint, since when.

    The router sends a request to both sides at once, so a room is briefly unknown to the
    prefill as a matter of course; one unknown for twice the timeout never reached it (a request
    lost between the router and a prefill resuming from a stop, say) and would wait out
    SGLANG_DISAGGREGATION_WAITING_TIMEOUT."""

    def __init__(self, timeout_s: float):
        self.grace_s = 2 * timeout_s
        self._since: dict[str, dict[int, float]] = {}
        self._lock = threading.Lock()

    def report(self, endpoint: str, rooms: tuple[int, ...], now: float) -> dict[int, float]:
        """The rank's latest list; returns its rooms missing past the grace, room -> seconds
        (each once)."""
        with self._lock:
            old = self._since.get(endpoint, {})
            since = {room: old.get(room, now) for room in rooms}
            late = {room: now - t for room, t in since.items() if now - t > self.grace_s}
            self._since[endpoint] = {r: t for r, t in since.items() if r not in late}
        return late


def dialled_endpoints(connection_pool: dict[str, list[dict]]) -> dict[str, str]:
    """Prefill control endpoints a decode rank holds connections to, endpoint -> bootstrap
    address, from SGLang's connection pool (keyed ``{bootstrap_addr}_{dp}_{cp}_{tp}``)."""
    out = {}
    for key, infos in connection_pool.items():
        addr = key.rsplit("_", 3)[0]
        for info in infos or []:
            ip, port = info.get("rank_ip"), info.get("rank_port")
            if ip and port:
                out[f"{ip}:{int(port)}"] = addr
    return out


def status_snapshot(request_status: Any) -> dict[int, Any]:
    """A copy of SGLang's ``request_status`` (room -> KVPoll) that another thread can read.

    A PP stage's is a ``PPConsensusStore``: a map with item access but no iteration (``dict()``
    on it raises ``KeyError: 0``), read here through its local map under its lock."""
    if isinstance(request_status, dict):
        return dict(request_status)
    with request_status._cache_lock:
        return dict(request_status._local_map)


def heartbeat_settings() -> tuple[float, float] | None:
    """(interval, timeout) in seconds from the environment, or None when switched off."""
    interval_ms = envs.SGL_ATOM_PD_HEARTBEAT_INTERVAL_MS.get()
    timeout_ms = envs.SGL_ATOM_PD_HEARTBEAT_TIMEOUT_MS.get()
    if interval_ms <= 0:
        logger.warning("atom P/D: SGL_ATOM_PD_HEARTBEAT_INTERVAL_MS=0: no session heartbeat")
        return None
    if timeout_ms < 2 * interval_ms:
        logger.warning(
            "atom P/D: SGL_ATOM_PD_HEARTBEAT_TIMEOUT_MS=%d is under twice the interval (%d ms), "
            "so one late answer would fail a live peer's requests: using %d ms",
            timeout_ms,
            interval_ms,
            2 * interval_ms,
        )
        timeout_ms = 2 * interval_ms
    return interval_ms / 1000, timeout_ms / 1000


class SessionHeartbeat:
    """The heartbeat half of :class:`sgl_atom.disagg.conn.AtomKVManager` (a mixin over SGLang's
    ``CommonKVManager``: its sockets, connection pool, room tracker and node-failure path)."""

    peer_clock: PeerClock | None = None
    missing_rooms: MissingRooms | None = None
    room_claims: RoomClaims | None = None
    sender_rooms: set[int] | None = None  # prefill: rooms a request (an AtomKVSender) holds

    # ---------------------------------------------------------------- both

    def _start_session_heartbeat(self, consumer: bool) -> None:
        settings = heartbeat_settings()
        if settings is None:
            return
        interval, timeout = settings
        if consumer:
            self.peer_clock, self.missing_rooms = PeerClock(timeout), MissingRooms(timeout)
            tick = self._beat
        else:
            self.room_claims = RoomClaims(timeout)
            tick = self._sweep_orphans

        stop = getattr(self, "_heartbeat_shutdown", None) or threading.Event()  # decode only

        def loop() -> None:
            while not stop.wait(interval):
                tick(time.monotonic())

        self._start_thread(loop, "atom-pd-heartbeat")

    def _push_now(self, host: str, port: int, parts: list[bytes], own: bool) -> None:
        """Send without blocking on a cached PUSH socket (``own``: the manager's, else the
        receivers' shared one); a peer that cannot take it now is one that stays silent."""
        import zmq
        from sglang.srt.disaggregation.common.conn import CommonKVReceiver
        from sglang.srt.utils.network import NetworkAddress

        na = NetworkAddress(host, port)
        endpoint = na.to_tcp()
        try:
            if own:
                sock = self._connect(endpoint, is_ipv6=na.is_ipv6)
                lock = self._socket_send_locks[endpoint]
            else:
                sock, lock = CommonKVReceiver._connect(endpoint, is_ipv6=na.is_ipv6)
            with lock:
                sock.send_multipart(parts, flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.debug("atom P/D: heartbeat frame to %s not sent: %s", endpoint, e)

    # ---------------------------------------------------------------- consumer (decode)

    def _beat(self, now: float) -> None:
        """One round: probe every prefill rank dialled, lose those silent past the timeout."""
        with self.connection_lock:
            dialled = dialled_endpoints(self.connection_pool)
            rooms = {a: tuple(self.addr_to_rooms_tracker.get(a, ())) for a in set(dialled.values())}
        self.peer_clock.track(dialled, now)
        for endpoint, addr in dialled.items():
            host, port = endpoint.rsplit(":", 1)
            probe = wire.Heartbeat(self.engine.name, endpoint, rooms=rooms[addr][: wire.MAX_ROOMS])
            self._push_now(host, int(port), [TAG, wire.encode(probe)], own=False)
        lost = self.peer_clock.overdue(now)
        for addr in sorted({a for a, _ in lost.values()}):
            self._lose_prefill(addr, {ep: s for ep, (a, s) in lost.items() if a == addr})

    def _on_heartbeat_answer(self, frame: bytes) -> None:
        try:
            m = wire.decode(frame)
        except wire.WireError as e:
            logger.error("atom P/D: dropped a malformed control frame: %s", e)
            return
        if not isinstance(m, wire.Heartbeat) or not m.reply or self.peer_clock is None:
            return
        now = time.monotonic()
        self.peer_clock.heard(m.endpoint, now)
        for room, seconds in sorted(self.missing_rooms.report(m.endpoint, m.rooms, now).items()):
            self._fail_missing_room(room, m.endpoint, seconds)

    def _fail_missing_room(self, room: int, endpoint: str, seconds: float) -> None:
        from sglang.srt.disaggregation.base.conn import KVPoll

        if self.request_status.get(room) in (None, KVPoll.Success, KVPoll.Failed):
            return
        reason = (
            f"atom P/D: prefill rank {endpoint} has had no request for room {room} for "
            f"{seconds:.1f}s: the request never reached the prefill (SGL_ATOM_PD_HEARTBEAT_*)"
        )
        logger.error("%s", reason)
        self.record_failure(room, reason)
        self.update_status(room, KVPoll.Failed)

    def _lose_prefill(self, bootstrap_addr: str, silent: dict[str, float]) -> None:
        ranks = ", ".join(f"{ep} (silent {s:.1f} s)" for ep, s in sorted(silent.items()))
        logger.error(
            "atom P/D: prefill %s lost: rank(s) %s answered no heartbeat for longer than "
            "SGL_ATOM_PD_HEARTBEAT_TIMEOUT_MS; its in-flight requests fail, the next request to "
            "it bootstraps again",
            bootstrap_addr,
            ranks,
        )
        self._handle_node_failure(bootstrap_addr)

    # ---------------------------------------------------------------- producer (prefill)

    def _on_heartbeat(self, hb: wire.Heartbeat) -> None:
        """Note the rooms a decode rank holds and answer at the status endpoint of its
        handshake (an agent that never shook hands gets nothing); never blocks."""
        peer = self.peers.get(hb.agent_name)
        target = peer.target if peer is not None else self.refused_targets.get(hb.agent_name)
        if target is None:
            return
        if self.room_claims is not None:
            self.room_claims.heard(hb.agent_name, hb.rooms, time.monotonic())
        held = self.sender_rooms if self.sender_rooms is not None else set(hb.rooms)
        missing = tuple(room for room in hb.rooms if room not in held)
        answer = wire.Heartbeat(hb.agent_name, hb.endpoint, reply=True, rooms=missing)
        self._push_now(*target, [TAG, wire.encode(answer)], own=True)

    def _sweep_orphans(self, now: float) -> None:
        from sglang.srt.disaggregation.base.conn import KVPoll

        # a room is held for its decode from the bootstrap until its KV is written: the decode
        # lists it in every heartbeat until then (a write to a dead decode is abandoned)
        held = (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring)
        statuses = status_snapshot(self.request_status)
        waiting = {room for room, st in statuses.items() if st in held}
        for room, why in sorted(self.room_claims.orphans(waiting, now).items()):
            reason = (
                f"atom P/D: prefill rank tp {self.attn_tp_rank}/{self.attn_tp_size} failed room "
                f"{room} held for its decode: {why} (SGL_ATOM_PD_HEARTBEAT_TIMEOUT_MS)"
            )
            logger.error("%s", reason)
            self.record_failure(room, reason)
            self.update_status(room, KVPoll.Failed)
