"""Fail start-up when SGLang did not apply a hook sgl_atom registered.

SGLang 0.5.23's ``load_plugins()`` runs every plugin, then ``HookRegistry.apply_hooks()``, which
logs a target it cannot patch and carries on: the server would then run without, say, the
transfer backend's class lookup. Every SGLang process calls ``runtime_context.publish()`` right
after ``load_plugins()`` (launcher/tokenizer, scheduler, detokenizer, DP controller), so a
BEFORE hook there runs :func:`sgl_atom.patches.verify_applied`, which raises naming each target
that is not wrapped. Ledger: ``sgl_atom.patches.LEDGER``.
"""

from __future__ import annotations

from typing import Any

from ..log import get_logger
from . import register_once, verify_applied

TARGET = "sglang.srt.runtime_context.publish"
logger = get_logger("sgl_atom.patches")


def check_hooks_applied(*args: Any, **kwargs: Any) -> None:
    """BEFORE hook: raise before the process publishes its config if a hook is missing."""
    targets = verify_applied()
    logger.info("sgl_atom hooks applied: %d targets wrapped (%s)", len(targets), kwargs.get("role"))


def install() -> None:
    register_once(TARGET, check_hooks_applied, "before")
