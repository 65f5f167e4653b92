"""Pure-torch references for the paged attention launchers (loops over sequences; slow, exact)."""

from __future__ import annotations

import torch

from ..common import is_fp8


def gather_kv(cache, scale, page_table_row, seq_len: int, page_size: int, dtype) -> torch.Tensor:
    """The first seq_len cached rows of one sequence, dequantized: [seq_len, kv_heads, head_dim]."""
    pos = torch.arange(seq_len, device=cache.device)
    slots = page_table_row[pos // page_size].long() * page_size + pos % page_size
    rows = cache[slots].to(dtype)
    if is_fp8(cache.dtype):
        rows = rows * scale[slots].to(dtype)[..., None]
    return rows


def attend(q, k, v, sm_scale: float, prefix_len: int) -> torch.Tensor:
    """q [n, q_heads, d] at positions prefix_len.., k/v [prefix_len + n, kv_heads, d]; causal."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * sm_scale
    key = torch.arange(k.shape[0], device=q.device)
    qpos = prefix_len + torch.arange(q.shape[0], device=q.device)
    s = s.masked_fill(key[None, None, :] > qpos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def reference_extend(
    q,
    k_cache,
    v_cache,
    page_table,
    seq_lens,
    qo_indptr,
    page_size: int,
    sm_scale: float,
    k_scale=None,
    v_scale=None,
    dtype=torch.float64,
    k_new=None,
    v_new=None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens (last qo_len) over its cached rows; with
    ``k_new``/``v_new`` (rows as q's) the new tokens' keys and values are those rows, and only
    the prefix is read from the cache."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    for b in range(seq_lens.shape[0]):
        lo, hi, n = int(qo_indptr[b]), int(qo_indptr[b + 1]), int(seq_lens[b])
        k = gather_kv(k_cache, k_scale, page_table[b], n, page_size, dtype)
        v = gather_kv(v_cache, v_scale, page_table[b], n, page_size, dtype)
        if k_new is not None:
            k[n - (hi - lo) :] = k_new[lo:hi].to(dtype)
            v[n - (hi - lo) :] = v_new[lo:hi].to(dtype)
        out[lo:hi] = attend(q[lo:hi].to(dtype), k, v, sm_scale, n - (hi - lo))
    return out


def reference_decode(
    q,
    k_cache,
    v_cache,
    page_table,
    seq_lens,
    page_size: int,
    sm_scale: float,
    k_scale=None,
    v_scale=None,
    dtype=torch.float64,
) -> torch.Tensor:
    """One query token per sequence (the last position) over all seq_len cached rows."""
    indptr = torch.arange(seq_lens.shape[0] + 1, device=q.device)
    return reference_extend(
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        indptr,
        page_size,
        sm_scale,
        k_scale,
        v_scale,
        dtype,
    )


def reference_verify(
    q,
    k_cache,
    v_cache,
    page_table,
    seq_lens,
    page_size: int,
    sm_scale: float,
    k_scale=None,
    v_scale=None,
    dtype=torch.float64,
) -> torch.Tensor:
    """q [batch * num_draft, ...]: each sequence's last num_draft positions, causal among them."""
    num_draft = q.shape[0] // seq_lens.shape[0]
    indptr = torch.arange(seq_lens.shape[0] + 1, device=q.device) * num_draft
    return reference_extend(
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        indptr,
        page_size,
        sm_scale,
        k_scale,
        v_scale,
        dtype,
    )
