"""Kernel unit tests run on CPU through Triton's interpreter when no CUDA device exists.

TRITON_INTERPRET must be set before triton is first imported, so this runs at collection time.
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "triton was imported before tests/unit/kernels/conftest.py could set "
            "TRITON_INTERPRET=1; run the kernel tests with TRITON_INTERPRET=1"
        )
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `from helpers import ...`
