"""sgl_atom's own CLI flags on SGLang's parser.

SGLang 0.5.23 builds its parser from ServerArgs fields and offers no API for new flags, so an
AFTER hook on ``ServerArgs.add_cli_args`` adds the flags registered here with :func:`add_flag`.
Their values do not become ServerArgs fields; ``patches.prepare_server_args`` carries them.
Ledger: ``sgl_atom.patches.LEDGER``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from . import register_once

TARGET = "sglang.srt.server_args.ServerArgs.add_cli_args"


@dataclass(frozen=True)
class Flag:
    name: str  # "--spec-decode-kv-cache-dtype"
    dest: str
    choices: tuple[str, ...] | None
    help: str


FLAGS: dict[str, Flag] = {}


def add_flag(flag: Flag) -> None:
    """Declare a flag (idempotent for the same flag; a different one under a used name raises)."""
    old = FLAGS.get(flag.name)
    if old is not None and old != flag:
        raise ValueError(f"sgl_atom flag {flag.name} declared twice, differently")
    FLAGS[flag.name] = flag


def add_flags(parser: argparse.ArgumentParser) -> None:
    for f in FLAGS.values():
        parser.add_argument(f.name, dest=f.dest, type=str, choices=f.choices, help=f.help)


def add_cli_args_with_sgl_atom_flags(result, parser: argparse.ArgumentParser, *a, **kw) -> None:
    """AFTER hook: SGLang's flags are in ``parser``; add ours."""
    add_flags(parser)


def install() -> None:
    register_once(TARGET, add_cli_args_with_sgl_atom_flags, "after")
