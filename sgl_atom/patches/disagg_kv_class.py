"""``get_kv_class`` answers for sgl_atom's transfer backends.

SGLang 0.5.23 picks a backend's KV manager, sender, receiver and bootstrap server in an if/elif
chain (``disaggregation/utils.get_kv_class``) with no registry. An AROUND hook answers the
backends declared with :func:`add_classes` and passes every other backend to the original.
Ledger: ``sgl_atom.patches.LEDGER``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import register_once

TARGET = "sglang.srt.disaggregation.utils.get_kv_class"

# backend value -> {KVClassType value: zero-arg loader of the class}
_CLASSES: dict[str, dict[str, Callable[[], type]]] = {}


def add_classes(backend: str, loaders: dict[str, Callable[[], type]]) -> None:
    """Declare the classes of ``backend``: keys are KVClassType values ("manager", ...)."""
    _CLASSES[backend] = dict(loaders)


def kv_class_with_sgl_atom_backends(
    original: Callable[..., Any], transfer_backend: Any, class_type: Any, *a: Any, **kw: Any
) -> Any:
    """AROUND hook: KVARGS stays SGLang's; a declared backend's roles come from its loaders."""
    loaders = _CLASSES.get(getattr(transfer_backend, "value", None))
    kind = getattr(class_type, "value", None)
    if loaders is None or kind == "kvargs":
        return original(transfer_backend, class_type, *a, **kw)
    loader = loaders.get(kind)
    if loader is None:
        raise ValueError(
            f"transfer backend {transfer_backend.value!r} has no {kind} class "
            f"(it provides: {', '.join(sorted(loaders))})"
        )
    return loader()


def install() -> None:
    register_once(TARGET, kv_class_with_sgl_atom_backends, "around")
