"""Carry sgl_atom's CLI flags from the command line to the ServerArgs record.

``ServerArgs.from_cli_args`` copies known fields only, so the values of the flags added by
``patches.cli_args`` are dropped. An AFTER hook on ``prepare_server_args`` re-reads them from
``argv`` into ``server_args._sgl_atom_cli`` (a ``{dest: value}`` dict of the flags given);
``_``-prefixed attributes that are not fields ride along when ServerArgs is pickled to the
scheduler processes. Ledger: ``sgl_atom.patches.LEDGER``.
"""

from __future__ import annotations

import argparse

from . import cli_args, register_once

TARGET = "sglang.srt.server_args.prepare_server_args"
ATTR = "_sgl_atom_cli"


def parse_flags(argv: list[str]) -> dict[str, str]:
    """The sgl_atom flags given in ``argv`` (omitted ones left out)."""
    # abbreviations as SGLang's parser accepts them (it already refused ambiguous ones)
    parser = argparse.ArgumentParser(add_help=False)
    cli_args.add_flags(parser)
    ns, _ = parser.parse_known_args(list(argv))
    return {k: v for k, v in vars(ns).items() if v is not None}


def cli_values(server_args) -> dict[str, str]:
    return dict(getattr(server_args, ATTR, None) or {})


def record_sgl_atom_flags(server_args, argv, *a, **kw):
    """AFTER hook: store the sgl_atom flags of ``argv`` on the returned record."""
    setattr(server_args, ATTR, parse_flags(argv))
    return server_args


def install() -> None:
    register_once(TARGET, record_sgl_atom_flags, "after")
