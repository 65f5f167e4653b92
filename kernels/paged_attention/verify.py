"""Target-verify attention: a fixed number of draft tokens per sequence, causal among themselves,
over the paged KV. It runs the split-KV decode kernels with all draft rows of a GQA group in one
tile, so each KV tile is read once per group and long contexts still fill the GPU."""

from __future__ import annotations

import torch

from .decode import split_kv_attention


def verify_fwd(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    sm_scale: float,
    num_draft: int,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_context: int | None = None,
    causal: bool = True,
    **tuning,
) -> torch.Tensor:
    """Verify attention for speculative decoding.

    q: [batch * num_draft, q_heads, head_dim] bf16/fp16, sequence-major (row b * num_draft + i
      is draft token i of sequence b), head_dim contiguous.
    k_cache, v_cache, k_scale, v_scale, page_table, page_size, sm_scale: as `decode_fwd`.
    seq_lens: [batch] int32 lengths including the num_draft tokens, whose K/V are already in the
      cache at positions seq_len - num_draft .. seq_len - 1; draft i sees the keys at positions
      <= seq_len - num_draft + i; with ``causal=False`` every draft token sees every key of
      its sequence (a block drafter's non-causal pass over its context and its own block).
    out: like q, written whole. num_splits, workspace (max_tokens = batch * num_draft),
      max_context, tuning: as `decode_fwd`.
    Returns out.
    """
    if num_draft < 1:
        raise ValueError(f"verify_fwd: num_draft must be >= 1, got {num_draft}")
    return split_kv_attention(
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        page_size,
        sm_scale,
        num_draft,
        out,
        k_scale,
        v_scale,
        num_splits,
        workspace,
        max_context,
        causal=causal,
        **tuning,
    )
