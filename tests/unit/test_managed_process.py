"""The e2e tests' process manager (`sgl_atom.testing.server.ManagedProcess`) against a small
HTTP server in a child process: health wait, JSON round trip, HTTP errors with their status and
body, start-up failure with the log's tail, and stop by process group."""

from __future__ import annotations

import sys

import pytest
import requests

from sgl_atom.testing.server import ManagedProcess, ServerStartError, free_port

CHILD = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class H(BaseHTTPRequestHandler):
    def _send(self, code, body):
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send(200 if self.path == "/health" else 404, "ok")

    def do_POST(self):
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/echo":
            self._send(200, json.dumps({"got": payload, "pid": __import__("os").getpid()}))
        else:
            self._send(400, json.dumps({"error": f"bad field {payload.get('field')!r}"}))

    def log_message(self, *a):
        pass

print("child listening", flush=True)
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.fixture
def child():
    port = free_port()
    proc = ManagedProcess([sys.executable, "-c", CHILD, str(port)], None, port, "child")
    yield proc
    proc.stop()


def test_start_post_error_and_stop(child):
    child.start(timeout=30)
    payload = {"ids": [3, 1, 4], "text": "é"}
    out = child.post("/echo", payload)
    assert out["got"] == payload
    with pytest.raises(requests.HTTPError) as err:
        child.post("/refuse", {"field": "top_k"})
    assert err.value.response.status_code == 400
    assert "bad field 'top_k'" in err.value.response.text
    assert child.get("/nowhere").status_code == 404
    assert "child listening" in child.log_text()
    child.stop()
    assert child.proc.poll() is not None
    assert _gone(out["pid"])  # the server itself, not only the process we started


def test_exit_during_start_up_raises_with_the_log_tail():
    port = free_port()
    cmd = [sys.executable, "-c", "print('cannot serve: no model'); raise SystemExit(3)"]
    proc = ManagedProcess(cmd, None, port, "broken")
    with pytest.raises(ServerStartError, match="exited with code 3") as err:
        proc.start(timeout=30)
    assert "cannot serve: no model" in str(err.value)
    assert err.value.process is proc and proc.proc.poll() == 3


BROKEN = "print('cannot serve: no model'); raise SystemExit(3)"


@pytest.fixture
def pool(monkeypatch):
    """A ServerPool whose "servers" are the small HTTP child (model "good") or a child that
    exits at start-up (model "broken")."""
    from sgl_atom.testing import server

    def fake_server(model, args, env=None, name="server"):
        port = free_port()
        code = [CHILD, str(port)] if model == "good" else [BROKEN]
        return ManagedProcess([sys.executable, "-c", *code], None, port, name)

    monkeypatch.setattr(server, "Server", fake_server)
    pool = server.ServerPool()
    yield pool
    pool.stop_all()


def test_start_many_returns_refused_servers_with_why(pool):
    jobs = {"a": ("good", [], {}), "b": ("broken", [], {}), "c": ("good", [], {})}
    got = pool.start_many(jobs, timeout=30, refused=["b"])
    assert got["a"]._healthy() and got["c"]._healthy()
    assert got["a"].start_error is None
    assert "exited with code 3" in got["b"].start_error
    assert "cannot serve: no model" in got["b"].log_text()


def test_start_many_fails_on_an_unexpected_refusal_or_an_unexpected_start(pool):
    with pytest.raises(ServerStartError, match="exited with code 3"):
        pool.start_many({"a": ("good", [], {}), "b": ("broken", [], {})}, timeout=30)
    with pytest.raises(AssertionError, match="a started instead of refusing"):
        pool.start_many({"a": ("good", [], {})}, timeout=30, refused=["a"])
    assert pool.started[-1].proc.poll() is not None  # stopped, not left serving
    with pytest.raises(AssertionError, match="refused names no job"):
        pool.start_many({"a": ("good", [], {})}, timeout=30, refused=["z"])


def test_a_server_that_ignores_sigterm_is_killed_with_its_children(monkeypatch):
    """Past the SIGTERM grace the whole tree goes (SGLang's kill_process_tree), children too,
    and the log names each thread's state at that moment."""
    monkeypatch.setenv("SGL_ATOM_STOP_GRACE", "1")
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "c = subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
        "print('child', c.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    port = free_port()
    proc = ManagedProcess([sys.executable, "-c", code], None, port, "stubborn")
    proc.health_path = "/never"
    with pytest.raises(ServerStartError):
        proc.start(timeout=3)  # never healthy: start() stops it on the way out
    assert proc.proc.poll() is not None
    log = proc.log_text()
    child = int(log.split("child ")[1].split()[0])
    assert _gone(child)
    note = log[log.index("[sgl_atom.testing] stubborn") :].splitlines()
    assert f"pid {proc.proc.pid}: not stopped 1s after SIGTERM" in note[0]
    states = {int(line.split()[0].split("/")[0]) for line in note[1:]}
    assert states == {proc.proc.pid, child}  # both processes of the group, one line a thread


def _gone(pid: int) -> bool:
    """Ended: no such process, or a zombie waiting for a reaper (its parent was killed)."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


ROUTERISH = r"""
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

port, marker = int(sys.argv[1]), sys.argv[2]
if not os.path.exists(marker):  # the first process hangs before a word
    open(marker, "w").close()
    time.sleep(3600)

class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = {"stats": {"prefill_count": 1, "decode_count": 1}} if self.path == "/workers" else {}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass

print("router listening", flush=True)
HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_a_router_that_hangs_at_start_is_started_once_more(tmp_path):
    from sgl_atom.testing.router import Router

    router = Router([("http://127.0.0.1:1", 2)], ["http://127.0.0.1:3"])
    router.cmd = [sys.executable, "-c", ROUTERISH, str(router.port), str(tmp_path / "first")]
    try:
        router.start(timeout=5)
        assert "router listening" in router.log_text()
        assert router.log_path.with_suffix(".first.log").exists()
    finally:
        router.stop()
    assert router.proc.poll() is not None


def test_a_server_that_cannot_bind_its_port_fails_at_once_and_is_stopped():
    """Another process holds the port; the child logs the bind failure and lingers instead of
    exiting (as SGLang's processes can): start-up fails now, naming the port, not at the
    timeout, and the child is stopped (ServerPool then starts once more on a fresh port)."""
    import socket
    import time

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    code = (
        "import socket, time\n"
        "s = socket.socket()\n"
        f"try:\n    s.bind(('127.0.0.1', {port}))\n"
        "except OSError as e:\n    print('ERROR:', e, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = ManagedProcess([sys.executable, "-c", code], None, port, "taken")
    t0 = time.time()
    try:
        with pytest.raises(ServerStartError, match=f"could not bind port {port}"):
            proc.start(timeout=120)
        assert time.time() - t0 < 30
        assert proc.proc.poll() is not None
    finally:
        proc.stop()
        holder.close()


def test_free_ports_are_distinct_and_outside_the_ranges_other_sockets_take(monkeypatch):
    """Ports handed out for servers started side by side: each bindable, none twice, none
    where a bind to port 0 or SGLang's NCCL-port pick could take it first; a port another
    process holds is passed over."""
    import socket

    from sgl_atom.testing import server

    ephemeral_low = server._ephemeral_low()
    held = []
    try:
        ports = [free_port() for _ in range(64)]
        assert len(set(ports)) == len(ports)
        for port in ports:
            assert port < ephemeral_low and not 22000 <= port <= 29999
            s = socket.socket()
            s.bind(("127.0.0.1", port))
            held.append(s)
        # a two-port range whose first port is held elsewhere (not handed out): the second
        low = next(p for p in range(20000, 21990, 2) if not {p, p + 1} & server._HANDED_OUT)
        holder = socket.socket()
        holder.bind(("127.0.0.1", low))
        held.append(holder)
        monkeypatch.setattr(server, "FREE_PORT_RANGE", (low, low + 1))
        assert free_port() == low + 1
    finally:
        for s in held:
            s.close()
