"""Real SGLang servers on 127.0.0.1 in CPU reference mode, over tiny checkpoints.

Servers are expensive (30-75 s to start on two cores): share them through module fixtures,
keep prompts few and short. Every server a test starts goes through ``servers`` so it is
stopped by PID at teardown, also when the test fails.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from e2e_utils import BASE_ARGS

from sgl_atom.cpu_mode import cache_dir
from sgl_atom.testing import tiny
from sgl_atom.testing.server import Server, ServerStartError

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny.build(cache_dir() / "tiny" / "llama", "llama")


class ServerPool:
    def __init__(self):
        self.started: list[Server] = []

    def start(self, model, args=(), timeout: float | None = None, **kw) -> Server:
        """Start a server; once more on a fresh port if another process took its port first
        (servers starting side by side each pick free ports for their own sockets)."""
        # Servers share two cores: one intra-op thread each, or torch's OpenMP workers of one
        # server spin while another's run and every forward crawls (P/D rounds of 16 prompts
        # took 15-80 s instead of 2 s).
        kw["env"] = {"OMP_NUM_THREADS": "1", **(kw.get("env") or {})}
        for attempt in (1, 2):
            srv = Server(model, [*BASE_ARGS, *args], **kw)
            self.started.append(srv)
            try:
                return srv.start(timeout)
            except ServerStartError:
                srv.stop()
                if attempt == 2 or "address already in use" not in srv.log_text():
                    raise
        raise AssertionError("unreachable")

    def start_many(self, jobs: dict[str, tuple], timeout: float | None = None) -> dict[str, Server]:
        """Start servers side by side: ``{name: (model, args, env)}`` -> ``{name: Server}``."""
        with ThreadPoolExecutor(len(jobs)) as ex:
            futs = {
                name: ex.submit(self.start, model, args, timeout, env=env, name=name)
                for name, (model, args, env) in jobs.items()
            }
            return {name: f.result() for name, f in futs.items()}

    def stop_all(self) -> None:
        """Stop every server side by side (a P/D server can take its whole SIGTERM grace)."""
        with ThreadPoolExecutor(max(1, len(self.started))) as ex:
            list(ex.map(lambda srv: srv.stop(), self.started))
        for srv in self.started:
            assert srv.proc is None or srv.proc.poll() is not None, f"{srv.name} still running"


_REPORT: list[str] = []


@pytest.fixture(scope="session")
def report():
    """Record a measured figure; all of them are printed at the end of the run."""
    return _REPORT.append


def pytest_terminal_summary(terminalreporter):
    if _REPORT:
        terminalreporter.section("sgl_atom e2e figures")
        for line in _REPORT:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def reference_outputs() -> dict:
    """Greedy outputs shared between modules, keyed by configuration."""
    return {}


@pytest.fixture(scope="module")
def servers():
    pool = ServerPool()
    yield pool
    pool.stop_all()
