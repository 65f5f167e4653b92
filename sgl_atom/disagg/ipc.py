"""KV writes between servers on one GPU through CUDA IPC: the decode's pool mapped into the
prefill, a request's spans copied by one kernel.

Between a prefill and a decode server on the same GPU, NIXL's UCX path (``cuda_ipc``) spends
nearly a whole write posting it: 19 GB/s for a 16K-token request of an 8B model on an H200,
against a device copy rate of over 4 TB/s. Here the decode rank shares each of its region buffers
with torch's CUDA IPC (``torch.multiprocessing.reductions.reduce_tensor``) in its handshake,
beside its GPU's UUID. A prefill rank that has a GPU of that UUID (same host, same GPU or a peer
GPU) maps the buffers once, when it accepts the handshake, and then writes each chunk's spans of
every region with :func:`sgl_atom.kernels.kv_transfer.copy_spans` on its own CUDA stream; the
write has landed when the stream's event has. The bounds checks are the NIXL path's: every span
against the producer's region and the consumer's declared region size.

What stays on NIXL: the per-request metadata buffers (host memory), peers on another host or
GPU without a UUID match, CPU pools, and any peer whose buffers cannot be mapped (logged once, at
the handshake). ``SGL_ATOM_PD_CUDA_IPC=0`` turns the path off on either side.

A mapping keeps the decode's memory allocated for as long as it is open: a prefill closes the
mappings of a decode that has sent no heartbeat for ``SGL_ATOM_PD_HEARTBEAT_TIMEOUT_MS``
(:meth:`IpcWriter.close`), and maps it again if it comes back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sgl_atom.disagg import wire
from sgl_atom.disagg.engine import TransferError, coalesce, poll, run_ends, run_spans, span_ends


class IpcError(RuntimeError):
    """A peer's buffers cannot be shared or mapped through CUDA IPC."""


def device_uuid(device: torch.device) -> str:
    """The UUID of a CUDA device, as torch reports it."""
    return str(torch.cuda.get_device_properties(device).uuid)


def local_device(uuid: str) -> int | None:
    """This process's index of the GPU with ``uuid``, or None (another host, or a GPU this
    process does not see)."""
    if not uuid or not torch.cuda.is_available():
        return None
    for i in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", i)) == uuid:
            return i
    return None


def export_regions(tensors: Sequence[torch.Tensor]) -> tuple[str, tuple[wire.CudaIpcRegion, ...]]:
    """(GPU UUID, each buffer as CUDA IPC shares it) for a consumer's region buffers, all on one
    CUDA device. Raises IpcError when they are not, or when torch cannot share one."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise IpcError(f"the regions are on {sorted(map(str, devices))}, not one CUDA device")
    out = []
    for i, t in enumerate(tensors):
        flat = t.reshape(-1).view(torch.uint8)
        try:
            fn, args = reduce_tensor(flat)
        except Exception as e:  # e.g. memory torch's caching allocator did not hand out
            raise IpcError(f"region {i}: torch cannot share its buffer: {e}") from e
        if fn is not rebuild_cuda_tensor:
            raise IpcError(f"region {i}: torch shares it by {fn.__name__}, not CUDA IPC")
        (_, size, _, offset, _, _, dev, handle, storage_bytes, storage_offset, _,
         ref_counter, ref_counter_offset, event, event_sync) = args  # fmt: skip
        out.append(
            wire.CudaIpcRegion(
                device=int(dev),
                handle=bytes(handle),
                storage_bytes=int(storage_bytes),
                storage_offset=int(storage_offset),
                offset=int(offset),
                nbytes=int(size[0]),
                ref_counter=bytes(ref_counter),
                ref_counter_offset=int(ref_counter_offset),
                event=bytes(event or b""),
                event_sync=bool(event_sync),
            )
        )
    return device_uuid(next(iter(devices))), tuple(out)


def open_region(r: wire.CudaIpcRegion, device: int) -> torch.Tensor:
    """A peer's shared buffer mapped into this process: flat uint8 of ``r.nbytes`` bytes."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if r.offset + r.nbytes > r.storage_bytes:
        raise IpcError(
            f"a shared buffer of {r.nbytes} B at byte {r.offset} overruns its storage "
            f"({r.storage_bytes} B)"
        )
    return rebuild_cuda_tensor(
        torch.Tensor,
        (r.nbytes,),
        (1,),
        r.offset,
        torch.storage.TypedStorage,
        torch.uint8,
        device,
        r.handle,
        r.storage_bytes,
        r.storage_offset,
        False,
        r.ref_counter,
        r.ref_counter_offset,
        r.event or None,
        r.event_sync,
    )


def open_peer(hs: wire.Handshake) -> list[torch.Tensor] | None:
    """A consumer's region buffers mapped here (same order as its regions), or None when it
    shares none or its GPU is not one of this process's. Raises IpcError when mapping fails or a
    mapping disagrees with the sizes the handshake declares."""
    if not hs.ipc_regions:
        return None
    if len(hs.ipc_regions) != len(hs.regions) or len(hs.region_bytes) != len(hs.regions):
        raise IpcError(
            f"{len(hs.ipc_regions)} shared buffers and {len(hs.region_bytes)} sizes for "
            f"{len(hs.regions)} regions"
        )
    device = local_device(hs.device_uuid)
    if device is None:
        return None
    mapped = []
    for i, (r, n) in enumerate(zip(hs.ipc_regions, hs.region_bytes, strict=True)):
        if r.nbytes != n:
            raise IpcError(f"region {i}: shared as {r.nbytes} B, declared as {n} B")
        try:
            mapped.append(open_region(r, device))
        except IpcError:
            raise
        except Exception as e:
            raise IpcError(f"region {i}: mapping it failed: {e}") from e
    return mapped


@dataclass
class IpcWrite:
    """One posted batch of copies into a peer: its event, size and state (PROC, DONE, ERR)."""

    peer: str
    spans: int
    nbytes: int
    event: torch.cuda.Event | None
    state: str = "PROC"


@dataclass
class _Buffers:
    """Flat uint8 buffers of one side, their addresses and sizes, and the lowest of them (the
    base the copy kernel addresses every span from)."""

    tensors: list[torch.Tensor]
    ptr: np.ndarray
    nbytes: np.ndarray
    base: torch.Tensor

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> _Buffers:
        flat = [t.reshape(-1).view(torch.uint8) for t in tensors]
        ptr = np.array([t.data_ptr() for t in flat], dtype=np.int64)
        nbytes = np.array([t.numel() for t in flat], dtype=np.int64)
        return cls(flat, ptr, nbytes, flat[int(np.argmin(ptr))])


class IpcWriter:
    """A producer's copies into the consumer pools it mapped, on one CUDA stream of its own
    (CPU buffers, as in tests, are copied at once)."""

    def __init__(self, sources: Sequence[torch.Tensor]):
        self.src = _Buffers.of(sources)
        self.device = sources[0].device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._peers: dict[str, _Buffers] = {}
        self._lock = threading.Lock()  # mapping and closing (heartbeat thread) vs writing
        if self.stream is not None:  # compile the copy kernel now, not at the first request
            from sgl_atom.kernels.kv_transfer import copy_spans

            scratch = torch.zeros(64, dtype=torch.uint8, device=self.device)
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                copy_spans([(scratch, scratch, np.array([[0, 32, 32]], dtype=np.int64))])
            self.stream.synchronize()

    def add(self, peer: str, mapped: list[torch.Tensor]) -> None:
        with self._lock:
            self._peers[peer] = _Buffers.of(mapped)

    def has(self, peer: str) -> bool:
        return peer in self._peers

    def peers(self) -> list[str]:
        return list(self._peers)

    def close(self, peer: str) -> bool:
        """Drop the mappings of ``peer`` (after any write to it has landed); whether it had
        any."""
        with self._lock:
            mapped = self._peers.pop(peer, None)
            if mapped is not None and self.stream is not None:
                self.stream.synchronize()
        return mapped is not None

    def write(
        self,
        peer: str,
        items: Sequence[tuple[np.ndarray, int, int]] = (),
        pages: tuple[np.ndarray, Sequence[tuple[int, int, int]]] | None = None,
    ) -> IpcWrite:
        """Copy into ``peer``'s mapped buffers, in one launch on this writer's stream:

        - ``pages``: (runs, regions): every region (producer index, consumer index, page bytes,
          the same on both sides) copies the page runs of
          :func:`sgl_atom.disagg.engine.page_runs`;
        - ``items``: (spans (src offset, dst offset, bytes), producer index, consumer index)
          for regions whose pages differ between the sides (head cuts, other page sizes).

        Every span is checked against both buffers before anything is copied. The KV of a chunk
        is complete when SGLang hands the chunk over (its forward's outputs have been read), so
        the copies need not wait for the scheduler's streams."""
        from sgl_atom.kernels.kv_transfer import copy_addressed

        with self._lock:
            dst = self._peers.get(peer)
            if dst is None:
                raise TransferError(f"CUDA IPC: no mapping of peer {peer!r}")
            src_abs, dst_abs, lens = [], [], []
            if pages is not None and len(pages[0]) and len(pages[1]):
                runs = np.asarray(pages[0], dtype=np.int64).reshape(-1, 3)
                si, di, pb = np.asarray(pages[1], dtype=np.int64).reshape(-1, 3).T
                _check_runs(runs, si, di, pb, self.src, dst, peer)
                s_abs, d_abs, n_bytes = run_spans(runs, self.src.ptr[si], dst.ptr[di], pb)
                src_abs.append(s_abs)
                dst_abs.append(d_abs)
                lens.append(n_bytes)
            for spans, si, di in items:
                rows = coalesce(np.asarray(spans, dtype=np.int64).reshape(-1, 3))
                _check(rows, self.src.tensors[si], dst.tensors[di], peer, si, di)
                src_abs.append(self.src.ptr[si] + rows[:, 0])
                dst_abs.append(dst.ptr[di] + rows[:, 1])
                lens.append(rows[:, 2])
            if not lens:
                return IpcWrite(peer, 0, 0, None, "DONE")
            s_off = np.concatenate(src_abs) - self.src.base.data_ptr()
            d_off = np.concatenate(dst_abs) - dst.base.data_ptr()
            n = np.concatenate(lens)
            if self.stream is None:
                nbytes = copy_addressed(self.src.base, dst.base, s_off, d_off, n)
                return IpcWrite(peer, len(n), nbytes, None, "DONE")
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                nbytes = copy_addressed(self.src.base, dst.base, s_off, d_off, n)
                event = torch.cuda.Event()
                event.record(self.stream)
        return IpcWrite(peer, len(n), nbytes, event)

    def wait(
        self,
        handle: IpcWrite,
        timeout_s: float = 30.0,
        abandon: Callable[[], str | None] | None = None,
    ) -> None:
        """Poll until the copies have landed: TransferError after ``timeout_s`` or as soon as
        ``abandon()`` names a reason (asked every ~10 ms)."""
        event = handle.event
        stopped = poll(lambda: event is None or event.query(), timeout_s, abandon)
        handle.state = "DONE" if stopped is None else "ERR"
        if stopped is not None:
            timed_out, why = stopped
            raise TransferError(
                f"CUDA IPC copies of {handle.nbytes} B into {handle.peer} still running after "
                f"{timeout_s} s"
                if timed_out
                else f"CUDA IPC copies into {handle.peer} abandoned: {why}"
            )


def _check_runs(
    runs: np.ndarray,
    si: np.ndarray,
    di: np.ndarray,
    pb: np.ndarray,
    src: _Buffers,
    dst: _Buffers,
    peer: str,
) -> None:
    src_end, dst_end = run_ends(runs, pb, f"CUDA IPC -> {peer}")
    for what, end, bufs, idx, side in (
        ("read", src_end, src, si, "region r"),
        ("write", dst_end, dst, di, "the peer's region "),
    ):
        over = np.flatnonzero(end > bufs.nbytes[idx])
        if len(over):
            k = int(over[0])
            raise TransferError(
                f"CUDA IPC -> {peer}: pages {what} up to byte {int(end[k])} of {side}"
                f"{int(idx[k])} ({int(bufs.nbytes[idx[k]])} B)"
            )


def _check(
    rows: np.ndarray, src: torch.Tensor, dst: torch.Tensor, peer: str, si: int, di: int
) -> None:
    if len(rows) == 0:
        return
    end, dst_end = span_ends(rows, f"CUDA IPC -> {peer}")
    if end > src.numel():
        raise TransferError(
            f"CUDA IPC -> {peer}: spans read up to byte {end} of region r{si} ({src.numel()} B)"
        )
    if dst_end > dst.numel():
        raise TransferError(
            f"CUDA IPC -> {peer}: spans write up to byte {dst_end} of the peer's region {di} "
            f"({dst.numel()} B)"
        )
