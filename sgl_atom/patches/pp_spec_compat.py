"""SGLang's pipeline-parallel argument check lets ``ATOM_DSPARK`` through to its own rules.

SGLang 0.5.23's ``check_pipeline_parallel_compat`` asserts that a speculative algorithm under
``--pp-size`` > 1 is its DSPARK or EAGLE; a registered algorithm has no say. The AROUND hook
runs the original with the speculative algorithm hidden when it is ``ATOM_DSPARK``, so every
other PP check (overlap schedule off, no --min-free-slots-delay) still runs, and leaves the
algorithm's own PP rules to ``AtomDSparkAlgo.handle_server_args``
(:func:`sgl_atom.speculative.dspark.algorithm.check_pipeline_parallel`: P/D prefill only).
Every other algorithm goes to the original unchanged. Ledger: ``sgl_atom.patches.LEDGER``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import register_once

TARGET = "sglang.srt.arg_groups.validation_hook.check_pipeline_parallel_compat"
ALGORITHM = "ATOM_DSPARK"


class _WithoutSpeculation:
    """The server args as SGLang's PP check reads them, with no speculative algorithm."""

    def __init__(self, cfg: Any) -> None:
        self._cfg = cfg

    speculative_algorithm = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cfg, name)


def pp_compat_with_atom_dspark(original: Callable[[Any], Any], cfg: Any) -> Any:
    """AROUND hook: ``ATOM_DSPARK`` passes SGLang's PP check as if there were no draft."""
    if cfg.speculative_algorithm != ALGORITHM:
        return original(cfg)
    return original(_WithoutSpeculation(cfg))


def install() -> None:
    register_once(TARGET, pp_compat_with_atom_dspark, "around")
