"""SGLang glue: settle the draft KV dtype while SGLang resolves its arguments.

A resolution hook (SGLang's ``register_resolution_hook``) wraps ``handle_speculative_decoding``:
requests are checked before SGLang's step runs (so a refusal names our flags), the dtype is
settled after it (the algorithm is final then: NEXTN became EAGLE, a Gemma4 draft
FROZEN_KV_MTP), stored as ``server_args._sgl_atom_draft_kv`` and declared onto SGLang's
``speculative_draft_kv_cache_dtype`` so SGLang's draft runner builds its pool at that dtype.
"""

from __future__ import annotations

from ..cli_flags import cli_values
from ..dtypes import short_of_torch
from ..log import get_logger
from .draft_kv_dtype import (
    ALIAS_DEST,
    ALIAS_FLAG,
    SGLANG_FLAG,
    DraftKVConfig,
    attention_family,
    canonical_draft_dtype,
    canonical_target,
    check_speculation,
    merge_requests,
    settle,
    to_sglang_dtype,
)

logger = get_logger("sgl_atom.speculative")

STEP = "handle_speculative_decoding"
ATTR = "_sgl_atom_draft_kv"
SOURCE = "sgl_atom.draft_kv_dtype"


def draft_kv_config(server_args) -> DraftKVConfig | None:
    """The settled draft KV dtype of a resolved ServerArgs (None before resolution)."""
    return getattr(server_args, ATTR, None)


def proposed_tokens(cfg) -> int | None:
    """Tokens the draft proposes per step, from what was given (None: SGLang's default)."""
    if cfg.speculative_num_steps is not None:
        return int(cfg.speculative_num_steps)
    if cfg.speculative_dspark_block_size is not None:
        return int(cfg.speculative_dspark_block_size)
    for window in (cfg.speculative_num_draft_tokens, cfg.speculative_dflash_block_size):
        if window is not None:  # the verify window: the proposals plus the last accepted token
            return max(int(window) - 1, 0)
    return None


def target_dtype(server_args, cfg) -> str:
    """The target's KV dtype; ``auto`` becomes the model's dtype when its config is readable."""
    if cfg.kv_cache_dtype != "auto":
        return canonical_target(cfg.kv_cache_dtype)
    try:
        from sglang.srt.arg_groups.overrides import model_config_of

        return short_of_torch(model_config_of(server_args).dtype) or "auto"
    except Exception:  # noqa: BLE001 - no readable model config: keep SGLang's own word
        return "auto"


def draft_family(cfg, algorithm: str, given_algorithm: str | None) -> str:
    """The draft's attention family, from the algorithm and the draft checkpoint's config."""
    nextn = (given_algorithm or "").upper() == "NEXTN"
    path = cfg.speculative_draft_model_path
    if path is None:  # EAGLE without a draft path drafts with the target's own MTP head
        return attention_family(algorithm, nextn=nextn or algorithm == "EAGLE")
    try:
        from sglang.srt.utils.hf_transformers_utils import get_config

        hf = get_config(path, trust_remote_code=cfg.trust_remote_code)
    except Exception as e:  # noqa: BLE001
        logger.warning("draft config %s unreadable (%s); taking its family as MHA", path, e)
        return attention_family(algorithm, nextn=nextn)
    archs = list(getattr(hf, "architectures", None) or [])
    text = getattr(hf, "text_config", None) or hf
    mtp_head = algorithm == "EAGLE" and (
        any(a.endswith(("NextN", "MTP")) for a in archs)
        or bool(getattr(text, "num_nextn_predict_layers", None))
    )
    mla = getattr(text, "kv_lora_rank", None) is not None or any(
        a.startswith("DeepseekV4") for a in archs
    )
    return attention_family(algorithm, mtp_head=mtp_head, mla=mla, nextn=nextn)


def settle_draft_kv(server_args, previous) -> None:
    """Resolution hook around SGLang's ``handle_speculative_decoding``."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    given = server_args.speculative_draft_kv_cache_dtype  # the operator's input, never rewritten
    alias = cli_values(server_args).get(ALIAS_DEST)
    requested = merge_requests(given, alias)
    flag = SGLANG_FLAG if given is not None else ALIAS_FLAG
    cfg = resolving_view(server_args)
    given_algorithm = cfg.speculative_algorithm
    check_speculation(requested, given_algorithm, proposed_tokens(cfg), flag=flag)

    previous(server_args)

    cfg = resolving_view(server_args)
    algorithm = cfg.speculative_algorithm
    family = draft_family(cfg, algorithm.upper(), given_algorithm) if algorithm else "none"
    target = target_dtype(server_args, cfg)
    dk = settle(given, alias, target, algorithm, proposed_tokens(cfg), family)
    if requested is None:
        dk = _model_default(dk, cfg.speculative_draft_kv_cache_dtype)
    setattr(server_args, ATTR, dk)
    if requested is not None:
        declare_resolution(
            server_args, SOURCE, speculative_draft_kv_cache_dtype=to_sglang_dtype(dk.settled)
        )
        logger.info(
            "draft KV dtype: requested %s, settled %s (target %s, %s draft, %s pool)",
            dk.requested,
            dk.settled,
            dk.target,
            family.upper(),
            "own" if dk.owns_pool else "the target's",
        )


def _model_default(dk: DraftKVConfig, sglang_value: str | None) -> DraftKVConfig:
    """A model override of SGLang (e.g. MiniMax-M3 sets a bf16 draft) settles an omitted request."""
    if sglang_value in (None, "auto"):
        return dk
    try:
        settled = canonical_draft_dtype(sglang_value)
    except ValueError:
        return dk
    return DraftKVConfig(None, settled, dk.target, dk.owns_pool, dk.family)


def install() -> None:
    from sglang.srt.arg_groups.resolution_hooks import _HOOKS, register_resolution_hook

    if settle_draft_kv not in _HOOKS.get(STEP, ()):
        register_resolution_hook(STEP)(settle_draft_kv)
