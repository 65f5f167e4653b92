"""SGLang's prefill/decode router (``sglang-router``) as a process on 127.0.0.1.

Started in its own process group and stopped by PID (the whole group), like
:class:`sgl_atom.testing.server.Server`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from .server import ServerStartError, free_port


def router_command(
    prefills: list[tuple[str, int]], decodes: list[str], port: int, metrics_port: int
) -> list[str]:
    """``python -m sglang_router.launch_router --pd-disaggregation ...`` bound to 127.0.0.1."""
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for url, bootstrap_port in prefills:
        cmd += ["--prefill", url, str(bootstrap_port)]
    for url in decodes:
        cmd += ["--decode", url]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    return cmd


class Router:
    """One PD router in front of prefill servers (URL, bootstrap port) and decode servers."""

    def __init__(self, prefills: list[tuple[str, int]], decodes: list[str], name: str = "router"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        self.cmd = router_command(prefills, decodes, self.port, free_port())
        self.log_path = Path(tempfile.mkstemp(prefix=f"sgl_atom-{name}-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> Router:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"{self.name} exited with code {self.proc.returncode}:\n{self.log_tail()}"
                )
            if self._healthy():
                return self
            time.sleep(1.0)
        self.stop()
        raise ServerStartError(f"{self.name} not healthy after {timeout:.0f}s:\n{self.log_tail()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, TimeoutError):
            return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def post(self, path: str, payload: dict, timeout: float = 300) -> dict:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass
