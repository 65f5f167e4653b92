"""The ``sglang.srt.plugins`` entry point: the one place that touches SGLang's registries.

SGLang calls :func:`register` once in every process it starts (launcher, engine, schedulers,
detokenizer). Features register through SGLang's APIs (attention backend, speculative
algorithm, transfer backend choice, resolution hook); every monkey-patch is installed by
:func:`sgl_atom.patches.install`, called only here. SGLang only logs a plugin that raises and
carries on without it, so a failure here is logged loudly at ERROR with the remedy, and
re-raised; a hook SGLang fails to apply fails start-up later (``patches.hooks_applied``).
"""

from __future__ import annotations

from . import cpu_mode
from .log import get_logger

logger = get_logger("sgl_atom.plugin")

_registered: list[str] | None = None


def registered() -> list[str]:
    """What :func:`register` registered in this process (empty before it ran)."""
    return list(_registered or [])


def register() -> list[str]:
    """Register sgl_atom with SGLang; idempotent. Returns the names of what was registered."""
    global _registered
    if _registered is not None:
        return list(_registered)
    try:
        names = _register_all()
    except Exception:
        logger.exception(
            "sgl_atom failed to register with SGLang; the server runs WITHOUT sgl_atom. "
            "Check that sglang==0.5.23 is installed (pip install -e . in this checkout)."
        )
        raise
    _registered = names
    logger.info("sgl_atom registered: %s", ", ".join(names) if names else "nothing")
    return list(names)


def _register_all() -> list[str]:
    from . import attention, patches
    from .disagg import backend as disagg_backend
    from .speculative import draft_kv_dtype
    from .speculative.dspark import algorithm as dspark_algorithm

    names = attention.register()
    names += draft_kv_dtype.register()
    names += disagg_backend.register()
    names.append(dspark_algorithm.register())
    names += patches.install()  # every HookRegistry hook, and only here
    if cpu_mode.cpu_mode_enabled():
        from . import cpu_spec_ops

        cpu_spec_ops.install()
        names.append("cpu_ops:speculative")
    return names
