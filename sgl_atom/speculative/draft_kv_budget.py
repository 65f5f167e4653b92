"""Draft KV pool budget at the draft's own dtype (pure arithmetic, no SGLang import).

An fp8 pool stores one byte per element plus, for the atom backend, one fp32 scale per
(token, KV head) for K and for V; a bf16 pool stores two bytes per element.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import element_bytes

_DRAFT_DTYPES = ("bf16", "fp8")
_SCALE_BYTES = element_bytes("fp32")  # one per (token, KV head), for K and for V


def kv_bytes_per_token(
    dtype: str, *, kv_heads: int, head_dim: int, v_head_dim: int | None = None, layers: int = 1
) -> int:
    """Bytes one token's K and V take over ``layers`` layers of an MHA pool at ``dtype``."""
    assert dtype in _DRAFT_DTYPES, f"draft KV dtype must be bf16 or fp8, got {dtype!r}"
    assert kv_heads > 0 and head_dim > 0 and layers >= 0
    v_dim = head_dim if v_head_dim is None else v_head_dim
    per_layer = kv_heads * (head_dim + v_dim) * element_bytes(dtype)
    if dtype == "fp8":
        per_layer += 2 * kv_heads * _SCALE_BYTES
    return per_layer * layers


@dataclass(frozen=True)
class DraftBudget:
    tokens: int  # pool tokens with the draft at its own dtype
    tokens_at_target_dtype: int  # what the upstream budget (draft at the target's bytes) gives
    draft_bytes_per_token: int
    draft_bytes_per_token_at_target_dtype: int

    @property
    def draft_pool_bytes(self) -> int:
        return self.tokens * self.draft_bytes_per_token

    @property
    def tokens_gained(self) -> int:
        return self.tokens - self.tokens_at_target_dtype


def pool_tokens(available_bytes: int, cell_bytes: int, page_size: int) -> int:
    """Page-aligned tokens a budget holds at ``cell_bytes`` per token (SGLang's default rule)."""
    assert cell_bytes > 0 and page_size > 0
    return max(available_bytes, 0) // cell_bytes // page_size * page_size


def draft_budget(
    available_bytes: int,
    *,
    target_cell: int,
    draft_cell: int,
    upstream_draft_cell: int,
    page_size: int,
) -> DraftBudget:
    """Tokens with the draft priced at its own bytes vs at the target's (upstream's rule)."""
    return DraftBudget(
        tokens=pool_tokens(available_bytes, target_cell + draft_cell, page_size),
        tokens_at_target_dtype=pool_tokens(
            available_bytes, target_cell + upstream_draft_cell, page_size
        ),
        draft_bytes_per_token=draft_cell,
        draft_bytes_per_token_at_target_dtype=upstream_draft_cell,
    )


def budget_line(b: DraftBudget, settled: str, target: str, cap: int | None = None) -> str:
    """The startup log line: the draft pool's bytes and the token capacity gained.

    ``cap`` is ``--max-total-tokens`` when it is set: the pool is then no larger than the cap
    whatever the budget holds, and the line says so rather than print a capacity not allocated.
    """
    gib = 1 << 30
    capped = ""
    if cap is not None and cap < b.tokens:
        mib = cap * b.draft_bytes_per_token / (1 << 20)
        capped = f"; --max-total-tokens caps the pool at {cap} tokens ({mib:.2f} MiB of draft KV)"
    return (
        f"draft KV pool at {settled} (target {target}): {b.draft_bytes_per_token} B/token, "
        f"{b.draft_pool_bytes / gib:.2f} GiB for {b.tokens} tokens (at {target}: "
        f"{b.draft_bytes_per_token_at_target_dtype} B/token, "
        f"{b.tokens * b.draft_bytes_per_token_at_target_dtype / gib:.2f} GiB); KV capacity "
        f"{b.tokens} tokens vs {b.tokens_at_target_dtype} budgeted at the target's dtype "
        f"({b.tokens_gained:+d}){capped}"
    )
