"""CUDA IPC writes of the atom P/D backend between two processes on one GPU: a child process
shares its buffers (`sgl_atom.disagg.ipc.export_regions`), this one maps them and writes spans
with `IpcWriter`; the child's bytes are then checked against the spans applied on the host.
Run on the GPU machine: `python -m pytest -q tests/gpu/test_ipc_gpu.py`."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SIZES = (1 << 20, 3 << 16)
CHILD = f"""
import hashlib, json, sys, torch
from pydantic import TypeAdapter
from sgl_atom.disagg import ipc, wire
bufs = [torch.full((n,), 7, dtype=torch.uint8, device="cuda") for n in {SIZES!r}]
uuid, shared = ipc.export_regions(bufs)
ta = TypeAdapter(tuple[wire.CudaIpcRegion, ...])
print(json.dumps({{"uuid": uuid, "regions": ta.dump_python(shared, mode="json")}}), flush=True)
sys.stdin.readline()  # the parent has written
torch.cuda.synchronize()
print(json.dumps([hashlib.sha256(b.cpu().numpy().tobytes()).hexdigest() for b in bufs]))
"""


def test_ipc_writes_land_in_another_process(report):
    from pydantic import TypeAdapter

    from sgl_atom.disagg import ipc, wire
    from sgl_atom.disagg.engine import TransferError

    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        head = json.loads(child.stdout.readline())
        shared = TypeAdapter(tuple[wire.CudaIpcRegion, ...]).validate_python(head["regions"])
        device = ipc.local_device(head["uuid"])
        assert device == torch.cuda.current_device()
        mapped = [ipc.open_region(r, device) for r in shared]
        assert [m.numel() for m in mapped] == list(SIZES)
        gen = torch.Generator().manual_seed(5)
        src = torch.randint(0, 256, (1 << 21,), dtype=torch.uint8, generator=gen)
        writer = ipc.IpcWriter([src.cuda()])
        writer.add("child", mapped)
        # page-like spans into both buffers, distinct destinations
        rows0 = np.array([[4096 * i, 8192 * i + 64, 4096] for i in range(100)], dtype=np.int64)
        rows1 = np.array([[1 << 20, 16, 3 << 15]], dtype=np.int64)
        h = writer.write("child", [(rows0, 0, 0), (rows1, 0, 1)])
        writer.wait(h, timeout_s=10)
        assert h.state == "DONE" and h.nbytes == 100 * 4096 + (3 << 15)
        with pytest.raises(TransferError, match="write up to byte"):  # past the child's buffer
            writer.write("child", [(np.array([[0, SIZES[1] - 8, 16]]), 0, 1)])
        assert writer.close("child") and not writer.has("child")
        del mapped
        child.stdin.write("go\n")
        child.stdin.flush()
        got = json.loads(child.stdout.readline())
    finally:
        child.kill()
        child.wait()
    want = [np.full(n, 7, dtype=np.uint8) for n in SIZES]
    s = src.numpy()
    for rows, w in ((rows0, want[0]), (rows1, want[1])):
        for a, b, n in rows.tolist():
            w[b : b + n] = s[a : a + n]
    assert got == [hashlib.sha256(w.tobytes()).hexdigest() for w in want]
    report("GPU CUDA IPC: spans written into another process's buffers land byte-exact")
