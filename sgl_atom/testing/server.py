"""Start and stop real SGLang servers (CPU reference mode here, GPU where there is one).

Used by the demo and the e2e tests. A server is started in its own process group and stopped
by PID (the whole group), also when a test fails. A server that exits during start-up raises
:class:`ServerStartError` carrying the tail of SGLang's own log, instead of hanging.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from .. import envs
from ..launch_server import server_command

# what uvicorn (and the OS, capitalised) log when another process holds the port: compared in
# lower case
BIND_FAILED = "address already in use"


class ServerStartError(RuntimeError):
    """A managed process that exited, or never answered its health check, during start-up;
    ``process`` is that (stopped) process, its log still readable."""

    def __init__(self, message: str, process: ManagedProcess | None = None):
        super().__init__(message)
        self.process = process


# ports handed out by free_port in this process, each promised to one socket-to-be
_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()
# free_port's range: under the kernel's ephemeral range (where bind to port 0 and outgoing
# connections take theirs) and under SGLang's own pick for its NCCL port (22000-29999)
FREE_PORT_RANGE = (12000, 21999)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a process started later to bind; never the same
    port twice in one process.

    The port is released before its owner binds it, so it is taken where no other socket of
    a server starting alongside can land in between: not from the ephemeral range, where
    every ``bind(0)`` (gloo, ZMQ, a transfer engine) and outgoing connection of those servers
    takes its port, and not from SGLang's NCCL-port range."""
    low, high = FREE_PORT_RANGE
    high = min(high, _ephemeral_low() - 1)
    with _HANDED_OUT_LOCK:
        for port in random.sample(range(low, high + 1), min(256, max(0, high - low + 1))):
            if port in _HANDED_OUT:
                continue
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
        # a machine whose ephemeral range starts low: the kernel's pick, as a last resort
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        _HANDED_OUT.add(port)
        return port


def plugins_without_sgl_atom() -> str:
    """An SGLANG_PLUGINS allow-list holding every installed plugin except sgl_atom."""
    from importlib.metadata import entry_points

    names = [ep.name for ep in entry_points(group="sglang.srt.plugins") if ep.name != "sgl_atom"]
    return ",".join(names) or "none"


def process_group_states(pgid: int) -> list[str]:
    """One line per thread of process group ``pgid``: pid/tid, state and kernel wait channel,
    read from /proc (empty where there is no /proc)."""
    lines = []
    for proc in sorted(Path("/proc").glob("[0-9]*"), key=lambda d: int(d.name)):
        try:
            if os.getpgid(int(proc.name)) != pgid:
                continue
            cmd = " ".join((proc / "cmdline").read_bytes().decode(errors="replace").split())[:80]
            for task in sorted(proc.glob("task/[0-9]*"), key=lambda d: int(d.name)):
                stat = (task / "stat").read_text()
                name, state = stat[stat.index("(") + 1 : stat.rindex(")")], stat.rsplit(")")[1][1]
                wchan = (task / "wchan").read_text() or "-"
                lines.append(f"  {proc.name}/{task.name} {state} {wchan} {name} :: {cmd}")
        except (OSError, ValueError, IndexError):
            continue
    return lines


class ManagedProcess:
    """A command on 127.0.0.1 with an HTTP health endpoint, in its own process group, its
    output in a log file; ``start`` waits for health, ``stop`` ends the whole group."""

    health_path = "/health"
    health_timeout = 5.0

    def __init__(self, cmd: list[str], env: dict[str, str] | None, port: int, name: str):
        self.cmd, self.env = cmd, env
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.name = name
        self.log_path = Path(tempfile.mkstemp(prefix=f"sgl_atom-{name}-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None
        self.start_error: str | None = None  # why start-up failed, when a pool expected it to

    def start(self, timeout: float | None = None):
        timeout = timeout or envs.SGL_ATOM_SERVER_TIMEOUT.get()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"{self.name} exited with code {self.proc.returncode} during start-up. "
                    f"Its log said:\n{self.log_tail()}",
                    self,
                )
            if self._healthy():
                return self
            if BIND_FAILED in self.log_text().lower():
                # another process took the port first; the server's other processes may linger
                # instead of exiting, so stop it now rather than wait out the timeout
                self.stop()
                raise ServerStartError(
                    f"{self.name} could not bind port {self.port}:\n{self.log_tail()}", self
                )
            time.sleep(1.0)
        self.stop()
        raise ServerStartError(
            f"{self.name} not healthy after {timeout:.0f}s:\n{self.log_tail()}", self
        )

    def _healthy(self) -> bool:
        try:
            return self.get(self.health_path, timeout=self.health_timeout).status_code == 200
        except requests.RequestException:
            return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str, timeout: float = 30) -> requests.Response:
        """GET ``path``; the response whatever its status."""
        return requests.get(self.url + path, timeout=timeout)

    def post(self, path: str, payload: dict, timeout: float = 900) -> dict:
        """POST ``payload`` as JSON; the decoded JSON answer, or ``requests.HTTPError`` (its
        ``response`` holds the status and body) for a status of 400 or more."""
        r = requests.post(self.url + path, json=payload, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        """End the whole process group: SIGTERM, then SIGKILL after ``SGL_ATOM_STOP_GRACE``
        seconds, then wait for the kernel to reap it. A process still not reaped a minute
        after SIGKILL (a thread stuck in the kernel) is left to the kernel with a warning in
        its log naming each thread's state: it holds no port a later server asks for, and
        failing the next test for it would hide that test's own result."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            self.proc.wait(timeout=60)
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=envs.SGL_ATOM_STOP_GRACE.get())
            return
        self._note(f"not stopped {envs.SGL_ATOM_STOP_GRACE.get():.0f}s after SIGTERM")
        # SGLang's own: SIGKILL to every descendant, reaped before it returns; then the group,
        # for any process that left the tree
        from sglang.srt.utils import kill_process_tree

        with contextlib.suppress(RuntimeError):
            kill_process_tree(self.proc.pid, wait_timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._note("not reaped 60s after SIGKILL; left to the kernel")

    def _note(self, what: str) -> None:
        """Append ``what`` (and each of the group's threads' states) to the log file."""
        lines = [f"[sgl_atom.testing] {self.name} pid {self.proc.pid}: {what}"]
        lines += process_group_states(self.proc.pid)
        with contextlib.suppress(OSError), open(self.log_path, "a") as log:
            log.write("\n".join(lines) + "\n")

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# A managed server is stopped on purpose: SGLang's crash diagnostics (5 s of sleep, then py-spy
# on every scheduler still alive) would only delay each stop, past its grace on a busy host.
QUIET_STOP_ENV = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}


class Server(ManagedProcess):
    """One ``sglang.launch_server`` process on 127.0.0.1 (without SGLang's crash diagnostics
    at stop, unless ``env`` asks for them)."""

    health_path = "/health_generate"
    health_timeout = 30.0

    def __init__(
        self,
        model_path: str | Path,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        with_plugin: bool = True,
        port: int | None = None,
        name: str = "server",
    ):
        port = port or free_port()
        argv = ["--model-path", str(model_path), "--host", "127.0.0.1", "--port", str(port)]
        argv += list(args or [])
        cmd, full_env = server_command(argv)
        full_env.update(QUIET_STOP_ENV)
        full_env.update(env or {})
        if not with_plugin:
            full_env["SGLANG_PLUGINS"] = plugins_without_sgl_atom()
        super().__init__(cmd, full_env, port, name)

    def generate(self, prompts: list[str], max_new_tokens: int = 16, **extra) -> list[dict]:
        """Greedy generation for a batch of prompts through /generate."""
        params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
        out = self.post("/generate", {"text": prompts, "sampling_params": params, **extra})
        return out if isinstance(out, list) else [out]


class ServerPool:
    """The servers of a test module (or a benchmark): started with shared base arguments and
    environment, each stopped by PID at the end, also when a test fails."""

    def __init__(self, base_args: list[str] | tuple = (), base_env: dict[str, str] | None = None):
        self.base_args = list(base_args)
        self.base_env = dict(base_env or {})
        self.started: list[Server] = []

    def start(self, model, args=(), timeout: float | None = None, **kw) -> Server:
        """Start a server; once more on a fresh port if another process took its port first
        (servers starting side by side each pick free ports for their own sockets)."""
        kw["env"] = {**self.base_env, **(kw.get("env") or {})}
        for attempt in (1, 2):
            srv = Server(model, [*self.base_args, *args], **kw)
            self.started.append(srv)
            try:
                return srv.start(timeout)
            except ServerStartError:
                srv.stop()
                if attempt == 2 or BIND_FAILED not in srv.log_text().lower():
                    raise
        raise AssertionError("unreachable")

    def start_many(
        self,
        jobs: dict[str, tuple],
        timeout: float | None = None,
        refused: Collection[str] = (),
    ) -> dict[str, Server]:
        """Start servers side by side: ``{name: (model, args, env)}`` -> ``{name: Server}``.

        The servers named in ``refused`` must fail start-up: each comes back stopped, with
        ``start_error`` holding why (one that starts is stopped and fails the call)."""

        def one(name: str, model, args, env) -> Server:
            try:
                srv = self.start(model, args, timeout, env=env, name=name)
            except ServerStartError as e:
                if name not in refused or e.process is None:
                    raise
                e.process.start_error = str(e)
                return e.process
            if name in refused:
                srv.stop()
                raise AssertionError(f"{name} started instead of refusing:\n{srv.log_tail()}")
            return srv

        unknown = set(refused) - set(jobs)
        assert not unknown, f"refused names no job: {sorted(unknown)}"
        with ThreadPoolExecutor(len(jobs)) as ex:
            futs = {
                name: ex.submit(one, name, model, args, env)
                for name, (model, args, env) in jobs.items()
            }
            return {name: f.result() for name, f in futs.items()}

    def stop_all(self) -> None:
        """Stop every server of the pool side by side."""
        stop_many(self.started)


def stop_many(procs: Collection[ManagedProcess]) -> None:
    """Stop processes side by side (a P/D server can take its whole SIGTERM grace)."""
    with ThreadPoolExecutor(max(1, len(procs))) as ex:
        list(ex.map(lambda p: p.stop(), procs))
