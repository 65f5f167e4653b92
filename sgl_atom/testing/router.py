"""SGLang's prefill/decode router (``sglang-router``) as a process on 127.0.0.1.

Started in its own process group and stopped by PID (the whole group), like
:class:`sgl_atom.testing.server.Server`.
"""

from __future__ import annotations

import sys

from .server import ManagedProcess, free_port


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


class Router(ManagedProcess):
    """One PD router in front of prefill servers (URL, bootstrap port) and decode servers."""

    def __init__(self, prefills: list[tuple[str, int]], decodes: list[str], name: str = "router"):
        port = free_port()
        super().__init__(router_command(prefills, decodes, port, free_port()), None, port, name)

    def start(self, timeout: float | None = 120.0) -> Router:
        return super().start(timeout)
