"""``TransferBackend("atom")``: SGLang's closed transfer-backend Enum learns the atom value.

SGLang 0.5.23 turns ``--disaggregation-transfer-backend`` into ``TransferBackend(value)`` in the
scheduler, the tokenizer and the bootstrap service; the Enum has no registration API. An AROUND
hook on ``TransferBackend._missing_`` (Enum's lookup of last resort) answers the values declared
with :func:`add_backend` with one pseudo-member each and leaves every other value to the
original. Ledger: ``sgl_atom.patches.LEDGER``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import register_once

TARGET = "sglang.srt.disaggregation.utils.TransferBackend._missing_"

_MEMBERS: dict[str, Any] = {}


def add_backend(value: str) -> Any:
    """The TransferBackend member for ``value``, created once (same object in every lookup)."""
    from sglang.srt.disaggregation.utils import TransferBackend

    member = _MEMBERS.get(value)
    if member is None:
        member = object.__new__(TransferBackend)
        member._name_ = value.upper()
        member._value_ = value
        _MEMBERS[value] = member
    return member


def missing_with_sgl_atom_backends(original: Callable[[Any], Any], value: Any) -> Any:
    """AROUND hook: a declared value resolves to its member; anything else as before."""
    member = _MEMBERS.get(value) if isinstance(value, str) else None
    return member if member is not None else original(value)


def install() -> None:
    register_once(TARGET, missing_with_sgl_atom_backends, "around")
