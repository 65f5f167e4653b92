"""Serve sgl_atom's MiniMax-M3 model on the bare atom backend, without SGLang's M3 wrapper.

For any ``MiniMaxM3Sparse*`` architecture SGLang 0.5.23 wraps the chosen attention backend in
``MiniMaxHybridAttnBackend`` next to a ``MiniMaxSparseAttnBackend`` of its own, whose metadata
it prepares on every step. sgl_atom's model class runs its sparse layers through the atom
backend's ``forward_sparse`` and never calls that sparse backend, so the wrapper only costs a
second backend (its construction asserts, per-step metadata, CUDA-graph state). When the loaded
model says it serves its sparse layers itself (``SERVES_SPARSE_ON_ATOM``) and the backend is
atom, the wrapper is skipped; SGLang's own M3 class and every other model are wrapped as before.
Ledger: ``sgl_atom.patches.LEDGER``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..log import get_logger
from . import register_once

TARGET = "sglang.srt.layers.attention.attention_registry.attn_backend_wrapper"
MODEL_FLAG = "SERVES_SPARSE_ON_ATOM"
logger = get_logger("sgl_atom.patches")


def serves_sparse_on_atom(runner: Any, backend: Any) -> bool:
    """True when the runner's model runs its sparse layers on this (atom) backend itself."""
    from ..attention.backend import AtomAttnBackend

    model = getattr(runner, "model", None)
    return isinstance(backend, AtomAttnBackend) and bool(getattr(model, MODEL_FLAG, False))


def wrap_unless_atom_serves_sparse(
    original: Callable[..., Any], runner: Any, full_attn_backend: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND hook: return the atom backend unwrapped for sgl_atom's M3 model."""
    if serves_sparse_on_atom(runner, full_attn_backend):
        logger.info(
            "%s serves its sparse layers on the atom backend: SGLang's "
            "MiniMaxHybridAttnBackend wrapper is not used",
            type(runner.model).__name__,
        )
        return full_attn_backend
    return original(runner, full_attn_backend, *args, **kwargs)


def install() -> None:
    register_once(TARGET, wrap_unless_atom_serves_sparse, "around")
