"""The DSpark draft's own KV pool: per draft layer K and V rows at the target's slot ids.

The pool has as many slots as the target's token pool and is indexed by the same slot ids
(``req_to_token``), so a request's draft context lives where its target KV lives: prefix-cache
hits, chunked prefill and slot reuse need no bookkeeping of their own. Rows are stored at the
settled draft KV dtype: bf16, the target's own dtype when nothing was requested, or fp8
e4m3 with one fp32 scale per (slot, KV head) for K and for V, written in one pass by the
``kv_quant`` store kernel (its torch reference on CPU).

Past those slots the pool keeps ``block_rows`` scratch rows: ``scratch_rows(batch)`` gives each
batch row ``block_len`` of them, where a draft pass writes its block's own K/V so that one
non-causal paged-attention call sees context and block together (:func:`block_page_table`).
``k``/``v``/``k_scale``/``v_scale`` are views of the slot rows only: what P/D registers and
moves (the target pool's ``sgl_atom.pool_state``) never includes the scratch rows.
"""

from __future__ import annotations

from typing import Any

import torch

from ...kernels.kv_quant import reference_store_kv, store_kv
from ...kernels.paged_attention import unsupported_reason

MAX_BLOCK_ROWS = 128  # query rows (block x GQA group) the split-KV kernels hold in one tile

_STORAGE = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def storage_dtype(settled: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for a settled draft KV dtype (bf16, fp8, or the target's own
    dtype name such as fp16, which is stored at the compute dtype)."""
    return _STORAGE.get(settled, compute_dtype)


class DraftKVPool:
    """K/V rows ``[slots, kv_heads, head_dim]`` per draft layer at the settled ``dtype``, plus
    ``max_batch * block_len`` scratch rows after them (``k_all``/``v_all``: slots + scratch)."""

    def __init__(
        self,
        *,
        slots: int,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: str,
        device: torch.device | str,
        compute_dtype: torch.dtype = torch.bfloat16,
        max_batch: int = 0,
        block_len: int = 0,
    ) -> None:
        self.dtype, self.compute_dtype = dtype, compute_dtype
        self.slots, self.layers = slots, layers
        self.max_batch, self.block_len = max_batch, block_len
        self.device = torch.device(device)
        rows = slots + max_batch * block_len
        storage = storage_dtype(dtype, compute_dtype)
        zeros = (rows, kv_heads, head_dim)
        self.k_all = [torch.zeros(zeros, dtype=storage, device=self.device) for _ in range(layers)]
        self.v_all = [torch.zeros(zeros, dtype=storage, device=self.device) for _ in range(layers)]
        n_scales = layers if dtype == "fp8" else 0
        self.k_scale_all = [torch.ones(rows, kv_heads, device=self.device) for _ in range(n_scales)]
        self.v_scale_all = [torch.ones(rows, kv_heads, device=self.device) for _ in range(n_scales)]
        self.k, self.v = [t[:slots] for t in self.k_all], [t[:slots] for t in self.v_all]
        self.k_scale = [t[:slots] for t in self.k_scale_all]
        self.v_scale = [t[:slots] for t in self.v_scale_all]
        self._scratch = torch.arange(slots, rows, device=self.device, dtype=torch.int32)
        self._store = store_kv if self.device.type == "cuda" else reference_store_kv

    @property
    def nbytes(self) -> int:
        tensors = self.k + self.v + self.k_scale + self.v_scale
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def bytes_per_token(self) -> int:
        return self.nbytes // self.slots

    @property
    def scratch_nbytes(self) -> int:
        """Bytes of the scratch rows (not in :attr:`nbytes`, not transferred)."""
        return self.bytes_per_token * self.max_batch * self.block_len

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(k_scale, v_scale) ``[slots + scratch, kv_heads]`` fp32 of ``layer``; None unless fp8."""
        if self.dtype != "fp8":
            return None, None
        return self.k_scale_all[layer], self.v_scale_all[layer]

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows k, v ``[tokens, kv_heads, head_dim]`` at slots ``loc`` ``[tokens]`` (slot
        or scratch rows)."""
        if loc.numel() == 0:
            return
        ks, vs = self.scales(layer)
        self._store(k, v, self.k_all[layer], self.v_all[layer], loc, ks, vs)

    def scratch_rows(self, batch: int) -> torch.Tensor:
        """[batch, block_len] int32: the scratch rows of batch rows 0..batch-1."""
        if batch > self.max_batch:
            raise ValueError(
                f"draft KV pool: a draft pass over {batch} requests, but scratch rows were "
                f"allocated for {self.max_batch} (--max-running-requests)"
            )
        return self._scratch[: batch * self.block_len].view(batch, self.block_len)

    def read(self, layer: int, loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows at slots ``loc`` in the compute dtype (fp8 rows dequantized with their scales)."""
        loc = loc.long()
        k, v = self.k_all[layer][loc], self.v_all[layer][loc]
        if self.dtype == "fp8":
            k = k.float() * self.k_scale_all[layer][loc][..., None]
            v = v.float() * self.v_scale_all[layer][loc][..., None]
        return k.to(self.compute_dtype), v.to(self.compute_dtype)


def write_context_kv(
    draft: Any,
    pool: DraftKVPool,
    taps: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    max_position: int | None,
) -> None:
    """The draft's context K/V of tokens at ``positions`` (``max_position``: their bound, known
    on the host) into ``pool`` at ``slots``, every layer."""
    if slots.numel() == 0:
        return
    for layer, (k, v) in enumerate(draft.context_kv(taps, positions, max_position)):
        pool.write(layer, slots, k, v)


def block_page_table(
    context_slots: torch.Tensor, context_lens: torch.Tensor, scratch: torch.Tensor
) -> torch.Tensor:
    """The token-level (page size 1) table of one draft pass: the context, then the block.

    context_slots: [batch, >= max context_len] int, row b's slots at positions 0..n_b-1 (e.g.
    SGLang's ``req_to_token[req_pool_indices]``; columns past n_b are not read);
    context_lens: [batch] int, n_b; scratch: [batch, k] int32 (:meth:`DraftKVPool.scratch_rows`).
    Returns a fresh [batch, width + k] int32 table (width = context_slots' columns) whose
    columns n_b..n_b+k-1 hold row b's scratch rows; nothing past n_b + k is meaningful.
    """
    batch, width = context_slots.shape
    k = scratch.shape[1]
    table = torch.empty(batch, width + k, dtype=torch.int32, device=context_slots.device)
    table[:, :width] = context_slots
    cols = context_lens.long()[:, None] + torch.arange(k, device=table.device)[None, :]
    return table.scatter_(1, cols, scratch.to(torch.int32))


def attention_q_dtype(kv_dtype: torch.dtype, q_dtype: torch.dtype) -> torch.dtype:
    """The query dtype of a draft layer's block attention: the pool's own for a 16-bit pool of
    another dtype (a bf16 draft pool under an fp16 target: the kernels take K/V in q's dtype or
    fp8), else the draft's compute dtype."""
    if kv_dtype in (torch.bfloat16, torch.float16) and kv_dtype != q_dtype:
        return kv_dtype
    return q_dtype


def check_block_attention(cfg, pool: DraftKVPool) -> None:
    """Refuse, at start-up, a draft whose block attention the atom kernels cannot run."""
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    kv_dtype = pool.k_all[0].dtype
    q_dtype = attention_q_dtype(kv_dtype, pool.compute_dtype)
    why = unsupported_reason(cfg.head_dim, 1, kv_dtype, q_dtype, group)
    if why is None and cfg.query_len * group > MAX_BLOCK_ROWS:
        why = (
            f"its block of {cfg.query_len} rows x GQA group {group} exceeds the "
            f"{MAX_BLOCK_ROWS} query rows of one attention tile"
        )
    if why is not None:
        raise ValueError(f"ATOM_DSPARK draft: the atom paged-attention kernels refuse it: {why}")
