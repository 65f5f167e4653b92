"""What the GPU server tier needs, checked once for every module of it."""

from __future__ import annotations

import importlib.util

import torch


def server_tier_missing() -> str | None:
    """Why the server tier cannot run here (None when it can)."""
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    if importlib.util.find_spec("sglang") is None:
        return "needs SGLang 0.5.23 (on the lent H200: source .gpu/device-env.sh)"
    return None
