"""The draft KV dtype option: which dtype a speculative draft's KV cache has.

``--speculative-draft-kv-cache-dtype`` (SGLang's own flag) sets it; ``--spec-decode-kv-cache-dtype``
is accepted as an alias. Omitted, the draft has the target's dtype. Only a draft that owns its KV
pool may differ from the target; :data:`DRAFT_POOL_FAMILIES` decides which do, from the draft's
attention family. What was asked and what was settled are kept apart in :class:`DraftKVConfig`;
everything downstream reads ``settled``.

Nothing here imports SGLang or kernels: :func:`register` installs the glue lazily.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..dtypes import short_name

SGLANG_FLAG = "--speculative-draft-kv-cache-dtype"
ALIAS_FLAG = "--spec-decode-kv-cache-dtype"
ALIAS_DEST = "spec_decode_kv_cache_dtype"
CHOICES = ("bf16", "fp8")  # short names (sgl_atom.dtypes); SGLang's spellings of them too
_TO_SGLANG = {"bf16": "bf16", "fp8": "fp8_e4m3"}  # SGLang's --kv-cache-dtype spelling

# Whether a draft owns its KV pool, by the draft's attention family.
DRAFT_POOL_FAMILIES: Mapping[str, bool] = {
    "mha": True,  # MHA/GQA draft layers: a pool of their own (EAGLE3, DSpark, DFlash drafts)
    "mla": False,  # an MLA draft caches in the target's pool
    "mtp": False,  # an MTP/NextN head caches in the target's pool
    "none": False,  # no draft KV of its own: no draft model, or the target drafts itself
}
FAMILY_WORDS: Mapping[str, str] = {
    "mha": "an MHA draft",
    "mla": "an MLA draft",
    "mtp": "an MTP draft",
    "none": "a draft with no KV cache of its own",
}
# SGLang 0.5.23 algorithms whose worker builds a draft KV pool (same slots as the target's);
# the family of such a draft then comes from its checkpoint.
ALGORITHMS_WITH_DRAFT_POOL = frozenset({"EAGLE", "EAGLE3", "STANDALONE", "DFLASH", "DSPARK"})
# Algorithms whose draft never has a pool of its own, whatever the checkpoint.
FIXED_FAMILIES: Mapping[str, str] = {
    "FROZEN_KV_MTP": "mtp",  # reads the target's KV read-only
    "NGRAM": "none",  # no draft model
    "UNO": "none",  # the target model drafts (LoRA) in its own pool
}


class DraftKVDtypeError(ValueError):
    """A refused draft KV dtype request; the message names the flag and the remedy."""


@dataclass(frozen=True)
class DraftKVConfig:
    requested: str | None  # what was asked (bf16|fp8), None when omitted
    settled: str  # what the draft's pool, attention and keys use
    target: str  # the target's KV dtype, canonical (bf16, fp8, or SGLang's name)
    owns_pool: bool
    family: str

    @property
    def differs(self) -> bool:
        return self.settled != self.target


def _bf16_or_fp8(value: str) -> str | None:
    canon = short_name(str(value).strip().lower())
    return canon if canon in CHOICES else None


def canonical_draft_dtype(value: str | None, flag: str = SGLANG_FLAG) -> str | None:
    """``bf16``/``fp8`` for any spelling of them; None for None; refuses everything else."""
    if value is None:
        return None
    canon = _bf16_or_fp8(value)
    if canon is None:
        raise DraftKVDtypeError(
            f"{flag} {value!r} is not a draft KV dtype sgl_atom supports: use bf16 or fp8 "
            f"(fp8_e4m3), or omit it so the draft follows --kv-cache-dtype"
        )
    return canon


def canonical_target(value: str) -> str:
    """The target's KV dtype in the same vocabulary (other SGLang names kept as they are)."""
    return _bf16_or_fp8(value) or str(value).strip().lower()


def merge_requests(sglang_value: str | None, alias_value: str | None) -> str | None:
    """One request from the two flags; both given and different is refused."""
    a = canonical_draft_dtype(sglang_value, SGLANG_FLAG)
    b = canonical_draft_dtype(alias_value, ALIAS_FLAG)
    if a is not None and b is not None and a != b:
        raise DraftKVDtypeError(
            f"{SGLANG_FLAG} {sglang_value} and {ALIAS_FLAG} {alias_value} disagree: they are "
            f"the same setting, give one of them"
        )
    return a if a is not None else b


def attention_family(
    algorithm: str | None, *, mtp_head: bool = False, mla: bool = False, nextn: bool = False
) -> str:
    """The draft's attention family: fixed by the algorithm, else read from its checkpoint."""
    if algorithm is None:
        return "none"
    algorithm = algorithm.upper()
    if algorithm in FIXED_FAMILIES:
        return FIXED_FAMILIES[algorithm]
    if nextn or mtp_head:
        return "mtp"
    return "mla" if mla else "mha"


def owns_pool(family: str) -> bool:
    if family not in DRAFT_POOL_FAMILIES:
        raise KeyError(
            f"unknown draft attention family {family!r}; known: {sorted(DRAFT_POOL_FAMILIES)}"
        )
    return DRAFT_POOL_FAMILIES[family]


def check_speculation(
    requested: str | None,
    algorithm: str | None,
    num_spec_tokens: int | None,
    *,
    flag: str = SGLANG_FLAG,
) -> None:
    """A draft dtype needs a speculative algorithm that proposes at least one token."""
    if requested is None:
        return
    if algorithm is None or num_spec_tokens == 0:
        tokens = "the default number of" if num_spec_tokens is None else num_spec_tokens
        raise DraftKVDtypeError(
            f"{flag} {requested} sets the KV dtype of a speculative draft, but speculative "
            f"decoding is off (--speculative-algorithm {algorithm}, {tokens} "
            f"speculative tokens): set --speculative-algorithm and a non-zero number of "
            f"speculative tokens (--speculative-num-steps / --speculative-num-draft-tokens), "
            f"or drop {flag}"
        )


def resolve_draft_kv_dtype(
    requested: str | None,
    target_dtype: str,
    algorithm: str | None,
    num_spec_tokens: int | None,
    family: str,
    *,
    flag: str = SGLANG_FLAG,
) -> str:
    """The settled draft KV dtype, or :class:`DraftKVDtypeError` naming ``flag`` and the remedy.

    ``num_spec_tokens`` is the number of tokens the draft proposes per step (None: SGLang's
    default for the algorithm, which is never 0).
    """
    req = canonical_draft_dtype(requested, flag)
    target = canonical_target(target_dtype)
    if req is None:
        return target
    check_speculation(req, algorithm, num_spec_tokens, flag=flag)
    if req != target and not owns_pool(family):
        raise DraftKVDtypeError(
            f"{flag} {req} needs a draft with its own KV pool; {FAMILY_WORDS[family]} "
            f"({algorithm}) caches in the target's pool ({target}): drop {flag} or set it to "
            f"the target's --kv-cache-dtype"
        )
    return req


def settle(
    requested_sglang: str | None,
    requested_alias: str | None,
    target_dtype: str,
    algorithm: str | None,
    num_spec_tokens: int | None,
    family: str,
) -> DraftKVConfig:
    """Resolve both flags into one :class:`DraftKVConfig` (raises on any refused request)."""
    requested = merge_requests(requested_sglang, requested_alias)
    flag = SGLANG_FLAG if requested_sglang is not None else ALIAS_FLAG
    settled = resolve_draft_kv_dtype(
        requested, target_dtype, algorithm, num_spec_tokens, family, flag=flag
    )
    return DraftKVConfig(
        requested=requested,
        settled=settled,
        target=canonical_target(target_dtype),
        owns_pool=owns_pool(family),
        family=family,
    )


def to_sglang_dtype(settled: str) -> str:
    """SGLang's ``speculative_draft_kv_cache_dtype`` spelling of a settled bf16/fp8."""
    return _TO_SGLANG[settled]


def draft_key_suffix(cfg: DraftKVConfig | None) -> str:
    """What a profile or cache key gains: nothing unless the draft's dtype differs."""
    if cfg is None or not cfg.differs:
        return ""
    return f"draft_kv={cfg.settled}"


def register() -> list[str]:
    """Declare the option's CLI alias and register its resolution hook (SGLang's API); the
    patches that carry the alias and price the draft pool are installed by
    ``sgl_atom.patches.install``."""
    from .. import cli_flags
    from . import draft_kv_resolution

    cli_flags.add_flag(
        cli_flags.Flag(
            name=ALIAS_FLAG,
            dest=ALIAS_DEST,
            choices=CHOICES,
            help=f"Alias of {SGLANG_FLAG} limited to bf16/fp8 (fp8 = fp8_e4m3): the KV dtype "
            "of a speculative draft that owns its KV pool. Default: the target's dtype.",
        )
    )
    draft_kv_resolution.install()
    return ["flag:" + ALIAS_FLAG, "resolution:handle_speculative_decoding"]
