"""Carry sgl_atom's CLI flags from the command line to the ServerArgs record.

``ServerArgs.from_cli_args`` copies known fields only, so the values of the flags added by
``patches.cli_args`` are dropped. An AFTER hook on ``prepare_server_args`` re-reads them from
``argv`` into ``server_args._sgl_atom_cli`` (``cli_flags.ATTR``: a ``{dest: value}`` dict of the
flags given); ``_``-prefixed attributes that are not fields ride along when ServerArgs is
pickled to the scheduler processes. Ledger: ``sgl_atom.patches.LEDGER``.
"""

from __future__ import annotations

from ..cli_flags import ATTR, parse_flags
from . import register_once

TARGET = "sglang.srt.server_args.prepare_server_args"


def record_sgl_atom_flags(server_args, argv, *a, **kw):
    """AFTER hook: store the sgl_atom flags of ``argv`` on the returned record."""
    setattr(server_args, ATTR, parse_flags(argv))
    return server_args


def install() -> None:
    register_once(TARGET, record_sgl_atom_flags, "after")
