"""Move planned byte spans between two processes through NIXL (UCX backend), CPU or GPU buffers.

A :class:`NixlEngine` is one NIXL agent. Each side registers its region buffers
(:meth:`NixlEngine.register`) and sends :meth:`NixlEngine.metadata` to the peer out of band (the
handshake's `agent_metadata`); the producer loads it with :meth:`NixlEngine.add_peer`, then
:meth:`NixlEngine.write` turns the `(src_off, dst_off, len)` spans of
:meth:`sgl_atom.disagg.plan.PairPlan.spans` into two NIXL descriptor lists and posts one WRITE
(:meth:`NixlEngine.write_many`: the spans of many regions in one WRITE),
and :meth:`NixlEngine.wait` polls it. The consumer learns a write landed from its notification
(:meth:`NixlEngine.notified`).

Addresses come only from registrations: a source span is checked against the local region it
names, a destination span against the peer's region base and length (the peer's handshake
`region_addrs` and sizes); NIXL checks the destination again against the peer's registered
memory in its metadata. UCX's transports are picked by UCX's own environment
(`UCX_TLS`, `UCX_NET_DEVICES`); on one host `UCX_NET_DEVICES=lo` keeps traffic on loopback.

Memory kinds: a CPU tensor is registered as NIXL ``DRAM``, a CUDA tensor as ``VRAM`` with its
device index, so a GPU pool moves GPU to GPU (UCX's CUDA transports) without a host bounce.
A write's destination kind is the peer's: given with :meth:`NixlEngine.add_peer` (``DRAM`` by
default, which is what a CPU peer's pool is).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

DRAM, VRAM = "DRAM", "VRAM"
MemKind = tuple[str, int]  # (NIXL memory type, device index)
_HOST: MemKind = (DRAM, 0)


def mem_kind(t: torch.Tensor) -> MemKind:
    """NIXL's memory type and device index for a tensor's storage."""
    if t.device.type == "cuda":
        return (VRAM, t.device.index if t.device.index is not None else 0)
    if t.device.type == "cpu":
        return _HOST
    raise TransferError(f"NIXL moves CPU or CUDA memory, not {t.device}")


class TransferError(RuntimeError):
    """A NIXL transfer could not be set up, failed, or did not finish in time."""


@dataclass
class WriteHandle:
    """One posted WRITE: the NIXL request, its peer, and its size for error messages."""

    xfer: object
    peer: str
    spans: int
    nbytes: int
    state: str


def _nixl():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise TransferError(
            f"NIXL is not importable ({e}); install the P/D extra: "
            "`pip install 'sgl-atom[pd]'` (nixl==1.5.1)"
        ) from e
    return nixl_agent, nixl_agent_config


def _descs(rows: np.ndarray, side: int, base: int, device: int) -> np.ndarray:
    """NIXL descriptor rows (address, length, device) of one side (0 source, 1 destination)
    of ``(src_off, dst_off, len)`` spans, offsets from ``base``."""
    n = len(rows)
    return np.stack(
        [rows[:, side] + np.uint64(base), rows[:, 2], np.full(n, device, np.uint64)], axis=1
    )


def coalesce(spans: np.ndarray) -> np.ndarray:
    """Merge spans that continue the previous one on both sides: [N, 3] (src, dst, len) rows."""
    if len(spans) < 2:
        return spans
    src, dst, ln = spans[:, 0], spans[:, 1], spans[:, 2]
    starts = np.ones(len(spans), dtype=bool)
    starts[1:] = (src[1:] != src[:-1] + ln[:-1]) | (dst[1:] != dst[:-1] + ln[:-1])
    idx = np.flatnonzero(starts)
    lens = np.add.reduceat(ln, idx)
    return np.stack([src[idx], dst[idx], lens], axis=1)


def page_runs(src_pages: np.ndarray, dst_pages: np.ndarray) -> np.ndarray:
    """[R, 3] (first source page, first destination page, pages) of the runs in which both
    sides' pages follow each other: a whole-page region moves each run as one span."""
    n = min(len(src_pages), len(dst_pages))
    src = np.asarray(src_pages[:n], dtype=np.int64)
    dst = np.asarray(dst_pages[:n], dtype=np.int64)
    return coalesce(np.stack([src, dst, np.ones(n, dtype=np.int64)], axis=1))


def span_ends(rows: np.ndarray, who: str) -> tuple[int, int]:
    """(source end, destination end) in bytes of ``[N, 3]`` int64 spans (src offset, dst offset,
    length), N >= 1; TransferError naming ``who`` unless offsets are >= 0 and lengths > 0."""
    if (rows[:, :2] < 0).any() or (rows[:, 2] <= 0).any():
        raise TransferError(f"{who}: spans need offsets >= 0 and lengths > 0")
    return int((rows[:, 0] + rows[:, 2]).max()), int((rows[:, 1] + rows[:, 2]).max())


def run_ends(runs: np.ndarray, page_bytes: np.ndarray, who: str) -> tuple[np.ndarray, np.ndarray]:
    """Per region, the (source, destination) byte ends of the page runs of :func:`page_runs`
    for regions of ``page_bytes``; TransferError naming ``who`` unless pages are >= 0, runs
    and page bytes > 0."""
    if (runs[:, :2] < 0).any() or (runs[:, 2] <= 0).any() or (page_bytes <= 0).any():
        raise TransferError(f"{who}: page runs need pages >= 0, lengths > 0 and page bytes > 0")
    src_end, dst_end = span_ends(runs, who)
    return src_end * page_bytes, dst_end * page_bytes


def run_spans(
    runs: np.ndarray, src_base: np.ndarray, dst_base: np.ndarray, page_bytes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source addresses, destination addresses, lengths), flat, region after region, of the
    page runs moved by regions based at ``src_base``/``dst_base`` with ``page_bytes`` each."""
    pb = page_bytes[:, None]
    return (
        (src_base[:, None] + runs[None, :, 0] * pb).ravel(),
        (dst_base[:, None] + runs[None, :, 1] * pb).ravel(),
        (runs[None, :, 2] * pb).ravel(),
    )


def poll(
    done: Callable[[], bool],
    timeout_s: float,
    abandon: Callable[[], str | None] | None = None,
) -> tuple[bool, str] | None:
    """Ask ``done()`` (at once, then after sleeps growing from 10 us to 1 ms) until it is True:
    None. Else why it stopped asking, as (timed out, reason): (True, "") after ``timeout_s``,
    or (False, the reason ``abandon()`` gave; it is asked every ~10 ms)."""
    deadline = time.monotonic() + timeout_s
    next_ask = time.monotonic() + 0.01
    delay = 1e-5
    while not done():
        now = time.monotonic()
        if now > deadline:
            return True, ""
        if abandon is not None and now >= next_ask:
            next_ask = now + 0.01
            why = abandon()
            if why:
                return False, why
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)
    return None


class NixlEngine:
    """One NIXL agent over UCX moving bytes between registered CPU or GPU buffers."""

    def __init__(
        self, name: str, *, backends: Sequence[str] = ("UCX",), progress_thread: bool = True
    ):
        """``progress_thread``: NIXL's progress thread (its default). Without it the agent's
        UCX worker progresses only while this engine polls (``wait``, ``notified``): right for
        a producer that polls its writes, not for a target that must take in writes it does
        not poll for."""
        nixl_agent, nixl_agent_config = _nixl()
        config = nixl_agent_config(
            enable_prog_thread=progress_thread,
            enable_listen_thread=False,
            backends=list(backends),
        )
        try:
            self._agent = nixl_agent(name, config)
        except Exception as e:
            raise TransferError(f"NIXL agent {name!r} could not start: {e}") from e
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise TransferError(
                f"NIXL agent {name!r}: backend(s) {missing} did not start; available plugins: "
                f"{self._agent.plugin_list}"
            )
        self.name = name
        self._regions: dict[str, tuple[int, int]] = {}
        self._kinds: dict[str, MemKind] = {}
        self._tensors: dict[str, torch.Tensor] = {}
        self._reg_descs: list[object] = []
        self._peers: dict[str, dict[int, int]] = {}
        self._peer_kinds: dict[str, dict[int, MemKind]] = {}

    # Registration and metadata -----------------------------------------------------------

    def register(self, buffers: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
        """Register contiguous CPU (DRAM) or CUDA (VRAM) tensors; returns {name: (base address,
        bytes)} of each."""
        new, kinds = {}, {}
        for name, t in buffers.items():
            if name in self._regions:
                raise TransferError(f"region {name!r} is already registered on {self.name}")
            if t.device.type not in ("cpu", "cuda") or not t.is_contiguous() or t.numel() == 0:
                raise TransferError(
                    f"region {name!r}: NixlEngine registers non-empty contiguous CPU or CUDA "
                    f"tensors, got device {t.device}, contiguous={t.is_contiguous()}, "
                    f"numel={t.numel()}"
                )
            new[name] = (t.data_ptr(), t.numel() * t.element_size())
            kinds[name] = mem_kind(t)
        registered = self._register_rows(new, kinds)
        self._tensors.update(buffers)
        return registered

    def register_addresses(
        self, spans: Mapping[str, tuple[int, int]], kind: MemKind = _HOST
    ) -> dict[str, tuple[int, int]]:
        """Register memory by {name: (base address, bytes)}, all of one kind (DRAM by default,
        or (VRAM, device)); the caller keeps it alive for the agent's lifetime (buffers SGLang
        owns and hands over as pointers)."""
        for name, (addr, n) in spans.items():
            if name in self._regions:
                raise TransferError(f"region {name!r} is already registered on {self.name}")
            if addr <= 0 or n <= 0:
                raise TransferError(f"region {name!r}: address 0x{addr:x} / {n} B is not memory")
        if kind[0] not in (DRAM, VRAM):
            raise TransferError(f"memory kind {kind[0]!r}: NixlEngine registers DRAM or VRAM")
        return self._register_rows(dict(spans), dict.fromkeys(spans, kind))

    def _register_rows(
        self, new: dict[str, tuple[int, int]], kinds: dict[str, MemKind]
    ) -> dict[str, tuple[int, int]]:
        if not new:
            return {}
        for mem in sorted({kinds[n][0] for n in new}):
            rows = [(a, n, kinds[k][1], k) for k, (a, n) in new.items() if kinds[k][0] == mem]
            try:
                self._reg_descs.append(self._agent.register_memory(rows, mem))
            except Exception as e:
                names = [r[3] for r in rows]
                raise TransferError(f"{self.name}: registering {mem} {names} failed: {e}") from e
        self._regions.update(new)
        self._kinds.update(kinds)
        return dict(new)

    def kind(self, region: str) -> MemKind:
        """The NIXL memory type and device of a registered region (for the peer's handshake)."""
        return self._kinds[region]

    @property
    def regions(self) -> dict[str, tuple[int, int]]:
        return dict(self._regions)

    def metadata(self) -> bytes:
        """This agent's NIXL metadata (connection info and registered memory) for the peer."""
        return self._agent.get_agent_metadata()

    def add_peer(
        self,
        name: str,
        metadata: bytes,
        regions: Mapping[int, int] | None = None,
        kinds: Mapping[int, MemKind] | None = None,
    ) -> None:
        """Load a peer's metadata. regions: {base address: bytes} of the peer's region buffers,
        from its handshake; writes are bounds-checked against them when given. kinds: {base
        address: (memory type, device)} of those buffers where they are not host memory."""
        try:
            loaded = self._agent.add_remote_agent(metadata)
        except Exception as e:
            raise TransferError(
                f"{self.name}: loading metadata of peer {name!r} failed: {e}"
            ) from e
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != name:
            self._agent.remove_remote_agent(loaded)
            raise TransferError(
                f"{self.name}: metadata handed in for peer {name!r} belongs to agent {loaded!r}"
            )
        self._peers[name] = dict(regions or {})
        self._peer_kinds[name] = dict(kinds or {})

    def remove_peer(self, name: str) -> None:
        self._peer_kinds.pop(name, None)
        if self._peers.pop(name, None) is not None:
            self._agent.remove_remote_agent(name)

    # Transfers ---------------------------------------------------------------------------

    def write(
        self,
        peer: str,
        spans: Sequence[tuple[int, int, int]] | np.ndarray,
        src_region: str,
        dst_region_addr: int,
        notif: bytes = b"",
    ) -> WriteHandle:
        """Post one WRITE of `spans` (src offset in `src_region`, dst offset from the peer's
        region at `dst_region_addr`, length) to `peer`; `notif` reaches the peer when it lands."""
        (handle,) = self.write_many(peer, [(spans, src_region, dst_region_addr)], notif)
        return handle

    def write_many(
        self,
        peer: str,
        items: Sequence[tuple[Sequence[tuple[int, int, int]] | np.ndarray, str, int]],
        notif: bytes = b"",
        pages: tuple[np.ndarray, Sequence[tuple[str, int, int]]] | None = None,
    ) -> list[WriteHandle]:
        """Post the spans of several `(spans, src_region, dst_region_addr)` items to `peer` as
        one WRITE per pair of memory kinds (one in practice: a pool is all on one device), each
        carrying the descriptors of every item: posting costs per WRITE, not per byte, and a
        request's KV spans one region per layer and K/V. Every item is checked before anything
        is posted; `notif` rides on each WRITE.

        pages: (runs, regions) for regions whose pages are byte-identical on both sides: each
        region `(src_region, dst_region_addr, page bytes)` moves the page runs of
        :func:`page_runs`, its descriptors built for all regions at once."""
        has_pages = pages is not None and len(pages[0]) > 0 and len(pages[1]) > 0
        if not items and not has_pages:
            return []
        if peer not in self._peers:
            raise TransferError(f"{self.name}: unknown peer {peer!r}; call add_peer first")
        groups: dict[tuple[MemKind, MemKind], list[tuple[np.ndarray, np.ndarray]]] = {}
        if has_pages:
            assert pages is not None
            for key, part in self._page_descs(peer, pages[0], pages[1]).items():
                groups.setdefault(key, []).append(part)
        for spans, src_region, dst_region_addr in items:
            if src_region not in self._regions:
                known = list(self._regions)
                raise TransferError(
                    f"{self.name}: no local region {src_region!r}; registered: {known}"
                )
            rows = coalesce(self._check_spans(peer, spans, src_region, dst_region_addr))
            src_kind = self._kinds[src_region]
            dst_kind = self._peer_kinds[peer].get(dst_region_addr, _HOST)
            local = _descs(rows, 0, self._regions[src_region][0], src_kind[1])
            remote = _descs(rows, 1, dst_region_addr, dst_kind[1])
            groups.setdefault((src_kind, dst_kind), []).append((local, remote))
        handles: list[WriteHandle] = []
        try:
            for (src_kind, dst_kind), parts in groups.items():
                local = np.concatenate([lo for lo, _ in parts])
                remote = np.concatenate([re for _, re in parts])
                handles.append(self._post(peer, local, remote, src_kind[0], dst_kind[0], notif))
        except TransferError:
            for h in handles:  # a later group refused: the call posts all of it or none
                self._release(h)
            raise
        return handles

    def _page_descs(
        self, peer: str, runs: np.ndarray, regions: Sequence[tuple[str, int, int]]
    ) -> dict[tuple[MemKind, MemKind], tuple[np.ndarray, np.ndarray]]:
        """Descriptor rows (local, remote) of whole-page regions moving the same page runs,
        by pair of memory kinds; every region checked against both sides' bounds first."""
        runs = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
        for name, _, _ in regions:
            if name not in self._regions:
                known = list(self._regions)
                raise TransferError(f"{self.name}: no local region {name!r}; registered: {known}")
        peer_regions = self._peers[peer]
        base = np.array([self._regions[n][0] for n, _, _ in regions], dtype=np.int64)
        size = np.array([self._regions[n][1] for n, _, _ in regions], dtype=np.int64)
        addr = np.array([a for _, a, _ in regions], dtype=np.int64)
        pb = np.array([b for _, _, b in regions], dtype=np.int64)
        src_end, dst_end = run_ends(runs, pb, f"{self.name} -> {peer}")
        for i in np.flatnonzero(src_end > size)[:1]:
            raise TransferError(
                f"{self.name}: pages read up to byte {int(src_end[i])} of region "
                f"{regions[i][0]!r} ({int(size[i])} B)"
            )
        if peer_regions:
            for i, a in enumerate(addr.tolist()):
                if a not in peer_regions:
                    raise TransferError(
                        f"{self.name} -> {peer}: 0x{a:x} is not the base of a region the peer "
                        "declared"
                    )
                if dst_end[i] > peer_regions[a]:
                    raise TransferError(
                        f"{self.name} -> {peer}: pages write up to byte {int(dst_end[i])} of the "
                        f"peer's region at 0x{a:x} ({peer_regions[a]} B)"
                    )
        kinds = [(self._kinds[n], self._peer_kinds[peer].get(a, _HOST)) for n, a, _ in regions]
        out = {}
        for key in dict.fromkeys(kinds):
            idx = np.array([i for i, k in enumerate(kinds) if k == key], dtype=np.int64)
            local, remote, lens = run_spans(runs, base[idx], addr[idx], pb[idx])
            n = len(lens)
            out[key] = (
                np.stack([local, lens, np.full(n, key[0][1])], axis=1).astype(np.uint64),
                np.stack([remote, lens, np.full(n, key[1][1])], axis=1).astype(np.uint64),
            )
        return out

    def _post(
        self, peer: str, local: np.ndarray, remote: np.ndarray, src_mem: str, dst_mem: str, notif
    ) -> WriteHandle:
        nbytes = int(local[:, 1].sum())
        try:
            xfer = self._agent.initialize_xfer(
                "WRITE",
                self._agent.get_xfer_descs(local, src_mem),
                self._agent.get_xfer_descs(remote, dst_mem),
                peer,
                notif,
            )
            state = self._agent.transfer(xfer)
        except Exception as e:
            raise TransferError(
                f"{self.name} -> {peer}: posting a WRITE of {len(local)} spans ({nbytes} B) "
                f"failed: {e}"
            ) from e
        handle = WriteHandle(xfer, peer, len(local), nbytes, state)
        if state == "ERR":
            self._release(handle)
            raise TransferError(self._describe(handle, "was refused at post (state ERR)"))
        return handle

    def wait(
        self,
        handle: WriteHandle,
        timeout_s: float = 30.0,
        abandon: Callable[[], str | None] | None = None,
    ) -> None:
        """Poll `handle` until DONE; raise TransferError on ERR, after timeout_s seconds, or as
        soon as ``abandon()`` (asked every ~10 ms) names a reason to stop waiting."""

        def landed() -> bool:
            if handle.state == "PROC":
                handle.state = self._agent.check_xfer_state(handle.xfer)
            return handle.state != "PROC"

        stopped = poll(landed, timeout_s, abandon)
        self._release(handle)
        if stopped is not None:
            timed_out, why = stopped
            what = (
                f"still PROC after {timeout_s} s" if timed_out else f"abandoned while PROC: {why}"
            )
            raise TransferError(self._describe(handle, what))
        if handle.state != "DONE":
            raise TransferError(self._describe(handle, f"ended in state {handle.state}"))

    def notified(self, peer: str, tag: bytes) -> bool:
        """Whether a notification starting with `tag` came from `peer` (consumes it)."""
        return self._agent.check_remote_xfer_done(peer, tag)

    def close(self) -> None:
        """Forget peers, deregister memory, drop the agent. Safe to call twice."""
        agent = getattr(self, "_agent", None)
        if agent is None:
            return
        for peer in list(self._peers):
            try:
                self.remove_peer(peer)
            except Exception:
                pass  # a dead peer may refuse a clean disconnect
        for descs in self._reg_descs:
            agent.deregister_memory(descs)
        self._reg_descs.clear()
        self._regions.clear()
        self._kinds.clear()
        self._tensors.clear()
        self._agent = None

    # Helpers -----------------------------------------------------------------------------

    def _check_spans(self, peer, spans, src_region, dst_addr) -> np.ndarray:
        rows = np.asarray(spans, dtype=np.int64).reshape(-1, 3)
        if len(rows) == 0:
            raise TransferError(f"{self.name} -> {peer}: a WRITE needs at least one span")
        end, dst_end = span_ends(rows, f"{self.name} -> {peer}")
        _, src_len = self._regions[src_region]
        if end > src_len:
            raise TransferError(
                f"{self.name}: spans read up to byte {end} of region {src_region!r} ({src_len} B)"
            )
        peer_regions = self._peers[peer]
        if peer_regions:
            if dst_addr not in peer_regions:
                raise TransferError(
                    f"{self.name} -> {peer}: 0x{dst_addr:x} is not the base of a region the "
                    "peer declared"
                )
            if dst_end > peer_regions[dst_addr]:
                raise TransferError(
                    f"{self.name} -> {peer}: spans write up to byte {dst_end} of the peer's region "
                    f"at 0x{dst_addr:x} ({peer_regions[dst_addr]} B)"
                )
        return rows.astype(np.uint64)

    def _release(self, handle: WriteHandle) -> None:
        try:
            handle.xfer.release()
        except Exception:
            pass  # NIXL keeps a handle it cannot cancel and frees it with the agent

    def _describe(self, handle: WriteHandle, what: str) -> str:
        return (
            f"{self.name} -> {handle.peer}: WRITE of {handle.spans} spans "
            f"({handle.nbytes} B) {what}; is the peer alive and reachable?"
        )
