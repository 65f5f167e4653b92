"""Real SGLang servers on 127.0.0.1 in CPU reference mode, over tiny checkpoints.

Servers are expensive (30-75 s to start on two cores): share them through module fixtures,
keep prompts few and short. Every server a test starts goes through ``servers`` so it is
stopped by PID at teardown, also when the test fails.
"""

from __future__ import annotations

import os

import pytest
from e2e_utils import BASE_ARGS, pytest_runtest_logreport, pytest_terminal_summary, report  # noqa: F401 (hook, fixture)

from sgl_atom.cpu_mode import cache_dir
from sgl_atom.testing import tiny
from sgl_atom.testing.server import ServerPool

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny.build(cache_dir() / "tiny" / "llama", "llama")


@pytest.fixture(scope="session")
def reference_outputs() -> dict:
    """Greedy outputs shared between modules, keyed by configuration."""
    return {}


@pytest.fixture(scope="module")
def servers():
    # Servers share two cores: one intra-op thread each, or torch's OpenMP workers of one
    # server spin while another's run and every forward crawls (P/D rounds of 16 prompts
    # took 15-80 s instead of 2 s).
    pool = ServerPool(BASE_ARGS, {"OMP_NUM_THREADS": "1"})
    yield pool
    pool.stop_all()
