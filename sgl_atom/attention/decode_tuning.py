"""Decode kernel tilings per device, as measured tuning files (the way SGLang ships its fused-MoE
Triton configs): which ``decode_fwd`` tiling the atom backend launches, and how many context
splits it plans, for bf16 and for fp8 KV.

A tuning file is JSON written by ``benchmarks/tune_decode.py --write-config``::

    {"device": "NVIDIA H200", "date": ..., "command": ...,
     "decode": {"bf16": {"block_n": 64, "num_warps": 4, "num_stages": 4, "waves": 2.0},
                "fp8": {...}}}

The backend reads ``SGL_ATOM_DECODE_TUNING`` (a path) when set, else the committed file of its
device under ``tuned/`` (``NVIDIA_H200.json``), else the launcher's built-in defaults. A file may
also carry a ``"verify"`` object of the same form (``benchmarks/tune_verify.py --write-config``):
the tiling of target-verify attention, whose tiles hold every draft token's query rows of a KV
head (20 rows for 5 tokens at GQA 4, against 4 for a decode); without it verify keeps the
launcher's defaults.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from .. import envs
from ..kernels.paged_attention.common import KV_MODES, kv_mode_id

TUNED_DIR = Path(__file__).resolve().parent / "tuned"
KV_KINDS = ("bf16", "fp8")
SECTIONS = ("decode", "verify")


class DecodeTuningError(ValueError):
    """A decode tuning file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class DecodeTuning:
    """One decode launch configuration; None leaves the launcher's default."""

    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    kv_mode: str | None = None  # fp8 KV: how K/V meet the dots (kernels' KV_MODES names)
    maxnreg: int | None = None  # registers per thread (more programs per SM, no spill wanted)
    waves: float = 2.0  # programs per SM that decode_num_splits plans for

    def kernel_kwargs(self) -> dict:
        """The ``decode_fwd`` tuning overrides (the launcher's defaults where None)."""
        kw = asdict(self)
        kw.pop("waves")
        return {k: v for k, v in kw.items() if v is not None}

    def describe(self) -> str:
        kw = self.kernel_kwargs()
        parts = [f"{k}={v}" for k, v in kw.items()] or ["launcher defaults"]
        return ", ".join(parts) + f", waves={self.waves:g}"


_CHECKS = {
    "block_n": lambda v: v in (16, 32, 64, 128, 256),
    "num_warps": lambda v: v in (1, 2, 4, 8, 16),
    "num_stages": lambda v: isinstance(v, int) and 1 <= v <= 8,
    "kv_mode": lambda v: v in KV_MODES,
    "maxnreg": lambda v: isinstance(v, int) and 32 <= v <= 255,
    "waves": lambda v: isinstance(v, (int, float)) and 0.25 <= v <= 64,
}


def parse(entry: dict, where: str) -> DecodeTuning:
    """A DecodeTuning from one kv kind's JSON object; DecodeTuningError names a bad field."""
    if not isinstance(entry, dict):
        raise DecodeTuningError(f"{where}: expected an object, got {type(entry).__name__}")
    known = {f.name for f in fields(DecodeTuning)}
    unknown = sorted(set(entry) - known)
    if unknown:
        raise DecodeTuningError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
    for key, value in entry.items():
        if value is not None and not _CHECKS[key](value):
            raise DecodeTuningError(f"{where}: {key}={value!r} is not a valid value")
    return DecodeTuning(**entry)


def device_file(device_name: str) -> Path:
    """The committed tuning file of a device name ("NVIDIA H200" -> tuned/NVIDIA_H200.json)."""
    return TUNED_DIR / (re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json")


def load(
    kv: str, device_name: str, path: str = "", section: str = "decode"
) -> tuple[DecodeTuning, str]:
    """(tuning, where it came from) for KV kind ``kv`` ("bf16" or "fp8") on ``device_name``:
    ``path`` when given (it must exist), else the device's committed file, else defaults.

    ``section`` is "decode" (the file must hold it) or "verify" (optional: a file without a
    "verify" object leaves the launcher's defaults, and says so)."""
    if kv not in KV_KINDS:
        raise ValueError(f"kv {kv!r} is not one of {KV_KINDS}")
    if section not in SECTIONS:
        raise ValueError(f"section {section!r} is not one of {SECTIONS}")
    if path:
        file = Path(path)
        if not file.is_file():
            raise DecodeTuningError(f"SGL_ATOM_DECODE_TUNING={path}: no such file")
    else:
        file = device_file(device_name)
        if not file.is_file():
            return DecodeTuning(), "built-in defaults"
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise DecodeTuningError(f"decode tuning file {file}: not JSON ({e})") from e
    entries = data.get(section) if isinstance(data, dict) else None
    if section == "verify" and entries is None:
        return DecodeTuning(), f"built-in defaults ({file} has no verify entry)"
    if not isinstance(entries, dict) or kv not in entries:
        raise DecodeTuningError(f"decode tuning file {file}: no {section!r} entry for {kv!r} KV")
    return parse(entries[kv], f"decode tuning file {file}, {section}.{kv}"), str(file)


def check_kv_mode(tuning: DecodeTuning, q_dtype: torch.dtype, source: str) -> None:
    """Refuse at start-up an fp8 ``kv_mode`` the model's dtype cannot take ("bits" needs a
    bf16 model), instead of at the first decode."""
    if tuning.kv_mode is None:
        return
    try:
        kv_mode_id(tuning.kv_mode, torch.empty(0, dtype=q_dtype))
    except ValueError as e:
        raise DecodeTuningError(f"decode tuning from {source}: {e}") from e


def for_device(
    section: str, fp8: bool, device: torch.device, q_dtype: torch.dtype
) -> tuple[DecodeTuning, str]:
    """(tuning, a line for the log) of ``section`` that the atom kernels launch on the CUDA
    ``device`` over bf16 or fp8 KV with ``q_dtype`` queries: ``SGL_ATOM_DECODE_TUNING``, else
    the device's committed file, else the launcher's defaults. An fp8 ``kv_mode`` that
    ``q_dtype`` cannot take is refused (DecodeTuningError naming the file)."""
    kv = "fp8" if fp8 else "bf16"
    name = torch.cuda.get_device_name(device)
    tuning, source = load(kv, name, envs.SGL_ATOM_DECODE_TUNING.get(), section)
    if fp8:
        check_kv_mode(tuning, q_dtype, source)
    return tuning, f"({kv} KV on {name}): {tuning.describe()}, from {source}"
