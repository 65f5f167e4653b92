"""``--atom-dspark-forced-accept N``: a benchmark mode that commits N draft tokens per verify.

Every verify of every request then commits N + 1 tokens, whatever the draft proposed: the
target's own greedy predictions at the first N + 1 verify positions (after SGLang's
``eagle_sample`` where penalties, logit bias or a grammar change the logits; otherwise in its
place, so that the step reads the verify logits once, as greedy serving does). So draft +
verify cost can be measured at a fixed acceptance on dummy-weight models at real shapes. The
outputs are NOT the model's (the KV of those positions was computed from the draft tokens):
the worker logs a WARNING at start-up, and the flag shows in ``/get_server_info`` as part of
SGLang's ``launch_command``. Off unless given; refused without ``--speculative-algorithm
ATOM_DSPARK`` and for N outside 0..k-1 (k: the draft's block size), while the arguments are
resolved.
"""

from __future__ import annotations

import torch

from ...cli_flags import cli_values

FLAG = "--atom-dspark-forced-accept"
DEST = "atom_dspark_forced_accept"
ATTR = "_sgl_atom_dspark_forced_accept"  # the checked N on the resolved ServerArgs
STEP = "handle_speculative_decoding"
ALGORITHM = "ATOM_DSPARK"
WARNING = (
    "ATOM_DSPARK FORCED ACCEPTANCE (%s %d): every verify commits %d draft tokens per request "
    "regardless of their values; outputs are NOT the model's. Benchmarking only."
)


def check_forced_accept(value: str | None, algorithm: str | None, k: int | None) -> int | None:
    """The forced acceptance N of a flag value, or None when the flag was not given."""
    if value is None:
        return None
    try:
        n = int(str(value).strip())
    except ValueError:
        raise ValueError(f"{FLAG} {value!r}: give an integer N in 0..k-1") from None
    if (algorithm or "").upper() != ALGORITHM:
        raise ValueError(
            f"{FLAG} {value} forces the acceptance of the {ALGORITHM} speculative worker, but "
            f"the server runs --speculative-algorithm {algorithm}: add --speculative-algorithm "
            f"{ALGORITHM} or drop {FLAG}"
        )
    if k is None or not 0 <= n < k:
        raise ValueError(
            f"{FLAG} {value}: N draft tokens of the draft's block of k={k} are committed per "
            f"verify, so N must lie in 0..{(k or 1) - 1}"
        )
    return n


def forced_accept(server_args) -> int | None:
    """The checked N of a resolved ServerArgs, or None (the mode is off)."""
    return getattr(server_args, ATTR, None)


def settle_forced_accept(server_args, previous) -> None:
    """Resolution hook around SGLang's ``handle_speculative_decoding``: after it the algorithm
    is final and ATOM_DSPARK has set ``speculative_num_steps`` to its block size k."""
    from sglang.srt.arg_groups.overrides import resolving_view

    previous(server_args)
    value = cli_values(server_args).get(DEST)
    if value is None:
        return
    cfg = resolving_view(server_args)
    k = cfg.speculative_num_steps
    n = check_forced_accept(value, cfg.speculative_algorithm, None if k is None else int(k))
    setattr(server_args, ATTR, n)


def forced_acceptance(
    next_token_logits: torch.Tensor,
    batch: int,
    window: int,
    width: int,
    n: int,
    plans: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What ``eagle_sample`` returns, with exactly ``n`` drafts accepted for every request.

    next_token_logits: [batch * window, vocab], the verify pass's logits (window = k + 1);
    width: accept_index's columns. Returns predict [batch * window] int32 (the target's greedy
    token at every verify position), accept_lens [batch] int32 = n + 1, and accept_index
    [batch, width] int32 holding b * window + j for j <= n, -1 after. The last two depend on
    the shapes only: with ``plans`` (a dict the caller keeps) they are built once per batch
    size and handed out again (nothing downstream writes into them), so a step launches the
    argmax alone.
    """
    device = next_token_logits.device
    predict = next_token_logits.argmax(dim=-1).to(torch.int32)
    key = (batch, window, width, n, device)
    plan = plans.get(key) if plans is not None else None
    if plan is None:
        cols = torch.arange(width, device=device, dtype=torch.int32)[None, :]
        rows = torch.arange(batch, device=device, dtype=torch.int32)[:, None] * window
        accept_index = torch.where(cols <= n, rows + cols, torch.full_like(cols, -1))
        accept_lens = torch.full((batch,), n + 1, dtype=torch.int32, device=device)
        plan = (accept_lens, accept_index)
        if plans is not None:
            plans[key] = plan
    return predict, *plan


def adjusts_logits(sampling_info, grammar_mask) -> bool:
    """Whether ``eagle_sample`` changes the verify logits before its argmax (penalties, logit
    bias, a grammar). Where it does not, forced acceptance skips it: its own argmax over the
    verify logits is then the step's only one, as in greedy serving (``eagle_sample``'s argmax
    and tree walk would be a second pass whose result is discarded)."""
    return (
        grammar_mask is not None
        or getattr(sampling_info, "acc_additive_penalties", None) is not None
        or getattr(sampling_info, "acc_scaling_penalties", None) is not None
        or getattr(sampling_info, "logit_bias", None) is not None
    )


def register() -> list[str]:
    """Declare the flag and register its resolution hook (SGLang's API). The flag reaches
    SGLang's parser and the ServerArgs record through ``patches.cli_args`` and
    ``patches.prepare_server_args``, installed by the plugin for every sgl_atom flag."""
    from sglang.srt.arg_groups.resolution_hooks import _HOOKS, register_resolution_hook

    from ... import cli_flags

    cli_flags.add_flag(
        cli_flags.Flag(
            name=FLAG,
            dest=DEST,
            choices=None,
            help=f"Benchmarking only ({ALGORITHM}): commit exactly N (0..k-1) draft tokens per "
            "verify regardless of their values; outputs are not the model's. Default: off.",
        )
    )
    if settle_forced_accept not in _HOOKS.get(STEP, ()):
        register_resolution_hook(STEP)(settle_forced_accept)
    return ["flag:" + FLAG, "resolution:" + STEP]
