"""sgl_atom's own command-line flags: declared here by the features that own them, added to
SGLang's parser by ``patches.cli_args`` and carried to the schedulers by
``patches.prepare_server_args`` (SGLang 0.5.23 has no API for either). Features read a value
with :func:`cli_values`; this module imports neither SGLang nor the patches.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

ATTR = "_sgl_atom_cli"  # on ServerArgs: {dest: value} of the flags given


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
    """Add every declared flag to ``parser``."""
    for f in FLAGS.values():
        parser.add_argument(f.name, dest=f.dest, type=str, choices=f.choices, help=f.help)


def parse_flags(argv: list[str]) -> dict[str, str]:
    """The sgl_atom flags given in ``argv`` (omitted ones left out)."""
    # abbreviations as SGLang's parser accepts them (it already refused ambiguous ones)
    parser = argparse.ArgumentParser(add_help=False)
    add_flags(parser)
    ns, _ = parser.parse_known_args(list(argv))
    return {k: v for k, v in vars(ns).items() if v is not None}


def cli_values(server_args) -> dict[str, str]:
    """The sgl_atom flags recorded on a ServerArgs (``patches.prepare_server_args``)."""
    return dict(getattr(server_args, ATTR, None) or {})
