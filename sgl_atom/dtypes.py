"""The one table of the dtypes sgl_atom names: torch's name, bytes per element, short name.

Callers spell a dtype three ways: torch's name (``bfloat16``, ``torch.float8_e4m3fn``), SGLang's
CLI spelling (``bf16``, ``fp8_e4m3``) and sgl_atom's short name (``bf16``/``fp8``, the draft KV
option's vocabulary). Each caller refuses an unknown spelling in its own words; nothing here
raises. Nothing here imports torch or SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Dtype:
    torch_name: str  # torch's name without "torch."
    element_bytes: int
    short: str  # sgl_atom's short name
    spellings: tuple[str, ...] = ()  # other names SGLang's CLI and configs use for it


DTYPES: tuple[Dtype, ...] = (
    Dtype("bfloat16", 2, "bf16", ("bfloat16",)),
    Dtype("float16", 2, "fp16", ("half",)),
    Dtype("float32", 4, "fp32"),
    Dtype("float8_e4m3fn", 1, "fp8", ("fp8_e4m3",)),
    Dtype("float8_e5m2", 1, "fp8_e5m2"),
    Dtype("uint8", 1, "uint8"),
    Dtype("int8", 1, "int8"),
)
_BY_TORCH = {d.torch_name: d for d in DTYPES}
_BY_SPELLING = {s: d for d in DTYPES for s in (d.short, *d.spellings)}

ELEMENT_BYTES: dict[str, int] = {d.torch_name: d.element_bytes for d in DTYPES}
FP8_TORCH_NAMES = frozenset({"float8_e4m3fn", "float8_e5m2"})


def torch_name(name: str) -> str | None:
    """torch's name for ``name`` spelled as torch (with or without ``torch.``) or as SGLang's
    CLI does; None when the table does not know it."""
    name = name.removeprefix("torch.")
    if name in _BY_TORCH:
        return name
    d = _BY_SPELLING.get(name)
    return d.torch_name if d is not None else None


def short_name(spelling: str) -> str | None:
    """The short name for a short name or an SGLang spelling (``bfloat16`` -> ``bf16``,
    ``fp8_e4m3`` -> ``fp8``); None otherwise (torch's fp8 names included)."""
    d = _BY_SPELLING.get(spelling)
    return d.short if d is not None else None


def short_of_torch(dtype: object) -> str | None:
    """The short name of a torch dtype or its ``str()`` (``torch.bfloat16`` -> ``bf16``)."""
    d = _BY_TORCH.get(str(dtype).removeprefix("torch."))
    return d.short if d is not None else None


def element_bytes(name: str) -> int:
    """Bytes per element of a dtype in any spelling the table knows (KeyError otherwise)."""
    t = torch_name(name)
    if t is None:
        raise KeyError(f"unknown dtype {name!r}; known: {', '.join(sorted(ELEMENT_BYTES))}")
    return ELEMENT_BYTES[t]
