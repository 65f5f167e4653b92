"""Random paged-KV problems for the attention tests (shared by the CPU and GPU test files)."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn


def quantize_rows(x):
    scale = (x.float().abs().amax(-1) / 448.0).clamp_min(1e-12)
    return (x.float() / scale[..., None]).clamp(-448, 448).to(FP8), scale


def paged_kv(seq_lens, kv_heads, head_dim, page_size, kv_dtype, device, seed=0):
    """Caches with each sequence's pages scattered at random; one spare page never referenced.

    Returns k_cache, v_cache, k_scale, v_scale (None unless fp8), page_table [batch, max_pages]
    int32 (unused entries point at the spare page), seq_lens int32.
    """
    g = torch.Generator().manual_seed(seed)
    pages = [(n + page_size - 1) // page_size for n in seq_lens]
    num_pages = sum(pages) + 1
    perm = torch.randperm(num_pages, generator=g)
    table = torch.full((len(seq_lens), max(max(pages), 1) + 1), int(perm[-1]), dtype=torch.int32)
    start = 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[start : start + p]
        start += p
    slots = num_pages * page_size
    k = torch.randn(slots, kv_heads, head_dim, generator=g)
    v = torch.randn(slots, kv_heads, head_dim, generator=g)
    if kv_dtype == FP8:
        (kc, ks), (vc, vs) = quantize_rows(k), quantize_rows(v)
        ks, vs = ks.to(device), vs.to(device)
    else:
        kc, vc, ks, vs = k.to(kv_dtype), v.to(kv_dtype), None, None
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return kc.to(device), vc.to(device), ks, vs, table.to(device), lens.to(device)


def queries(tokens, q_heads, head_dim, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, q_heads, head_dim, generator=g).to(torch.bfloat16).to(device)


def indptr(lengths, device):
    return torch.tensor(
        [0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device
    )
