"""One request through a P/D pair as SGLang's PD router sends it, without the router: the same
payload, with the bootstrap fields, posted to the prefill and the decode server at once.

Tests and the server benchmark use it where the router binary is absent (the GPU machine) or
where a request must reach one pair directly.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import requests

from sgl_atom.testing.server import Server


def prefill_args(bootstrap_port: int) -> list[str]:
    """Server flags of a prefill server on the atom transfer backend."""
    return [
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-transfer-backend",
        "atom",
        "--disaggregation-bootstrap-port",
        str(bootstrap_port),
    ]


def decode_args(cpu: bool) -> list[str]:
    """Server flags of a decode server on the atom transfer backend. On CPU the decode keeps
    retracted KV in CPU tensors (SGLang's default host pool for it needs CUDA)."""
    args = ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "atom"]
    if cpu:
        args += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    return args


def bootstrap_fields(port: int, room: int, host: str = "127.0.0.1") -> dict[str, Any]:
    """The fields the router adds so the decode server finds the prefill's KV."""
    return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}


def error_text(e: Exception) -> str:
    """An exception of a request as text, with the server's answer body when it sent one."""
    body = e.response.text if isinstance(e, requests.HTTPError) else ""
    return f"{e} {body}"


class PDRequest:
    """``payload`` + bootstrap fields posted to ``prefill`` and ``decode`` on two threads;
    :meth:`join` gives ``{"p": ..., "d": ...}``, each the JSON answer or the error text, and
    ``seconds["d"]`` the time until the decode answered."""

    def __init__(
        self,
        prefill: Server,
        decode: Server,
        payload: dict[str, Any],
        bootstrap_port: int,
        room: int,
        timeout: float = 120,
    ):
        self.payload = {**payload, **bootstrap_fields(bootstrap_port, room)}
        self.out: dict[str, Any] = {}
        self.seconds: dict[str, float] = {}
        self._threads = [
            threading.Thread(target=self._go, args=(key, srv, timeout), daemon=True)
            for key, srv in (("p", prefill), ("d", decode))
        ]
        self._t0 = time.perf_counter()
        for t in self._threads:
            t.start()

    def _go(self, key: str, srv: Server, timeout: float) -> None:
        try:
            self.out[key] = srv.post("/generate", self.payload, timeout=timeout)
        except Exception as e:  # the error is the result here
            self.out[key] = error_text(e)
        self.seconds[key] = time.perf_counter() - self._t0

    def join(self, timeout: float | None = 120) -> dict[str, Any]:
        for t in self._threads:
            t.join(timeout)
        return self.out
