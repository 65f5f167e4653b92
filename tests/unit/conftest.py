"""Unit tests run on CPU; Triton kernels run in Triton's interpreter when no CUDA device exists.

TRITON_INTERPRET must be set before triton is first imported (sglang imports it too), so it is
set here, before any unit test module is collected.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for the module (float64 reference loops: steadier on a shared host)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
