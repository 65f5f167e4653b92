"""The DSpark draft's config, read from a draft checkpoint's ``config.json``.

Field names are the ones DeepSpec drafters (and SGLang's own DSpark reader) carry. A DSpark
field can sit in four places; the first one present wins, in this order:

1. the prefixed top-level key (``dspark_block_size``, ``dspark_target_layer_ids``,
   ``dspark_markov_rank``, ``dspark_markov_head_type``, ``dspark_noise_token_id``);
2. the nested ``dspark_config`` dict;
3. the nested ``dflash_config`` dict (published drafters keep block size, target layer ids and
   the mask token there);
4. the plain top-level key (``block_size``, ``target_layer_ids``, ``markov_rank``, ...).

Two places that both hold a field must agree, or the config is refused. Model-shape fields
(hidden size, heads, ...) come from ``text_config`` when there is one, else the top level.

:class:`DSparkDraftConfig` is a strict pydantic dataclass: no bool or float where an integer
belongs, no string where a number or a flag does, bounds declared on the fields. A refusal is a
:class:`DSparkConfigError` naming the key the value was read from and what is expected.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, fields
from typing import Annotated, Any

from pydantic import AfterValidator, ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass

from sgl_atom.speculative.dspark.rope import parse_rope_scaling

# Markov head types real drafters declare; only the vanilla head (W1 embedding, W2 projection)
# is implemented here.
KNOWN_MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
SUPPORTED_MARKOV_HEAD_TYPES = ("vanilla",)

# (prefixed key or None, key inside dspark_config / dflash_config / at the top level)
_DSPARK_KEYS = {
    "block_size": ("dspark_block_size", "block_size"),
    "target_layer_ids": ("dspark_target_layer_ids", "target_layer_ids"),
    "markov_rank": ("dspark_markov_rank", "markov_rank"),
    "markov_head_type": ("dspark_markov_head_type", "markov_head_type"),
    "mask_token_id": ("dspark_noise_token_id", "mask_token_id"),
    "num_target_layers": (None, "num_target_layers"),
    "enable_confidence_head": (None, "enable_confidence_head"),
    "confidence_head_with_markov": (None, "confidence_head_with_markov"),
    "sample_from_anchor": (None, "sample_from_anchor"),
}
# model-shape fields, read from text_config when there is one
_SHAPE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
)


class DSparkConfigError(ValueError):
    """A draft config.json field is missing or out of range; the message names it."""


Positive = Annotated[int, Field(ge=1)]
NonNegative = Annotated[int, Field(ge=0)]


def _increasing(ids: tuple[int, ...]) -> tuple[int, ...]:
    if any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
        raise ValueError("strictly increasing layer ids")
    return ids


def _head_type(kind: str) -> str:
    kind = kind.lower()
    if kind not in KNOWN_MARKOV_HEAD_TYPES:
        raise ValueError(f"one of {KNOWN_MARKOV_HEAD_TYPES}")
    if kind not in SUPPORTED_MARKOV_HEAD_TYPES:
        raise ValueError(f"one of {SUPPORTED_MARKOV_HEAD_TYPES} (the only head implemented)")
    return kind


@dataclass(frozen=True, config=ConfigDict(strict=True, extra="forbid"))
class DSparkDraftConfig:
    """What a DSpark draft checkpoint declares; every field is checked when one is built.

    ``block_size`` is k, the number of tokens one draft pass proposes; the verify pass reads
    k + 1 tokens (``speculative_num_draft_tokens`` = k + 1). ``target_layer_ids`` are HF-style
    ids: tap ``i`` is the output of target layer ``i`` (hidden_states[i + 1] in HF terms).
    """

    architecture: str
    hidden_size: Positive
    num_hidden_layers: Positive
    num_attention_heads: Positive
    num_key_value_heads: Positive
    head_dim: Positive
    intermediate_size: Positive
    vocab_size: Positive
    block_size: Positive
    # a JSON list is taken for the tuple (strict=False); its items stay strict
    target_layer_ids: Annotated[
        tuple[NonNegative, ...], Field(strict=False, min_length=1), AfterValidator(_increasing)
    ]
    num_target_layers: Positive | None
    mask_token_id: NonNegative
    markov_rank: Positive
    markov_head_type: Annotated[str, AfterValidator(_head_type)] = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = True
    sample_from_anchor: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # a checked rope_scaling (transformers' rope_parameters read alike); None: plain RoPE
    rope_scaling: Annotated[Any, AfterValidator(parse_rope_scaling)] = None
    max_position_embeddings: Positive = 32768
    target_hidden_size: Positive | None = None

    def __post_init__(self) -> None:
        """Relations between fields, once pydantic has checked each one."""
        if self.num_attention_heads % self.num_key_value_heads:
            _fail(
                "num_key_value_heads",
                self.num_key_value_heads,
                f"a divisor of num_attention_heads ({self.num_attention_heads})",
            )
        if self.mask_token_id >= self.vocab_size:
            _fail("mask_token_id", self.mask_token_id, f"in [0, vocab_size={self.vocab_size})")
        if self.markov_rank > self.vocab_size:
            _fail("markov_rank", self.markov_rank, f"<= vocab_size ({self.vocab_size})")
        ids, n = self.target_layer_ids, self.num_target_layers
        if n is not None and max(ids) >= n:
            _fail("dspark_target_layer_ids", list(ids), f"ids in [0, num_target_layers={n})")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def tap_hidden_size(self) -> int:
        """Width of one tap: the target's hidden size (the draft's when not declared)."""
        return self.target_hidden_size or self.hidden_size

    @property
    def query_len(self) -> int:
        """Rows of one draft pass: [anchor, MASK x (k-1)], or one more without anchor sampling."""
        return self.block_size if self.sample_from_anchor else self.block_size + 1

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> DSparkDraftConfig:
        """Parse and validate a draft checkpoint's config.json dict."""
        if not isinstance(d, dict):
            raise DSparkConfigError(f"draft config must be a dict, got {type(d).__name__}")
        text = d.get("text_config") or d
        if text is not d:  # DSpark fields may sit in either; the top level wins
            d = {**text, **{k: v for k, v in d.items() if k != "text_config"}}
        places = {"architecture": "architectures"}  # where each field was read, for errors
        raw = {"architecture": _architecture(d), "target_hidden_size": d.get("target_hidden_size")}
        raw |= {k: text.get(k) for k in _SHAPE_KEYS}
        places["rope_scaling"], raw["rope_scaling"] = _rope_lookup(text, raw)
        for field, keys in _DSPARK_KEYS.items():
            places[field], raw[field] = _dspark_lookup(d, keys)
        if raw["num_key_value_heads"] is None:
            raw["num_key_value_heads"] = raw["num_attention_heads"]
        if raw["head_dim"] is None:
            raw["head_dim"] = _quotient(raw["hidden_size"], raw["num_attention_heads"])
        # absent (or null): a field's default, else None, which validation names as required
        try:
            return cls(**{k: v for k, v in raw.items() if v is not None or k not in _DEFAULTED})
        except ValidationError as e:
            raise _refusal(e.errors()[0], places) from None

    def check_target(self, *, num_layers: int, hidden_size: int, vocab_size: int) -> None:
        """Refuse a target this draft cannot tap: tap ids, hidden width and vocab must fit."""
        if max(self.target_layer_ids) >= num_layers:
            _fail(
                "dspark_target_layer_ids",
                list(self.target_layer_ids),
                f"ids below the target's {num_layers} layers",
            )
        if self.tap_hidden_size != hidden_size:
            _fail("target_hidden_size", self.tap_hidden_size, f"the target's {hidden_size}")
        if self.vocab_size != vocab_size:
            _fail("vocab_size", self.vocab_size, f"the target's vocab_size {vocab_size}")

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict in DeepSpec's layout, DSpark keys in plain and prefixed spelling."""
        d = asdict(self)
        d["rope_scaling"] = self.rope_scaling.to_hf() if self.rope_scaling else None
        arch = d.pop("architecture")
        ids = list(d.pop("target_layer_ids"))
        out: dict[str, Any] = {"architectures": [arch], "model_type": "qwen3"}
        out.update({k: v for k, v in d.items() if v is not None})
        # Both spellings: SGLang's DFlash-family readers only see the plain one.
        out["dspark_target_layer_ids"] = out["target_layer_ids"] = ids
        return out


_DEFAULTED = frozenset(f.name for f in fields(DSparkDraftConfig) if f.default is not MISSING)
# how a refusal states what was expected, by pydantic error type
_EXPECTED = {
    "int_type": "an integer",
    "bool_type": "true or false",
    "float_type": "a number",
    "string_type": "a string",
    "tuple_type": "a non-empty list of target layer ids",
    "too_short": "a non-empty list of target layer ids",
}


def _fail(field: str, got: Any, expected: str) -> None:
    raise DSparkConfigError(f"DSpark draft config: {field}={got!r}, expected {expected}")


def _refusal(err: dict[str, Any], places: dict[str, str]) -> DSparkConfigError:
    """The config error for pydantic's first error, naming where the value was read."""
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, DSparkConfigError):  # a relation between fields (__post_init__)
        return cause
    field = str(err["loc"][0]) if err["loc"] else "?"
    if err["type"] == "greater_than_equal":
        expected = f"an integer >= {err['ctx']['ge']}"
    else:
        expected = _EXPECTED.get(err["type"]) or str(cause or err["msg"])
    got = err["input"]
    if got is None:
        expected += " (field is required)"
    return DSparkConfigError(
        f"DSpark draft config: {places.get(field, field)}={got!r}, expected {expected}"
    )


def _rope_lookup(text: dict, raw: dict) -> tuple[str, Any]:
    """(where, value) of the RoPE scaling: ``rope_scaling``, else transformers'
    ``rope_parameters`` (whose ``rope_theta`` stands in for a missing top-level one)."""
    params = text.get("rope_parameters")
    if isinstance(params, dict) and raw.get("rope_theta") is None:
        raw["rope_theta"] = params.get("rope_theta")
    if text.get("rope_scaling") is not None:
        return "rope_scaling", text["rope_scaling"]
    return "rope_parameters", params


def _architecture(d: dict) -> Any:
    archs = d.get("architectures")
    if not isinstance(archs, list) or not archs:
        _fail("architectures", archs, "a non-empty list naming the draft class")
    return archs[0]


def _quotient(hidden: Any, heads: Any) -> Any:
    """hidden // heads, the default head_dim. Where they are no numbers, None: validation
    names hidden_size or num_attention_heads first, as they come first."""
    try:
        return hidden // heads
    except (TypeError, ZeroDivisionError):
        return None


def _dspark_lookup(d: dict, keys: tuple) -> tuple[str, Any]:
    """(where, value) of a DSpark field; refuses two places that disagree."""
    prefixed, plain = keys
    found: list[tuple[str, Any]] = []
    if prefixed and d.get(prefixed) is not None:
        found.append((prefixed, d[prefixed]))
    for nest in ("dspark_config", "dflash_config"):
        sub = d.get(nest) or {}
        if isinstance(sub, dict) and sub.get(plain) is not None:
            found.append((f"{nest}.{plain}", sub[plain]))
    if d.get(plain) is not None:
        found.append((plain, d[plain]))
    if not found:
        return " / ".join(k for k in keys if k), None
    where, value = found[0]
    for other, v in found[1:]:
        if _norm(v) != _norm(value):
            _fail(other, v, f"the same value as {where} ({value!r})")
    return where, value


def _norm(v: Any) -> Any:
    return list(v) if isinstance(v, (list, tuple)) else v
