"""sgl_atom's own CLI flags on SGLang's parser.

SGLang 0.5.23 builds its parser from ServerArgs fields and offers no API for new flags, so an
AFTER hook on ``ServerArgs.add_cli_args`` adds the flags declared in :mod:`sgl_atom.cli_flags`.
Their values do not become ServerArgs fields; ``patches.prepare_server_args`` carries them.
Ledger: ``sgl_atom.patches.LEDGER``.
"""

from __future__ import annotations

import argparse

from ..cli_flags import add_flags
from . import register_once

TARGET = "sglang.srt.server_args.ServerArgs.add_cli_args"


def add_cli_args_with_sgl_atom_flags(result, parser: argparse.ArgumentParser, *a, **kw) -> None:
    """AFTER hook: SGLang's flags are in ``parser``; add ours."""
    add_flags(parser)


def install() -> None:
    register_once(TARGET, add_cli_args_with_sgl_atom_flags, "after")
