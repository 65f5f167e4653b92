"""Which implementation of the paged-attention launchers the atom backend calls.

On a GPU, always the Triton kernels. On CPU, ``SGL_ATOM_CPU_KERNELS`` picks the Triton kernels
under Triton's interpreter (``triton``, the default: the kernels themselves are exercised) or
their torch references in float64 (``reference``: same contracts, far faster), for servers whose
kernels are not what is under test. Both cover the paged-attention launchers and the sparse
(MiniMax-M3-style) ones: index-key write, block selection and sparse attention, and the
non-causal block attention of a block drafter (``block``: verify with ``causal=False``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import envs
from ..kernels.kv_quant import reference_store_kv, store_kv
from ..kernels.paged_attention import (
    decode_fwd,
    extend_fwd,
    reference_decode,
    reference_extend,
    reference_verify,
    verify_fwd,
)
from ..kernels.sparse_attention import (
    block_counts,
    index_write,
    reference_block_counts,
    reference_block_scores,
    reference_index_write,
    reference_select_blocks,
    reference_sparse_attention,
    select_blocks,
    sparse_attention_fwd,
)

CHOICES = ("triton", "reference")
F64 = torch.float64  # row results then do not depend on how many rows run together


@dataclass(frozen=True)
class KernelOps:
    name: str
    store: Callable
    decode: Callable
    verify: Callable
    block: Callable  # verify's contract, every query row sees every key of its sequence
    extend: Callable
    index_write: Callable
    select_blocks: Callable
    sparse_attn: Callable
    block_counts: Callable


def _ref_decode(q, kc, vc, pt, lens, page_size, sm_scale, out, k_scale=None, v_scale=None, **_):
    ref = reference_decode(q, kc, vc, pt, lens, page_size, sm_scale, k_scale, v_scale, F64)
    return out.copy_(ref)


def _ref_verify(
    q, kc, vc, pt, lens, page_size, sm_scale, num_draft, out, k_scale=None, v_scale=None, **_
):
    ref = reference_verify(q, kc, vc, pt, lens, page_size, sm_scale, k_scale, v_scale, F64)
    return out.copy_(ref)


def _triton_block(
    q, kc, vc, pt, lens, page_size, sm_scale, num_q, out, k_scale=None, v_scale=None, **kw
):
    return verify_fwd(
        q, kc, vc, pt, lens, page_size, sm_scale, num_q, out, k_scale, v_scale, causal=False, **kw
    )


def _ref_block(
    q, kc, vc, pt, lens, page_size, sm_scale, num_q, out, k_scale=None, v_scale=None, **_
):
    # one padded pass: row b's num_q queries over its own first lens[b] keys (no loop per row)
    batch, width = lens.shape[0], int(lens.max()) if lens.numel() else 0
    pos = torch.arange(width, device=q.device)
    seen = pos[None, :] < lens[:, None].long()  # table entries past a row's length: unread
    pages = torch.where(seen, pt[:, pos // page_size].long(), 0)
    slots = pages * page_size + pos % page_size
    k, v = (_dequant(c, s, slots, seen) for c, s in ((kc, k_scale), (vc, v_scale)))
    group = q.shape[1] // kc.shape[1]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    qb = q.to(F64).view(batch, num_q, q.shape[1], q.shape[2])
    scores = torch.einsum("bqhd,bkhd->bhqk", qb, k) * sm_scale
    scores = scores.masked_fill(~seen[:, None, None, :], -torch.inf)
    o = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    return out.copy_(o.reshape(q.shape))


def _dequant(cache, scale, slots, seen):
    """Rows [batch, width, kv_heads, d] in float64; zeros where unseen (a NaN there would
    reach the output through 0 * NaN)."""
    rows = cache[slots].to(F64)
    if scale is not None:
        rows = rows * scale[slots].to(F64)[..., None]
    return rows.masked_fill(~seen[:, :, None, None], 0.0)


def _ref_extend(
    q, kc, vc, pt, lens, qo_indptr, page_size, sm_scale, out, k_scale=None, v_scale=None,
    k_new=None, v_new=None, **_,
):  # fmt: skip
    if k_scale is None:  # a 16-bit cache holds the new rows as they are (as extend_fwd)
        k_new = v_new = None
    ref = reference_extend(
        q, kc, vc, pt, lens, qo_indptr, page_size, sm_scale, k_scale, v_scale, F64, k_new, v_new
    )
    return out.copy_(ref)


def _qo(qo_indptr, seq_lens):
    """Decode passes no qo_indptr: one new token per sequence."""
    if qo_indptr is not None:
        return qo_indptr
    return torch.arange(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)


def _ref_select(
    index_q,
    index_cache,
    page_table,
    seq_lens,
    page_size,
    scale,
    topk,
    init_blocks,
    local_blocks,
    qo_indptr=None,
    index_scale=None,
    **_,
):
    qo = _qo(qo_indptr, seq_lens)
    scores = reference_block_scores(
        index_q, index_cache, page_table, seq_lens, qo, page_size, scale, index_scale, F64
    )
    sel, count = reference_select_blocks(scores, seq_lens, qo, topk, init_blocks, local_blocks)
    return sel.to(index_q.device), count.to(index_q.device)


def _ref_sparse(
    q,
    kc,
    vc,
    page_table,
    seq_lens,
    selected,
    count,
    page_size,
    sm_scale,
    qo_indptr=None,
    k_scale=None,
    v_scale=None,
    **_,
):
    qo = _qo(qo_indptr, seq_lens)
    out = reference_sparse_attention(
        q, kc, vc, page_table, seq_lens, qo, selected, page_size, sm_scale, k_scale, v_scale, F64
    )
    return out.to(q.dtype)


TRITON = KernelOps(
    "triton",
    store_kv,
    decode_fwd,
    verify_fwd,
    _triton_block,
    extend_fwd,
    index_write,
    select_blocks,
    sparse_attention_fwd,
    block_counts,
)
REFERENCE = KernelOps(
    "reference",
    reference_store_kv,
    _ref_decode,
    _ref_verify,
    _ref_block,
    _ref_extend,
    reference_index_write,
    _ref_select,
    _ref_sparse,
    reference_block_counts,
)


def kernel_ops(device: torch.device | str) -> KernelOps:
    """The launchers for a backend on ``device``."""
    if torch.device(device).type != "cpu":
        return TRITON
    choice = envs.SGL_ATOM_CPU_KERNELS.get()
    if choice not in CHOICES:
        raise ValueError(f"SGL_ATOM_CPU_KERNELS={choice!r}: use one of {', '.join(CHOICES)}")
    return REFERENCE if choice == "reference" else TRITON
