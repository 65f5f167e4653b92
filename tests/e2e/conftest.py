"""Real SGLang servers on 127.0.0.1 in CPU reference mode, over tiny checkpoints.

Servers are expensive (30-75 s to start on two cores): share them through module fixtures,
keep prompts few and short. Every server a test starts goes through ``servers`` so it is
stopped by PID at teardown, also when the test fails.
"""

from __future__ import annotations

import os

import pytest
from e2e_utils import BASE_ARGS

from sgl_atom.cpu_mode import cache_dir
from sgl_atom.testing import tiny
from sgl_atom.testing.server import Server

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

    def start(self, model, args=(), **kw) -> Server:
        srv = Server(model, [*BASE_ARGS, *args], **kw)
        self.started.append(srv)
        return srv.start()

    def stop_all(self) -> None:
        for srv in self.started:
            srv.stop()
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
