"""Pure-torch references for the sparse attention launchers (loops over sequences; slow, exact).

Positions: new token i of sequence b (rows qo_indptr[b] .. qo_indptr[b+1]) sits at position
seq_len - qo_len + i; it sees positions 0 ..= that, in blocks of SPARSE_BLOCK tokens.
"""

from __future__ import annotations

import torch

from ..common import FP8_MAX, FP8_SCALE_MIN, INT4_MAX, is_fp8, is_int4, scaled_index
from ..paged_attention.reference import reference_extend

SPARSE_BLOCK = 128


def reference_index_write(
    index_k: torch.Tensor,
    index_cache: torch.Tensor,
    loc: torch.Tensor,
    index_scale: torch.Tensor | None = None,
) -> None:
    """Write `index_k` [tokens, index_dim] into `index_cache[loc]` (fp8 and packed 4-bit: with a
    per-token scale)."""
    if is_int4(index_cache.dtype):
        x = index_k.float()
        scale = (x.abs().amax(-1) / INT4_MAX).clamp_min(FP8_SCALE_MIN)
        q = torch.floor(x / scale[:, None] + 0.5).clamp(-INT4_MAX, INT4_MAX).to(torch.int32) + 8
        half = x.shape[-1] // 2
        index_cache[loc.long()] = (q[:, :half] | (q[:, half:] << 4)).to(torch.uint8)
        index_scale[loc.long()] = scale
        return
    if not is_fp8(index_cache.dtype):
        index_cache[loc.long()] = index_k.to(index_cache.dtype)
        return
    x = index_k.float()
    scale = (x.abs().amax(-1) / FP8_MAX).clamp_min(FP8_SCALE_MIN)
    index_cache[loc.long()] = (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(index_cache.dtype)
    index_scale[loc.long()] = scale


def slots_of(page_table_row: torch.Tensor, n: int, page_size: int) -> torch.Tensor:
    pos = torch.arange(n, device=page_table_row.device)
    return page_table_row[pos // page_size].long() * page_size + pos % page_size


def unpack_int4(packed: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Packed 4-bit index rows [..., index_dim / 2] uint8 -> their q values [..., index_dim]."""
    b = packed.to(torch.int32)
    return torch.cat([(b & 15) - 8, (b >> 4) - 8], -1).to(dtype)


def int4_query(q: torch.Tensor) -> torch.Tensor:
    """Index q rows [..., index_dim] as the scoring kernels dot them with a packed 4-bit cache:
    each row rounded to 8-bit integers (``floor(x / step + 0.5)``, at most 127) on the
    power-of-two step that puts the row's largest magnitude in [64, 128), returned as integer *
    step in q's dtype. The step's exponent is clamped to [-126, 121], as the kernel's fp32 bits."""
    amax = q.abs().amax(-1, keepdim=True).to(torch.float32).double()
    exp = (torch.frexp(amax).exponent - 1).clamp(-120, 127)  # amax in [2^exp, 2^(exp + 1))
    # 2^(exp - 6) from its bits: exact on every device (CUDA's pow(2.0, n) in float64 is not
    # always, and a step a bit off a power of two moves the many x.5 ties of bf16 q)
    step = ((exp.to(torch.int64) + (1023 - 6)) << 52).view(torch.float64)
    return (torch.floor(q.double() / step + 0.5).clamp(max=127.0) * step).to(q.dtype)


def _rows(cache, scale, slots, dtype) -> torch.Tensor:
    rows = unpack_int4(cache[slots], dtype) if is_int4(cache.dtype) else cache[slots].to(dtype)
    if scaled_index(cache.dtype):
        rows = rows * scale[slots].to(dtype).view(
            *scale[slots].shape, *[1] * (rows.dim() - scale.dim())
        )
    return rows


def _sequences(seq_lens, qo_indptr):
    for b in range(seq_lens.shape[0]):
        lo, hi, n = int(qo_indptr[b]), int(qo_indptr[b + 1]), int(seq_lens[b])
        yield b, lo, hi, n, n - (hi - lo) + torch.arange(hi - lo)


def reference_block_scores(
    index_q,
    index_cache,
    page_table,
    seq_lens,
    qo_indptr,
    page_size: int,
    scale: float,
    index_scale=None,
    dtype=torch.float64,
) -> torch.Tensor:
    """Block scores [total_q, kv_heads, max_blocks]: max over visible positions of the block of
    index_q[t, h] · index_k[p] * scale; -inf for blocks with no visible position. Against a
    packed 4-bit cache q is rounded as the kernels round it (``int4_query``)."""
    if is_int4(index_cache.dtype):
        index_q = int4_query(index_q.to(dtype))
    max_blocks = -(-int(seq_lens.max()) // SPARSE_BLOCK)
    out = torch.full((*index_q.shape[:2], max_blocks), float("-inf"), dtype=dtype)
    for b, lo, hi, n, qpos in _sequences(seq_lens.cpu(), qo_indptr.cpu()):
        keys = _rows(index_cache, index_scale, slots_of(page_table[b], n, page_size), dtype).cpu()
        s = torch.einsum("thd,pd->thp", index_q[lo:hi].to(dtype).cpu(), keys) * scale
        s = s.masked_fill(torch.arange(n)[None, None, :] > qpos[:, None, None], float("-inf"))
        padded = torch.full((*s.shape[:2], max_blocks * SPARSE_BLOCK), float("-inf"), dtype=dtype)
        padded[..., :n] = s
        out[lo:hi] = padded.view(*s.shape[:2], max_blocks, SPARSE_BLOCK).amax(-1)
    return out


def reference_select_blocks(
    scores, seq_lens, qo_indptr, topk: int, init_blocks: int, local_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(selected [total_q, kv_heads, topk] int32 ascending, -1 padded; count [total_q, kv_heads]).
    Init and local blocks are forced in; ties go to the lower block index."""
    total_q, kv_heads, max_blocks = scores.shape
    sel = torch.full((total_q, kv_heads, topk), -1, dtype=torch.int32)
    count = torch.zeros((total_q, kv_heads), dtype=torch.int32)
    for _, lo, hi, _, qpos in _sequences(seq_lens.cpu(), qo_indptr.cpu()):
        for i, pos in zip(range(lo, hi), qpos.tolist(), strict=True):
            nvis = pos // SPARSE_BLOCK + 1
            free = [not (j < init_blocks or j >= nvis - local_blocks) for j in range(nvis)]
            for h in range(kv_heads):
                key = scores[i, h, :nvis].tolist()
                order = sorted(range(nvis), key=lambda j: (free[j], -key[j], j))
                chosen = sorted(order[:topk])
                sel[i, h, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
                count[i, h] = len(chosen)
    return sel, count


def _attend(q, k, v, allowed, sm_scale) -> torch.Tensor:
    """q [n, q_heads, d]; k/v [keys, kv_heads, d]; allowed [n, kv_heads, keys] bool."""
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, 1)) * sm_scale
    s = s.masked_fill(~allowed.repeat_interleave(group, 1).permute(1, 0, 2), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v.repeat_interleave(group, 1))


def reference_sparse_attention(
    q,
    k_cache,
    v_cache,
    page_table,
    seq_lens,
    qo_indptr,
    selected,
    page_size: int,
    sm_scale: float,
    k_scale=None,
    v_scale=None,
    dtype=torch.float64,
) -> torch.Tensor:
    """Each token attends only to the positions of its KV head's selected blocks, causally."""
    out = torch.empty(q.shape, dtype=dtype)
    for b, lo, hi, n, qpos in _sequences(seq_lens.cpu(), qo_indptr.cpu()):
        slots = slots_of(page_table[b], n, page_size)
        k = _rows(k_cache, k_scale, slots, dtype).cpu()
        v = _rows(v_cache, v_scale, slots, dtype).cpu()
        blk = torch.arange(n) // SPARSE_BLOCK
        picked = (selected[lo:hi].cpu().long()[..., None] == blk).any(-2)  # [n_q, kv_heads, keys]
        allowed = picked & (torch.arange(n)[None, None, :] <= qpos[:, None, None])
        out[lo:hi] = _attend(q[lo:hi].to(dtype).cpu(), k, v, allowed, sm_scale)
    return out


def reference_dense_attention(
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
) -> torch.Tensor:
    """Plain causal attention over all cached positions (sparse equals it when topk covers all):
    the paged extend reference, on CPU."""
    return reference_extend(
        q.cpu(),
        k_cache.cpu(),
        v_cache.cpu(),
        page_table.cpu(),
        seq_lens.cpu(),
        qo_indptr.cpu(),
        page_size,
        sm_scale,
        None if k_scale is None else k_scale.cpu(),
        None if v_scale is None else v_scale.cpu(),
        dtype=dtype,
    )
