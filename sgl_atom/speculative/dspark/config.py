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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# Markov head types real drafters declare; only the vanilla head (W1 embedding, W2 projection)
# is implemented here.
KNOWN_MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
SUPPORTED_MARKOV_HEAD_TYPES = ("vanilla",)

# (prefixed key, key inside dspark_config / dflash_config / at the top level)
_DSPARK_KEYS = {
    "block_size": ("dspark_block_size", "block_size"),
    "target_layer_ids": ("dspark_target_layer_ids", "target_layer_ids"),
    "markov_rank": ("dspark_markov_rank", "markov_rank"),
    "markov_head_type": ("dspark_markov_head_type", "markov_head_type"),
    "mask_token_id": ("dspark_noise_token_id", "mask_token_id"),
    "num_target_layers": (None, "num_target_layers"),
}


class DSparkConfigError(ValueError):
    """A draft config.json field is missing or out of range; the message names it."""


@dataclass(frozen=True)
class DSparkDraftConfig:
    """What a DSpark draft checkpoint declares.

    ``block_size`` is k, the number of tokens one draft pass proposes; the verify pass reads
    k + 1 tokens (``speculative_num_draft_tokens`` = k + 1). ``target_layer_ids`` are HF-style
    ids: tap ``i`` is the output of target layer ``i`` (hidden_states[i + 1] in HF terms).
    """

    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None
    mask_token_id: int
    markov_rank: int
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = True
    sample_from_anchor: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    target_hidden_size: int | None = None

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
        hidden = _int(text, "hidden_size", lo=1)
        heads = _int(text, "num_attention_heads", lo=1)
        head_dim = _int(text, "head_dim", lo=1, default=hidden // heads)
        cfg = cls(
            architecture=_architecture(d),
            hidden_size=hidden,
            num_hidden_layers=_int(text, "num_hidden_layers", lo=1),
            num_attention_heads=heads,
            num_key_value_heads=_int(text, "num_key_value_heads", lo=1, default=heads),
            head_dim=head_dim,
            intermediate_size=_int(text, "intermediate_size", lo=1),
            vocab_size=_int(text, "vocab_size", lo=1),
            block_size=_dspark_int(d, "block_size", lo=1),
            target_layer_ids=_target_layer_ids(d),
            num_target_layers=_dspark_int(d, "num_target_layers", lo=1, required=False),
            mask_token_id=_dspark_int(d, "mask_token_id", lo=0),
            markov_rank=_dspark_int(d, "markov_rank", lo=1),
            markov_head_type=_markov_head_type(d),
            enable_confidence_head=_bool(d, "enable_confidence_head", False),
            confidence_head_with_markov=_bool(d, "confidence_head_with_markov", True),
            sample_from_anchor=_bool(d, "sample_from_anchor", True),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(text.get("rope_theta", 10000.0)),
            max_position_embeddings=_int(text, "max_position_embeddings", lo=1, default=32768),
            target_hidden_size=_int(d, "target_hidden_size", lo=1, default=None),
        )
        cfg._check_relations()
        return cfg

    def _check_relations(self) -> None:
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
        arch = d.pop("architecture")
        ids = list(d.pop("target_layer_ids"))
        out: dict[str, Any] = {"architectures": [arch], "model_type": "qwen3"}
        out.update({k: v for k, v in d.items() if v is not None})
        # Both spellings: SGLang's DFlash-family readers only see the plain one.
        out["dspark_target_layer_ids"] = out["target_layer_ids"] = ids
        return out


def _fail(field: str, got: Any, expected: str) -> None:
    raise DSparkConfigError(f"DSpark draft config: {field}={got!r}, expected {expected}")


def _architecture(d: dict) -> str:
    archs = d.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        _fail("architectures", archs, "a non-empty list naming the draft class")
    return archs[0]


def _int(d: dict, key: str, *, lo: int, default: Any = ...) -> Any:
    if key not in d or d[key] is None:
        if default is ...:
            _fail(key, None, f"an integer >= {lo} (field is required)")
        return default
    return _check_int(key, d[key], lo)


def _check_int(key: str, value: Any, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(key, value, f"an integer >= {lo}")
    if value < lo:
        _fail(key, value, f"an integer >= {lo}")
    return value


def _bool(d: dict, key: str, default: bool) -> bool:
    value = _dspark_lookup(d, key, (None, key), default)[1]
    if not isinstance(value, bool):
        _fail(key, value, "true or false")
    return value


def _dspark_lookup(d: dict, field: str, keys: tuple, default: Any) -> tuple[str, Any]:
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
        return field, default
    where, value = found[0]
    for other, v in found[1:]:
        if _norm(v) != _norm(value):
            _fail(other, v, f"the same value as {where} ({value!r})")
    return where, value


def _norm(v: Any) -> Any:
    return list(v) if isinstance(v, (list, tuple)) else v


def _dspark_int(d: dict, field: str, *, lo: int, required: bool = True) -> int | None:
    where, value = _dspark_lookup(d, field, _DSPARK_KEYS[field], None)
    if value is None:
        if required:
            names = " / ".join(k for k in _DSPARK_KEYS[field] if k)
            _fail(names, None, f"an integer >= {lo} (field is required)")
        return None
    return _check_int(where, value, lo)


def _target_layer_ids(d: dict) -> tuple[int, ...]:
    where, ids = _dspark_lookup(d, "target_layer_ids", _DSPARK_KEYS["target_layer_ids"], None)
    if ids is None:
        _fail("dspark_target_layer_ids", None, "a non-empty list of target layer ids")
    if not isinstance(ids, (list, tuple)) or not ids:
        _fail(where, ids, "a non-empty list of target layer ids")
    for i in ids:
        _check_int(where, i, 0)
    if any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
        _fail(where, list(ids), "strictly increasing layer ids")
    return tuple(ids)


def _markov_head_type(d: dict) -> str:
    where, kind = _dspark_lookup(d, "markov_head_type", _DSPARK_KEYS["markov_head_type"], None)
    kind = "vanilla" if kind is None else str(kind).lower()
    if kind not in KNOWN_MARKOV_HEAD_TYPES:
        _fail(where, kind, f"one of {KNOWN_MARKOV_HEAD_TYPES}")
    if kind not in SUPPORTED_MARKOV_HEAD_TYPES:
        _fail(where, kind, f"one of {SUPPORTED_MARKOV_HEAD_TYPES} (the only head implemented)")
    return kind
