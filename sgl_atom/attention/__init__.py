"""The ``atom`` attention backend: paged attention over SGLang's token pool with our Triton
kernels, bf16 or fp8 KV with one scale per (token, KV head)."""

from __future__ import annotations

BACKEND_NAME = "atom"


def register() -> list[str]:
    """Add ``atom`` to SGLang's attention-backend registry and CLI choices."""
    from sglang.srt.arg_groups.choices import add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )

    add_attention_backend_choices([BACKEND_NAME])
    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(create_atom_backend)
    return [f"attention_backend:{BACKEND_NAME}"]


def create_atom_backend(model_runner):
    """SGLang's factory signature: ``fn(model_runner) -> AttentionBackend``."""
    from .backend import AtomAttnBackend

    return AtomAttnBackend(model_runner)
