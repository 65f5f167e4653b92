"""The ``atom`` P/D transfer backend: SGLang's KV manager, sender, receiver and bootstrap server.

SGLang's common connection layer (``disaggregation/common/conn.py``) already does what every
backend shares: the HTTP bootstrap registry, the decode side's lookup of prefill ranks and its
TP/PP rank mapping, room status bookkeeping, heartbeats, aborts. This module adds what is
atom's own:

- Each rank describes its live KV pool as regions (:mod:`sgl_atom.disagg.pool_regions`) and
  registers their buffers, plus the per-request metadata buffers, with a NIXL agent.
- A decode rank's first contact with a prefill rank is a :class:`~sgl_atom.disagg.wire.Handshake`
  carrying its regions, buffer addresses and sizes, NIXL metadata and status endpoint. The
  prefill rank pairs every region with :func:`~sgl_atom.disagg.plan.plan_transfer`; a mismatch
  is refused there, with an error naming the region and both values, and every room that decode
  rank asks for fails with that error: nothing is ever written to it.
- Per room the decode rank sends a :class:`~sgl_atom.disagg.wire.TransferRequest` (its page ids
  and metadata row). Once all decode ranks the room needs have asked, each KV chunk the prefill
  computes is written through NIXL (head cuts into a rank holding fewer heads packed into whole
  pages through a staging buffer first: :mod:`sgl_atom.disagg.stage`), bounds-checked against the
  peer's declared buffers, then the room's outcome goes back on SGLang's status channel.
- Each decode rank asks every prefill rank it shook hands with whether it is alive, on the same
  control sockets, listing the rooms it holds (:mod:`sgl_atom.disagg.heartbeat`): a silent
  prefill fails its rooms at the decode, a room no live decode holds fails at the prefill.

Control frames travel on SGLang's per-rank ZMQ sockets as ``[b"ATOM", frame]``; the frame is
the strict, pickle-free format of :mod:`sgl_atom.disagg.wire`. Addresses all come from the
bootstrap registry and the handshakes (SGLang's ``SGLANG_HOST_IP`` picks the control socket's
host; UCX's own variables pick NIXL's transport).
"""

from __future__ import annotations

import os
import re
import threading
import time
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (
    ABORT_TAG,
    AbortNotification,
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.common.utils import FastQueue, TransferKVChunk
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.server_args import ServerArgs

from sgl_atom import envs
from sgl_atom.disagg import ipc, wire
from sgl_atom.disagg.bind import control_plane_address
from sgl_atom.disagg.engine import VRAM, MemKind, NixlEngine, TransferError, page_runs
from sgl_atom.disagg.heartbeat import TAG, SessionHeartbeat
from sgl_atom.disagg.ipc import IpcError, IpcWrite, IpcWriter
from sgl_atom.disagg.plan import HandshakeError, TransferPlan, plan_transfer
from sgl_atom.disagg.pool_regions import INDEX_K_STATE, PoolExport, describe_pool
from sgl_atom.disagg.regions import RegionError
from sgl_atom.disagg.stage import Stager, packs
from sgl_atom.log import get_logger
from sgl_atom.parallel_layout import heads_of_rank
from sgl_atom.pool_state import peek, pool_with_transfer_buffer

logger = get_logger("sgl_atom.disagg")

BACKEND = "atom"


@dataclass
class TransferStats:
    """What one request's KV writes moved: bytes, NIXL descriptors (after coalescing) and
    WRITEs, the seconds from posting each chunk's writes to their landing, and of those the
    seconds until the last one was posted (the posting's own cost, staged rounds included), and
    the CUDA IPC copy launches (:mod:`sgl_atom.disagg.ipc`; their spans count as descriptors)."""

    nbytes: int = 0
    descriptors: int = 0
    seconds: float = 0.0
    writes: int = 0
    posting: float = 0.0
    ipc: int = 0

    def add(self, handles: list[Any], seconds: float, posting: float = 0.0) -> None:
        self.nbytes += sum(h.nbytes for h in handles)
        self.descriptors += sum(h.spans for h in handles)
        copies = sum(isinstance(h, IpcWrite) for h in handles)
        self.writes += len(handles) - copies
        self.ipc += copies
        self.seconds += seconds
        self.posting += posting

    def describe(self, ranks: int) -> str:
        """The log line's text after ``room N: `` (:meth:`logged` reads it back)."""
        rate = self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
        return (
            f"{self.nbytes} KV bytes in {self.descriptors} descriptors to {ranks} decode "
            f"rank(s), {self.seconds * 1e3:.2f} ms writing ({rate:.3g} GB/s; {self.writes} "
            f"NIXL writes, {self.posting * 1e3:.2f} ms posting; {self.ipc} CUDA IPC copies)"
        )

    @classmethod
    def logged(cls, log: str) -> dict[int, tuple[TransferStats, int]]:
        """room -> (its stats, decode ranks) from a prefill log's SGL_ATOM_PD_TRANSFER_LOG
        lines (write and posting times to the logged 0.01 ms)."""
        return {
            int(room): (
                cls(
                    int(nbytes),
                    int(descs),
                    float(ms) / 1e3,
                    int(writes or 0),
                    float(posting or 0.0) / 1e3,
                    int(copies or 0),
                ),
                int(ranks),
            )
            for room, nbytes, descs, ranks, ms, writes, posting, copies in _TRANSFER_LINE.findall(
                log
            )
        }


_TRANSFER_LINE = re.compile(
    r"room (\d+): (\d+) KV bytes in (\d+) descriptors to (\d+) decode rank\(s\), ([\d.]+) ms"
    r"(?: writing \([^;]*; (\d+) NIXL writes, ([\d.]+) ms posting(?:; (\d+) CUDA IPC copies)?\))?"
)


class AtomTransferError(RuntimeError):
    """A room could not be moved; the message says which peer, region or buffer and why."""


def limit_inbound_frames(sock: Any) -> None:
    """ZMQ drops a peer whose frame is over the wire format's limit as it arrives, instead of
    buffering a frame of any size for :func:`wire.decode` to refuse."""
    import zmq

    sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_INBOUND_FRAME)


@dataclass
class _Peer:
    """A decode rank this prefill rank accepted: its handshake and the checked plan."""

    hs: wire.Handshake
    plan: TransferPlan

    @property
    def target(self) -> tuple[str, int]:
        return (self.hs.status_host, self.hs.status_port)


def plan_for_peer(
    export: PoolExport,
    tp_rank: int,
    tp_size: int,
    is_last_stage: bool,
    aux: list[tuple[int, int, int]],
    hs: wire.Handshake,
) -> TransferPlan:
    """Check a decode rank's handshake against this prefill rank and plan its writes.

    Raises HandshakeError (every region problem, each naming the region and both values) or
    AtomTransferError (the peer's role, buffers or metadata rows) before anything is written.
    """
    if hs.role != "consumer":
        raise AtomTransferError(f"peer {hs.agent_name} says it is a {hs.role}, not a consumer")
    if len(hs.region_addrs) != len(hs.regions) or len(hs.region_bytes) != len(hs.regions):
        raise AtomTransferError(
            f"peer {hs.agent_name} declares {len(hs.regions)} regions but "
            f"{len(hs.region_addrs)} addresses and {len(hs.region_bytes)} sizes"
        )
    plan = plan_transfer(
        export.regions,
        tp_rank,
        tp_size,
        hs.regions,
        hs.tp_rank,
        hs.tp_size,
        stage_layers=range(*export.stage_layers),  # the layers this producer rank holds
        holds_draft=is_last_stage,
    )
    if is_last_stage:
        _check_aux(aux, hs.aux)
    return plan


def peer_kinds(hs: wire.Handshake) -> dict[int, MemKind]:
    """NIXL memory kinds of a consumer's region buffers that are GPU memory, by base address
    (the rest are host memory, NixlEngine's default)."""
    if not hs.region_devices:
        return {}
    return {
        addr: (VRAM, dev)
        for addr, dev in zip(hs.region_addrs, hs.region_devices, strict=True)
        if dev >= 0
    }


def _check_aux(mine: list[tuple[int, int, int]], theirs: tuple[tuple[int, int, int], ...]) -> None:
    if len(mine) != len(theirs):
        raise AtomTransferError(
            f"metadata buffers: producer {len(mine)}, consumer {len(theirs)} (enable the same "
            "optional metadata, e.g. --disaggregation-enable-kv-checksum, on both)"
        )
    for i, ((_, _, a), (_, _, b)) in enumerate(zip(mine, theirs, strict=True)):
        if a != b:
            raise AtomTransferError(
                f"metadata buffer {i}: bytes per request producer {a}, consumer {b}"
            )


def check_state_types(state_types: list[Any], export: PoolExport, pool_name: str) -> None:
    """Refuse, at start-up, per-request state SGLang would hand over that the regions do not
    move (mamba, SWA, DSA, ...); the covered ones ride with the pages."""
    missing = [getattr(st, "value", str(st)) for st in state_types]
    missing = [st for st in missing if st not in export.covers]
    if missing:
        raise RuntimeError(
            f"atom P/D: {pool_name} has per-request state {missing} that the atom transfer "
            "backend does not move (it moves K/V, fp8 scales, sparse index keys and a draft "
            "pool as pages); serve this model with --disaggregation-transfer-backend "
            "mooncake or nixl"
        )


def region_counts(export: PoolExport) -> str:
    """``target_k 4, target_v 4, index_k 2, ...``: regions per kind, in export order."""
    counts: dict[str, int] = {}
    for r in export.regions:
        counts[r.kind.value] = counts.get(r.kind.value, 0) + 1
    return ", ".join(f"{kind} {n}" for kind, n in counts.items())


class AtomKVManager(SessionHeartbeat, CommonKVManager):
    """One rank's side of the atom backend (prefill: producer, decode: consumer)."""

    kv_status_msg_tag = b"ATOM_STATUS"
    kv_status_msg_carries_reason = True
    ipc: IpcWriter | None = None  # producer: CUDA IPC writes into same-GPU decode pools
    _ipc_shared: tuple[str, tuple[wire.CudaIpcRegion, ...]] | None = None  # consumer, once

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: ServerArgs,
        is_mla_backend: bool | None = False,
    ):
        if is_mla_backend:
            raise ValueError(
                "--disaggregation-transfer-backend atom moves MHA KV pools (K and V per layer); "
                "this model uses an MLA pool: use mooncake or nixl for it"
            )
        bound = control_plane_address(server_args.host)
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        limit_inbound_frames(self.server_socket)
        logger.info(
            "atom P/D control plane listens on %s (%s); UCX devices: %s",
            self.local_ip,
            "from --host" if bound else "SGLang's choice for a wildcard --host",
            os.environ.get("UCX_NET_DEVICES", "all"),
        )
        self.export = self._describe_pool(args)
        producer = disaggregation_mode == DisaggregationMode.PREFILL
        role = "p" if producer else "d"
        # A decode's worker must keep progressing to take in writes and notifications that it
        # does not poll for (over TCP the data itself): it keeps NIXL's progress thread.
        self.engine = NixlEngine(
            f"atom-{role}{self.pp_rank}.{self.attn_tp_rank}-{uuid.uuid4()}",
            progress_thread=envs.SGL_ATOM_PD_NIXL_PROGRESS_THREAD.get() or not producer,
        )
        self.engine.register({f"r{i}": t for i, t in enumerate(self.export.tensors)})
        self.aux = [
            (int(p), int(n), int(item))
            for p, n, item in zip(
                args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens, strict=True
            )
        ]
        self.engine.register_addresses({f"aux{i}": (p, n) for i, (p, n, _) in enumerate(self.aux)})
        logger.info(
            "atom P/D %s rank tp %d/%d pp %d/%d: %d regions (layers %d..%d), %d of them draft, "
            "%d metadata buffers",
            disaggregation_mode.value,
            self.attn_tp_rank,
            self.attn_tp_size,
            self.pp_rank,
            self.pp_size,
            len(self.export.regions),
            self.export.stage_layers[0],
            self.export.stage_layers[1] - 1,
            sum(r.kind.appended for r in self.export.regions),
            len(self.aux),
        )
        logger.info(
            "atom P/D %s rank tp %d/%d pp %d/%d regions by kind: %s",
            disaggregation_mode.value,
            self.attn_tp_rank,
            self.attn_tp_size,
            self.pp_rank,
            self.pp_size,
            region_counts(self.export),
        )
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self._init_producer()
        else:
            self._start_thread(self._consumer_loop, "atom-pd-status")
            self._start_heartbeat_checker_thread()
            self._start_session_heartbeat(consumer=True)

    def _describe_pool(self, args: KVArgs) -> PoolExport:
        if getattr(args, "num_draft_entries", 0):
            raise RegionError(
                "the atom transfer backend does not move a draft KV pool SGLang manages (EAGLE-"
                "style draft runners); it moves drafts that register their own pool "
                "(ATOM_DSPARK). Serve this P/D pair with --disaggregation-transfer-backend "
                "mooncake/nixl"
            )
        pool = pool_with_transfer_buffer(args.kv_data_ptrs[0]) if args.kv_data_ptrs else None
        if pool is None:
            raise RuntimeError(
                "atom P/D: the KV pool behind the transfer buffers is unknown; sgl_atom's "
                "plugin must be loaded in the scheduler process (check SGLANG_PLUGINS)"
            )
        export = describe_pool(
            pool,
            tp_rank=self.attn_tp_rank,
            tp_size=self.attn_tp_size,
            total_kv_heads=self._total_kv_heads(args),
            draft_pool=peek(pool).draft_pool,
        )
        check_state_types(getattr(args, "state_types", None) or [], export, type(pool).__name__)
        ours = [t.data_ptr() for t in export.tensors if t.data_ptr() in set(args.kv_data_ptrs)]
        if sorted(ours) != sorted(args.kv_data_ptrs):
            raise RuntimeError(
                f"atom P/D: SGLang hands over {len(args.kv_data_ptrs)} KV buffers, the pool "
                f"description matches {len(ours)} of them; this pool layout is not supported"
            )
        return export

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's fetch and checks of the prefill's parallel info, less one refusal.

        SGLang refuses MiniMax sparse P/D whenever the attention TP sizes differ (its backends
        move head-major pages and cannot re-slice them). The atom backend cuts every K/V region
        by head and copies the index keys whole to each decode rank, and its handshake refuses
        any pairing it cannot move, naming the region; so that check is skipped here, the rest
        (page size, KV dtype, layout) stays.
        """
        types = getattr(self.kv_args, "state_types", None)
        if not types or INDEX_K_STATE not in [getattr(t, "value", t) for t in types]:
            return super().try_ensure_parallel_info(bootstrap_addr)
        self.kv_args.state_types = [t for t in types if getattr(t, "value", t) != INDEX_K_STATE]
        try:
            return super().try_ensure_parallel_info(bootstrap_addr)
        finally:
            self.kv_args.state_types = types

    def _total_kv_heads(self, args: KVArgs) -> int:
        """The model's KV heads: prefill's KVArgs carries them, decode's does not."""
        total = getattr(args, "total_kv_head_num", None)
        if total:
            return int(total)
        from sglang.srt.configs.model_config import ModelConfig

        return int(ModelConfig.from_server_args(self.server_args).get_total_num_kv_heads())

    @staticmethod
    def _start_thread(target: Any, name: str) -> None:
        def guarded() -> None:
            try:
                target()
            except Exception:
                logger.exception("atom P/D thread %s died; new requests will time out", name)
                raise

        threading.Thread(target=guarded, name=name, daemon=True).start()

    # ------------------------------------------------------------------ producer (prefill)

    def _init_producer(self) -> None:
        self.peers: dict[str, _Peer] = {}
        self.refused: dict[str, str] = {}  # agent -> why its handshake was refused
        self.refused_targets: dict[str, tuple[str, int]] = {}  # agent -> its status endpoint
        self.is_last_stage = self.pp_rank == self.pp_size - 1
        self.queue = FastQueue()
        self.log_transfers = envs.SGL_ATOM_PD_TRANSFER_LOG.get()
        self.room_stats: dict[int, TransferStats] = {}  # writer thread only
        staging = envs.SGL_ATOM_PD_STAGING_MB.get()
        if staging < 0:
            raise ValueError(f"SGL_ATOM_PD_STAGING_MB={staging}: give MiB >= 0 (0: no staging)")
        self.stager = Stager(self.engine, self.export.tensors, staging << 20)  # writer thread
        on_gpu = bool(self.export.tensors) and self.export.tensors[0].is_cuda
        if on_gpu and envs.SGL_ATOM_PD_CUDA_IPC.get():
            try:
                self.ipc = IpcWriter(self.export.tensors)
            except Exception as e:  # the copy kernel did not compile or run: NIXL carries all
                logger.warning("atom P/D: CUDA IPC writes are off (%s); KV goes through NIXL", e)
        self._start_thread(self._producer_control_loop, "atom-pd-control")
        self._start_thread(self._producer_worker_loop, "atom-pd-worker")
        self.sender_rooms = set()
        self._start_session_heartbeat(consumer=False)

    def _producer_control_loop(self) -> None:
        while True:
            msg = self.server_socket.recv_multipart()
            if msg and msg[0] == ABORT_TAG:
                self._on_abort(msg)
            elif len(msg) == 2 and msg[0] == TAG:
                try:
                    self._on_control(wire.decode(msg[1]))
                except wire.WireError as e:
                    logger.error("atom P/D: dropped a malformed control frame: %s", e)
            else:
                logger.warning("atom P/D: unexpected control message %r", msg[0][:20])

    def _on_control(self, m: wire.Message) -> None:
        if isinstance(m, wire.Handshake):
            self._on_handshake(m)
        elif isinstance(m, wire.TransferRequest):
            self._on_request(m)
        elif isinstance(m, wire.Heartbeat) and not m.reply:
            self._on_heartbeat(m)
        else:
            logger.warning("atom P/D: a consumer sent a %s; ignored", type(m).__name__)

    def _on_handshake(self, hs: wire.Handshake) -> None:
        if self._claimed_by_another(hs):
            return
        try:
            plan = plan_for_peer(
                self.export, self.attn_tp_rank, self.attn_tp_size, self.is_last_stage, self.aux, hs
            )
            bounds = dict(zip(hs.region_addrs, hs.region_bytes, strict=True))
            bounds.update({addr: n for addr, n, _ in hs.aux})
            self.engine.add_peer(hs.agent_name, hs.agent_metadata, bounds, peer_kinds(hs))
        except (HandshakeError, RegionError, TransferError, AtomTransferError, ValueError) as e:
            reason = (
                f"atom P/D: prefill rank tp {self.attn_tp_rank}/{self.attn_tp_size} pp "
                f"{self.pp_rank}/{self.pp_size} refused decode rank tp {hs.tp_rank}/{hs.tp_size} "
                f"({hs.agent_name}): {e}"
            )
            self.refused[hs.agent_name] = reason
            self.refused_targets[hs.agent_name] = (hs.status_host, hs.status_port)
            logger.error("%s", reason)
            return
        self.peers[hs.agent_name] = _Peer(hs, plan)
        modes = sorted({p.mode for p in plan.pairs})
        transport = self._map_peer(hs)
        logger.info(
            "atom P/D: accepted decode rank tp %d/%d (%s): %d region pairs, %s, KV through %s",
            hs.tp_rank,
            hs.tp_size,
            hs.agent_name,
            len(plan.pairs),
            ",".join(modes) or "nothing to send",
            transport,
        )

    def _map_peer(self, hs: wire.Handshake) -> str:
        """Map a consumer's shared buffers for CUDA IPC writes where it can (same host and GPU,
        or a GPU of this host); what carries its KV: "CUDA IPC" or "NIXL"."""
        if self.ipc is None or not hs.ipc_regions:
            return "NIXL"
        try:
            mapped = ipc.open_peer(hs)
        except IpcError as e:
            logger.warning(
                "atom P/D: decode rank tp %d/%d (%s) shares its pool through CUDA IPC, but it "
                "cannot be mapped here (%s): its KV goes through NIXL",
                hs.tp_rank,
                hs.tp_size,
                hs.agent_name,
                e,
            )
            return "NIXL"
        if mapped is None:
            return "NIXL (its GPU is not one of this process's)"
        self.ipc.add(hs.agent_name, mapped)
        return f"CUDA IPC ({len(mapped)} buffers mapped; metadata through NIXL)"

    def _claimed_by_another(self, hs: wire.Handshake) -> bool:
        """An agent name is bound to its first handshake (names carry a per-boot uuid): the
        same handshake again is a no-op, a different one claiming a bound name is ignored, so a
        forged claim can neither refuse the real decode nor divert its failure notices."""
        name = hs.agent_name
        peer = self.peers.get(name)
        if peer is None and name not in self.refused:
            return False
        if peer is not None and peer.hs == hs:
            return True
        first = peer.target if peer is not None else self.refused_targets.get(name)
        logger.error(
            "atom P/D: ignored a second handshake claiming agent %s (status endpoint %s:%d): "
            "the name is bound to its first handshake (%s:%d)",
            name,
            hs.status_host,
            hs.status_port,
            *(first or ("?", 0)),
        )
        return True

    def _on_request(self, req: wire.TransferRequest) -> None:
        room = req.room
        reason = self.refused.get(req.agent_name)
        if reason is None and req.agent_name not in self.peers:
            reason = f"atom P/D: room {room} from {req.agent_name}, which never shook hands"
        if reason is not None:
            self._fail_room_now(room, reason, req)
            return
        infos = self.transfer_infos.setdefault(room, {})
        infos[req.agent_name] = req
        if len(infos) == req.peers:
            self.req_to_decode_prefix_len[room] = 0
            self.update_status(room, KVPoll.WaitingForInput)

    def _fail_room_now(self, room: int, reason: str, req: wire.TransferRequest) -> None:
        """Fail a room before any byte moves: here, on the prefill sender, and at the decode."""
        self.record_failure(room, reason)
        self.update_status(room, KVPoll.WaitingForInput)  # opens the room if the sender has not
        self.update_status(room, KVPoll.Failed)
        target = self.refused_targets.get(req.agent_name)
        self.send_kv_status_message(
            targets=[target] if target else [],
            bootstrap_room=room,
            status=KVPoll.Failed,
            failure_reason=reason,
        )

    def _on_abort(self, msg: list[bytes]) -> None:
        note = AbortNotification.from_zmq(msg)
        if note is None:
            return
        room = note.room
        if room in self.request_status and self.check_status(room) != KVPoll.Success:
            self.record_failure(room, "Aborted by decode-side abort notification.")
            self.update_status(room, KVPoll.Failed)

    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices: npt.NDArray[np.int32],
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: int | None = None,
        state_indices: list | None = None,
        num_kv_tokens: int | None = None,
        **_: Any,
    ) -> None:
        """Called by the sender for each computed chunk: queue it for the writer thread.

        state_indices: SGLang's per-request state components; start-up admitted only those the
        regions move with the pages (``export.covers``), so they need no transfer of their own.
        """
        if bootstrap_room not in self.transfer_infos:
            return
        self.queue.put(
            TransferKVChunk(
                room=bootstrap_room,
                prefill_kv_indices=kv_indices,
                index_slice=index_slice,
                is_last_chunk=is_last_chunk,
                prefill_aux_index=aux_index,
                state_indices=None,
                num_kv_tokens=num_kv_tokens,
            )
        )

    def _producer_worker_loop(self) -> None:
        while True:
            chunk = self.queue.get()
            infos = dict(self.transfer_infos.get(chunk.room, {}))
            targets = [self.peers[a].target for a in infos if a in self.peers]
            if not infos:
                continue
            if self.check_status(chunk.room) == KVPoll.Failed:  # aborted on either side
                self.room_stats.pop(chunk.room, None)
                self.conclude_failure(
                    bootstrap_room=chunk.room, failure_reason="room failed", targets=targets
                )
                continue
            try:
                self._write_chunk(chunk, infos)
            except Exception as e:  # a failed room must never stop the writer thread
                logger.error("atom P/D: room %d failed: %s", chunk.room, e, exc_info=True)
                self.room_stats.pop(chunk.room, None)
                self.conclude_failure(
                    bootstrap_room=chunk.room, failure_reason=f"atom P/D: {e}", targets=targets
                )
                continue
            if chunk.is_last_chunk:
                stats = self.room_stats.pop(chunk.room, None)
                if self.log_transfers and stats is not None:
                    logger.info("atom P/D: room %d: %s", chunk.room, stats.describe(len(infos)))
                self.conclude_transfer(
                    bootstrap_room=chunk.room, status=KVPoll.Success, targets=targets
                )

    def _write_chunk(self, chunk: TransferKVChunk, infos: dict[str, wire.TransferRequest]) -> None:
        delay_ms = envs.SGL_ATOM_PD_WRITE_DELAY_MS.get()
        if delay_ms > 0:
            logger.warning(
                "atom P/D: SGL_ATOM_PD_WRITE_DELAY_MS: room %d waits %d ms before its writes",
                chunk.room,
                delay_ms,
            )
            time.sleep(delay_ms / 1000)
        why = self._room_failed(chunk.room)
        if why:  # a copy into a mapped pool would land even for a decode that is gone
            raise AtomTransferError(f"room {chunk.room}: {why} before its KV was written")
        src_pages = np.asarray(chunk.prefill_kv_indices, dtype=np.int64)
        timeout = float(envs.SGL_ATOM_PD_TRANSFER_TIMEOUT.get())
        for agent, req in infos.items():
            peer = self.peers[agent]
            dst_pages = req.page_ids[chunk.index_slice]
            if len(dst_pages) != len(src_pages):
                raise AtomTransferError(
                    f"room {chunk.room}: prefill sends {len(src_pages)} pages for slice "
                    f"{chunk.index_slice.start}:{chunk.index_slice.stop}, decode rank "
                    f"{req.consumer_rank} has {len(dst_pages)} there"
                )
            t0 = time.perf_counter()
            abandon = partial(self._room_failed, chunk.room)
            wait = partial(self._wait, timeout_s=timeout, abandon=abandon)
            landed, handles = self._post_kv(peer, src_pages, dst_pages, wait)
            if chunk.is_last_chunk and self.is_last_stage and chunk.prefill_aux_index is not None:
                handles += self._post_aux(peer, int(chunk.prefill_aux_index), req.aux_index)
            posted = time.perf_counter()
            for h in handles:
                wait(h)
            stats = self.room_stats.setdefault(chunk.room, TransferStats())
            stats.add(landed + handles, time.perf_counter() - t0, posted - t0)

    def _wait(self, handle: Any, **kwargs: Any) -> None:
        if isinstance(handle, IpcWrite):
            assert self.ipc is not None
            self.ipc.wait(handle, **kwargs)
        else:
            self.engine.wait(handle, **kwargs)

    def _sweep_orphans(self, now: float) -> None:
        """Also close the CUDA IPC mappings of decodes silent past the heartbeat timeout (a
        mapping keeps their memory allocated after they exit)."""
        super()._sweep_orphans(now)
        if self.ipc is None or self.room_claims is None:
            return
        for agent in self.room_claims.silent(self.ipc.peers(), now):
            if self.ipc.close(agent):
                logger.warning(
                    "atom P/D: decode %s sent no heartbeat for longer than "
                    "SGL_ATOM_PD_HEARTBEAT_TIMEOUT_MS: its CUDA IPC mappings are closed (its "
                    "memory is freed once it exits); should it answer again, its KV goes "
                    "through NIXL",
                    agent,
                )

    def _room_failed(self, room: int) -> str | None:
        """Why a write for ``room`` is no longer worth waiting for: the room failed (its
        decode stopped answering heartbeats, or either side aborted it)."""
        return "the room failed" if self.check_status(room) == KVPoll.Failed else None

    def _post_kv(
        self, peer: _Peer, src: npt.NDArray[np.int64], dst: tuple[int, ...], wait: Any
    ) -> tuple[list[Any], list[Any]]:
        """Post this chunk's KV writes to one decode rank: (handles already landed, handles in
        flight). Through CUDA IPC where the decode's pool is mapped here: one launch for every
        region. Otherwise through NIXL: head cuts that land as whole decode pages packed through
        the staging buffer (stage.py), in rounds when they outgrow it; the rest span by span,
        every region's spans in one WRITE."""
        if len(src) == 0:
            return [], []
        src_arr, dst_arr = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        # whole-page regions share one list of page runs, their descriptors built for all at
        # once; the rest (head cuts, other page sizes) span by span
        whole = [p for p in peer.plan.pairs if p.whole_pages]
        runs = page_runs(src_arr, dst_arr) if whole else np.empty((0, 3), dtype=np.int64)
        if self.ipc is not None and self.ipc.has(peer.hs.agent_name):
            cut = [
                (spans, p.producer_index, p.consumer_index)
                for p in peer.plan.pairs
                if not p.whole_pages and len(spans := p.spans(src_arr, dst_arr))
            ]
            pages = [(p.producer_index, p.consumer_index, p.src_page_bytes) for p in whole]
            return [], [self.ipc.write(peer.hs.agent_name, cut, (runs, pages))]
        addrs = peer.hs.region_addrs
        pages = [(f"r{p.producer_index}", addrs[p.consumer_index], p.src_page_bytes) for p in whole]
        items, packed = [], []
        for pair in peer.plan.pairs:
            if pair.whole_pages:
                continue
            addr = addrs[pair.consumer_index]
            if self.stager.enabled and packs(pair):
                packed.append((pair, addr))
                continue
            spans = pair.spans(src_arr, dst_arr)
            if len(spans):
                items.append((spans, f"r{pair.producer_index}", addr))
        out = self.engine.write_many(peer.hs.agent_name, items, pages=(runs, pages))
        if not packed:
            return [], out
        landed, pending = self.stager.write(peer.hs.agent_name, packed, src, dst, wait)
        return landed, out + pending

    def _post_aux(self, peer: _Peer, src_row: int, dst_row: int) -> list[Any]:
        if dst_row < 0:
            raise AtomTransferError("the decode rank sent no metadata row for the request")
        # a request's row of every metadata buffer: one "page" of each, its descriptors built
        # for all buffers at once
        rows = [
            (f"aux{i}", dst_addr, item)
            for i, ((_, _, item), (dst_addr, _, _)) in enumerate(
                zip(self.aux, peer.hs.aux, strict=True)
            )
        ]
        run = np.array([[src_row, dst_row, 1]], dtype=np.int64)
        return self.engine.write_many(peer.hs.agent_name, [], pages=(run, rows))

    # ------------------------------------------------------------------ consumer (decode)

    def _consumer_loop(self) -> None:
        while True:
            msg = self.server_socket.recv_multipart()
            if self.handle_abort_ack_message(msg):
                continue
            if len(msg) == 2 and msg[0] == TAG:
                self._on_heartbeat_answer(msg[1])
                continue
            parsed = self.parse_kv_status_message(msg)
            if parsed is None:
                logger.warning("atom P/D: unexpected status message %r", msg[0][:20])
                continue
            room, status, prefill_rank, reason = parsed
            self.apply_prefill_status(
                bootstrap_room=room, status=status, prefill_rank=prefill_rank, failure_reason=reason
            )

    def _ipc_share(self) -> tuple[str, tuple[wire.CudaIpcRegion, ...]]:
        """(GPU UUID, shared buffers) of this rank's pool for a producer on the same GPU; empty
        when off, on CPU, or when torch cannot share it (logged once). Shared once per boot."""
        if self._ipc_shared is not None:
            return self._ipc_shared
        share = ("", ())
        tensors = self.export.tensors
        if envs.SGL_ATOM_PD_CUDA_IPC.get() and tensors and tensors[0].is_cuda:
            try:
                share = ipc.export_regions(tensors)
            except IpcError as e:
                logger.warning("atom P/D: the pool cannot be shared through CUDA IPC (%s)", e)
        self._ipc_shared = share
        return share

    def build_receiver_registration_message(self) -> list[bytes]:
        uuid_, shared = self._ipc_share()
        hs = wire.Handshake(
            role="consumer",
            tp_rank=self.attn_tp_rank,
            tp_size=self.attn_tp_size,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            stage_layers=self.export.stage_layers,
            regions=self.export.regions,
            region_addrs=tuple(a for a, _ in self.export.spans()),
            agent_name=self.engine.name,
            agent_metadata=self.engine.metadata(),
            region_bytes=tuple(n for _, n in self.export.spans()),
            region_devices=tuple(
                (t.device.index or 0) if t.is_cuda else -1 for t in self.export.tensors
            ),
            aux=tuple(self.aux),
            status_host=self.local_ip,
            status_port=int(self.rank_port),
            device_uuid=uuid_,
            ipc_regions=shared,
        )
        return [TAG, wire.encode(hs)]

    def build_receiver_metadata_message(
        self,
        *,
        bootstrap_room: int,
        required_dst_info_num: int,
        kv_indices: npt.NDArray[np.int32],
        aux_index: int | None,
        state_indices: list | None,
        decode_prefix_len: int | None,
        is_dummy: bool,
        device_kv_indices: npt.NDArray[np.int32] | None = None,
    ) -> list[bytes]:
        # state_indices: only components the regions move with the pages (checked at start-up)
        total = self.export.regions[0].total_heads
        head_start, head_count = heads_of_rank(total, self.attn_tp_size, self.attn_tp_rank)
        req = wire.TransferRequest(
            room=int(bootstrap_room),
            consumer_rank=self.attn_tp_rank,
            page_ids=tuple(int(p) for p in kv_indices),
            head_start=head_start,
            head_count=head_count,
            aux_index=-1 if aux_index is None else int(aux_index),
            agent_name=self.engine.name,
            peers=int(required_dst_info_num or 1),
        )
        return [TAG, wire.encode(req)]

    def check_status(self, bootstrap_room: int) -> int:
        return self.request_status.get(bootstrap_room, KVPoll.WaitingForInput)


class AtomKVSender(CommonKVSender):
    """SGLang's common sender; chunks reach :meth:`AtomKVManager.add_transfer_request`. Its
    room is in the manager's ``sender_rooms`` while it lives (the heartbeat answers say which
    rooms a decode holds have no request here)."""

    def __init__(self, mgr: AtomKVManager, *args: Any, **kwargs: Any):
        super().__init__(mgr, *args, **kwargs)
        if mgr.sender_rooms is not None:
            mgr.sender_rooms.add(self.bootstrap_room)

    def clear(self) -> None:
        if self.kv_mgr.sender_rooms is not None:
            self.kv_mgr.sender_rooms.discard(self.bootstrap_room)
        super().clear()


class AtomKVReceiver(CommonKVReceiver):
    """SGLang's common receiver; its messages are built by :class:`AtomKVManager`."""


class AtomKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's HTTP bootstrap registry, unchanged."""
