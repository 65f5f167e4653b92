"""GPU tier: kernels at realistic sizes and real SGLang servers on a CUDA device.

Every test here is marked ``gpu``. Kernel modules need torch and Triton only; the server tier
also needs SGLang 0.5.23 (on the lent H200: ``source .gpu/device-env.sh``, see README.md "On a
GPU"). Where either is missing the tests are skipped with that reason, never silently.
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "e2e"))  # e2e_utils: the same helpers
from e2e_utils import pytest_runtest_logreport, pytest_terminal_summary, report  # noqa: E402, F401 (hook, fixture)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="module")
def gpu_servers():
    """Servers of one module on the GPU, each stopped by PID at teardown."""
    from sgl_atom.testing.server import ServerPool

    pool = ServerPool(["--sampling-backend", "pytorch", "--sleep-on-idle"])
    yield pool
    pool.stop_all()
