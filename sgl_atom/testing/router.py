"""SGLang's prefill/decode router (``sglang-router``) as a process on 127.0.0.1.

Started in its own process group and stopped by PID (the whole group), like
:class:`sgl_atom.testing.server.Server`.
"""

from __future__ import annotations

import sys

import requests

from .server import ManagedProcess, ServerStartError, free_port


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
    """One PD router in front of prefill servers (URL, bootstrap port) and decode servers.

    The router answers ``/health`` before it has registered its workers (registration runs in
    the background); until then it answers requests with 503 "No prefill workers available".
    So ``start`` waits for ``/readiness`` and for every given worker to be listed in ``/workers``.
    """

    health_path = "/readiness"

    def __init__(self, prefills: list[tuple[str, int]], decodes: list[str], name: str = "router"):
        port = free_port()
        super().__init__(router_command(prefills, decodes, port, free_port()), None, port, name)
        self.expected = {"prefill_count": len(prefills), "decode_count": len(decodes)}

    def _healthy(self) -> bool:
        if not super()._healthy():
            return False
        try:
            stats = self.get("/workers", timeout=self.health_timeout).json().get("stats", {})
        except (requests.RequestException, ValueError):
            return False
        return all(stats.get(k) == n for k, n in self.expected.items())

    def start(self, timeout: float | None = 150.0) -> Router:
        """Start and wait for the workers to be listed; once more if the first process is not
        ready in ``timeout`` (one router on two loaded cores wrote no line in 120 s while its
        --help takes 13 s there): its log is kept beside the second's."""
        try:
            return super().start(timeout)
        except ServerStartError as first:
            if "exited with code" in str(first):  # a crash: a second start would crash too
                raise
            failed_log = self.log_path.with_suffix(".first.log")
            self.log_path.replace(failed_log)
            try:
                return super().start(timeout)
            except ServerStartError as second:
                raise ServerStartError(
                    f"{second}\n(the first attempt, {failed_log}: {first})", self
                ) from second
