"""Unit tests run on CPU; Triton kernels run in Triton's interpreter when no CUDA device exists.

TRITON_INTERPRET must be set before triton is first imported (sglang imports it too), so it is
set here, before any unit test module is collected.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
