"""Register the ``atom`` P/D transfer backend with SGLang (called from the plugin's register()).

Through SGLang's API: ``add_disagg_transfer_backend_choices`` puts ``atom`` on the CLI. Where
SGLang has no API, three small patches installed by ``sgl_atom.patches.install`` (see
``sgl_atom.patches.LEDGER``); this module declares the value and classes they answer: the closed
``TransferBackend`` Enum answers ``"atom"``, ``get_kv_class`` answers atom's classes, and the
KV pool behind the transfer buffers is recorded so each rank can describe its live pool.
"""

from __future__ import annotations

BACKEND = "atom"


def _loader(name: str):
    def load() -> type:
        from sgl_atom.disagg import conn

        return getattr(conn, name)

    return load


def register() -> list[str]:
    """Idempotent; returns the names of what was registered."""
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )

    from sgl_atom.patches import disagg_backend_enum, disagg_kv_class

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    disagg_backend_enum.add_backend(BACKEND)
    disagg_kv_class.add_classes(
        BACKEND,
        {
            "manager": _loader("AtomKVManager"),
            "sender": _loader("AtomKVSender"),
            "receiver": _loader("AtomKVReceiver"),
            "bootstrap_server": _loader("AtomKVBootstrapServer"),
        },
    )
    return [f"disagg_transfer_backend:{BACKEND}"]
