"""CPU mode: model-parallel groups on the gloo backend never use PyNccl.

Ledger: see ``sgl_atom.patches.LEDGER`` (target
``sglang.srt.distributed.parallel_state.init_model_parallel_group``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from . import register_once

TARGET = "sglang.srt.distributed.parallel_state.init_model_parallel_group"


def gloo_groups_without_pynccl(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND hook: with ``backend == "gloo"`` force ``use_pynccl=False``; else call as is."""
    bound = inspect.signature(original).bind_partial(*args, **kwargs)
    if bound.arguments.get("backend") == "gloo":
        bound.arguments["use_pynccl"] = False
        return original(*bound.args, **bound.kwargs)
    return original(*args, **kwargs)


def install() -> None:
    register_once(TARGET, gloo_groups_without_pynccl, "around")
