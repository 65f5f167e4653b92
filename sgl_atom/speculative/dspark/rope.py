"""The DSpark draft's rotary embedding: ``rope_theta`` and ``rope_scaling`` of its config.

The draft rotates its q and k heads as the checkpoint was trained: neox-style (rotate-half)
over the whole head, with the config's ``rope_scaling`` (or transformers' ``rope_parameters``)
applied to the frequencies: none / ``default``, ``linear``, ``llama3`` and ``yarn``, the
parameters and defaults SGLang's ``get_rope`` reads for the same types (so the draft's positions
mean what the target's mean). Another scaling type, or a parameter of none of these, is refused
when the config is read: silently rotating with plain frequencies would draft garbage.

The served draft rotates with SGLang's ``get_rope`` module for the checked scaling
(:meth:`RopeScaling.to_hf`); the tables here are the float64 test oracle's, checked against
``get_rope``'s caches in the tests.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

SCALING_TYPES = ("default", "linear", "llama3", "yarn")
# the parameters each type reads (besides rope_type / type, and rope_theta, which transformers'
# rope_parameters carries beside them)
_PARAMS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "extrapolation_factor",
        "attn_factor",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
}
_IGNORED = ("rope_type", "type", "rope_theta")


@dataclass(frozen=True)
class RopeScaling:
    """A checked ``rope_scaling``; fields a type does not read stay None."""

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    extrapolation_factor: float | None = None
    attn_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None

    def to_hf(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _number(name: str, v: Any, *, integer: bool = False, positive: bool = True) -> float:
    kind = int if integer else (int, float)
    if isinstance(v, bool) or not isinstance(v, kind) or (positive and v <= 0):
        what = "an integer" if integer else "a number"
        raise ValueError(f"{name} {what}{' > 0' if positive else ''}, got {v!r}")
    return v


def parse_rope_scaling(value: Any) -> RopeScaling | None:
    """A config's ``rope_scaling`` (or ``rope_parameters``) dict, checked; None for no scaling.
    Raises ValueError naming what is expected."""
    if value is None:
        return None
    if isinstance(value, RopeScaling):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"a dict with rope_type one of {', '.join(SCALING_TYPES)}, or null")
    kind = value.get("rope_type", value.get("type", "default"))
    if kind not in _PARAMS:
        raise ValueError(
            f"rope_type one of {', '.join(SCALING_TYPES)} (the ones the DSpark draft "
            f"implements), got {kind!r}"
        )
    if unknown := sorted(set(value) - set(_PARAMS[kind]) - set(_IGNORED)):
        raise ValueError(f"only {', '.join(_PARAMS[kind]) or 'no parameters'} for {kind}: "
                         f"{', '.join(unknown)} not implemented")  # fmt: skip
    if kind == "default":
        return None
    args: dict[str, Any] = {}
    for name in _PARAMS[kind]:
        v = value.get(name)
        if v is None and name != "factor":
            continue
        if name == "truncate":
            if not isinstance(v, bool):
                raise ValueError(f"truncate true or false, got {v!r}")
            args[name] = v
        else:
            integer = name == "original_max_position_embeddings"
            positive = name not in ("extrapolation_factor", "attn_factor")
            args[name] = _number(name, v, integer=integer, positive=positive)
    return RopeScaling(rope_type=kind, **args)


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None, max_position: int):
    """[head_dim // 2] float64 rotation frequencies (CPU)."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    base = 1.0 / theta**exps
    if scaling is None:
        return base
    factor = float(scaling.factor)
    if scaling.rope_type == "linear":
        return base / factor
    original = scaling.original_max_position_embeddings or max_position
    if scaling.rope_type == "llama3":
        low = scaling.low_freq_factor if scaling.low_freq_factor is not None else 1.0
        high = scaling.high_freq_factor if scaling.high_freq_factor is not None else 4.0
        wavelen = 2 * math.pi / base
        smooth = (original / wavelen - low) / (high - low) if high != low else 0 * base
        mid = (1 - smooth) * base / factor + smooth * base
        low_band = torch.where(wavelen > original / low, base / factor, mid)
        return torch.where(wavelen < original / high, base, low_band)
    # yarn
    fast = scaling.beta_fast if scaling.beta_fast is not None else 32
    slow = scaling.beta_slow if scaling.beta_slow is not None else 1

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_of(fast), dim_of(slow)
    if scaling.truncate is not False:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    extrapolation = scaling.extrapolation_factor
    keep = (1 - ramp) * (1.0 if extrapolation is None else extrapolation)
    return base / factor * (1 - keep) + base * keep


def _yarn_mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def magnitude(scaling: RopeScaling | None) -> float:
    """The factor YaRN puts on cos and sin (1 for the other types)."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.mscale is not None and scaling.mscale_all_dim is not None:
        scale = _yarn_mscale(scaling.factor, scaling.mscale) / _yarn_mscale(
            scaling.factor, scaling.mscale_all_dim
        )
    else:
        scale = _yarn_mscale(scaling.factor)
    return scale * (1.0 if scaling.attn_factor is None else scaling.attn_factor)


def tables(cfg, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) float64 [len(positions), head_dim] of ``cfg`` (a DSparkDraftConfig) at
    ``positions``, on their device, in rotate-half layout (each half's angles twice)."""
    freq = inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    ang = positions.to(torch.float64)[:, None] * freq.to(positions.device)[None, :]
    scale = magnitude(cfg.rope_scaling)
    cos, sin = ang.cos() * scale, ang.sin() * scale
    return torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
