"""The sgl_atom logger."""

from __future__ import annotations

import logging

from . import envs

_configured = False


def get_logger(name: str = "sgl_atom") -> logging.Logger:
    global _configured
    logger = logging.getLogger(name if name.startswith("sgl_atom") else f"sgl_atom.{name}")
    if not _configured:
        root = logging.getLogger("sgl_atom")
        root.setLevel(envs.SGL_ATOM_LOG_LEVEL.get().upper())
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(
                logging.Formatter("[%(asctime)s sgl_atom] %(message)s", "%H:%M:%S")
            )
            root.addHandler(handler)
            root.propagate = False
        _configured = True
    return logger
