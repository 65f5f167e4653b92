"""``AtomDSparkDraftModel``: the DSpark draft as an SGLang model class.

Registered with SGLang's model registry when ``SGLANG_EXTERNAL_MODEL_PACKAGE=sgl_atom.models``
(the draft checkpoint's ``architectures[0]`` names it). The ``ATOM_DSPARK`` speculative worker
(:mod:`sgl_atom.speculative.dspark.worker`) builds it through the registry and drives its two entry
points; neither runs through SGLang's ModelRunner, because the draft keeps its own KV pool
(:class:`sgl_atom.speculative.dspark.pool.DraftKVPool`) at the settled draft KV dtype:

* :meth:`context_kv` — the draft layers' K/V of tokens the target just ran, from their taps;
* :meth:`propose` — one non-causal pass over ``[anchor, MASK x (k-1)]`` for every request of a
  batch at once, refined left to right by the low-rank Markov head.

The math is :mod:`sgl_atom.speculative.dspark.reference`'s (the float64 test oracle), in fewer
launches: each layer's q/k/v and gate/up projections are one GEMM each (weights fused at load),
q and k heads are normalized and rotated together, norms are torch's fused RMSNorm, and the RoPE
rows of a pass are gathered once for all its layers. Every table lives on the inputs' device
(RoPE cos/sin of the config's ``rope_theta`` and ``rope_scaling``, :mod:`..rope`, cached per
device and dtype, grown on demand), and a draft layer's block attention
is one paged-attention call: the block's K/V go to the pool's
scratch rows, which the page table places right after each request's context, and the atom
``verify`` kernel with ``causal=False`` lets every block row see context and block
(``kernel_ops(device).block``; on CPU ``SGL_ATOM_CPU_KERNELS`` picks the interpreted kernel or
its torch reference, as for the atom backend).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sgl_atom.attention import decode_tuning
from sgl_atom.kernels.common import num_sms
from sgl_atom.kernels.paged_attention import decode_num_splits
from sgl_atom.log import get_logger
from sgl_atom.speculative.dspark import reference as ref
from sgl_atom.speculative.dspark.config import DSparkDraftConfig
from sgl_atom.speculative.dspark.markov import markov_refine
from sgl_atom.speculative.dspark.pool import attention_q_dtype
from sgl_atom.speculative.dspark.rope import tables as scaled_rope_tables
from sgl_atom.speculative.dspark.weights import check_draft_weights

logger = get_logger("sgl_atom.speculative")

MIN_ROPE_POSITIONS = 4096  # first RoPE table length; it doubles past the positions asked for


class AtomDSparkDraftModel(nn.Module):
    """Draft layers, tap projection, final norm and Markov head; the embedding and LM head
    are the target's (passed to :meth:`propose`)."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        if quant_config is not None:
            raise ValueError(
                "AtomDSparkDraftModel does not take a quantized checkpoint: serve the draft "
                "unquantized (its KV can still be fp8 via --speculative-draft-kv-cache-dtype)"
            )
        raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        self.dspark = DSparkDraftConfig.from_hf_dict(raw)
        self.w: dict[str, torch.Tensor] = {}
        self._rope: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self._tilings: dict[tuple, decode_tuning.DecodeTuning] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            self.w[name.removeprefix("model.")] = tensor  # unknown names are refused below
        check_draft_weights(self.dspark, self.w)

    def place(self, device: torch.device | str, dtype: torch.dtype) -> AtomDSparkDraftModel:
        """Weights to ``device`` and ``dtype``, projections fused there (once, at the served
        placement): the passes need a placed draft."""
        self.w = {n: t.to(device=device, dtype=dtype).contiguous() for n, t in self.w.items()}
        self._fuse_projections()
        self._rope.clear()
        return self

    def _fuse_projections(self) -> None:
        """Each layer's q/k/v and gate/up weights as one matrix, so a pass runs one GEMM for
        each; the named weights become row views of it (nothing is held twice). The q and k
        norms' weights stacked per head ``[q_heads + kv_heads, head_dim]``: both are
        normalized and rotated in one go."""
        cfg = self.dspark
        self._qkv, self._gate_up, self._qk_norm = [], [], []
        for i in range(cfg.num_hidden_layers):
            a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
            self._qkv.append(
                self._stack([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"])
            )
            self._gate_up.append(self._stack([m + "gate_proj.weight", m + "up_proj.weight"]))
            qn, kn = self.w[a + "q_norm.weight"], self.w[a + "k_norm.weight"]
            heads = (qn.expand(cfg.num_attention_heads, -1), kn.expand(cfg.num_key_value_heads, -1))
            self._qk_norm.append(torch.cat(heads))

    def _stack(self, names: list[str]) -> torch.Tensor:
        fused = torch.cat([self.w[n] for n in names])
        row = 0
        for n in names:
            rows = self.w[n].shape[0]
            self.w[n] = fused[row : row + rows]
            row += rows
        return fused

    @property
    def dtype(self) -> torch.dtype:
        return self.w["fc.weight"].dtype

    # ------------------------------------------------------------------ RoPE

    def rope_tables(
        self, device: torch.device, dtype: torch.dtype, positions: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [>= positions, head_dim] on ``device``, float64 for a float64 draft else
        float32; computed once per device and dtype and regrown (doubling) when too short."""
        table = torch.float64 if dtype == torch.float64 else torch.float32
        key = (torch.device(device), table)
        cached = self._rope.get(key)
        if cached is None or cached[0].shape[0] < positions:
            n = max(MIN_ROPE_POSITIONS, cached[0].shape[0] if cached else 0)
            while n < positions:
                n *= 2
            cached = self._rope[key] = _rope_tables(self.dspark, device, table, n)
        return cached

    def _rope_rows(self, positions: torch.Tensor, max_position: int | None):
        """(cos, sin) [tokens, 1, head_dim] at ``positions``, gathered once per pass for every
        layer's rotations; ``max_position`` a bound known on the host (else read from the
        device, a sync; the worker always passes it)."""
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else 0
        cos, sin = self.rope_tables(positions.device, self.dtype, max_position + 1)
        return cos[positions][:, None, :], sin[positions][:, None, :]

    @staticmethod
    def _rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """reference.rope of x [tokens, heads, head_dim] with the rows of :meth:`_rope_rows`."""
        cos, sin = rope
        half = x.shape[-1] // 2
        xf = x.to(cos.dtype)
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return torch.addcmul(xf * cos, rotated, sin).to(x.dtype)

    # ------------------------------------------------------------- layers

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """reference.rms_norm as one op (torch's fused RMSNorm on CUDA)."""
        w = self.w[name]
        return F.rms_norm(x, (w.shape[-1],), w, self.dspark.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(x.shape[0], n, self.dspark.head_dim)

    def _context_layer_kv(
        self, i: int, ctx: torch.Tensor, rope
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s (K, V) of context rows: one GEMM over the fused weight's k/v rows."""
        cfg = self.dspark
        kv_width = cfg.num_key_value_heads * cfg.head_dim
        kv = ctx @ self._qkv[i][-2 * kv_width :].T
        k = self._norm(self._heads(kv[:, :kv_width], cfg.num_key_value_heads),
                       f"layers.{i}.self_attn.k_norm.weight")  # fmt: skip
        return self._rotate(k, rope), self._heads(kv[:, kv_width:], cfg.num_key_value_heads)

    @torch.no_grad()
    def context_kv(
        self, taps: torch.Tensor, positions: torch.Tensor, max_position: int | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """taps [tokens, num_taps * target_hidden], positions [tokens] -> per draft layer
        (K, V), each [tokens, kv_heads, head_dim] (views of one GEMM's output: token stride
        free, head_dim contiguous). ``max_position``: a bound on ``positions`` known on the
        host (else read from the device)."""
        cfg = self.dspark
        ref.check_taps(cfg, taps)
        ctx = self._norm(taps.to(self.dtype) @ self.w["fc.weight"].T, "hidden_norm.weight")
        rope = self._rope_rows(positions, max_position)
        return [self._context_layer_kv(i, ctx, rope) for i in range(cfg.num_hidden_layers)]

    def _block_layer(self, i: int, x: torch.Tensor, blk) -> torch.Tensor:
        """Draft layer ``i`` over the block rows x [batch * k, hidden] of every request: one
        GEMM for q/k/v, q and k normalized and rotated together, one GEMM for gate/up."""
        p, cfg = f"layers.{i}.", self.dspark
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = self._norm(x, p + "input_layernorm.weight")
        qkv = h @ self._qkv[i].T
        qk = F.rms_norm(qkv[:, : (hq + hkv) * d].view(-1, hq + hkv, d), (d,), None,
                        cfg.rms_norm_eps) * self._qk_norm[i]  # fmt: skip
        qk = self._rotate(qk, blk.rope)
        q, k = qk[:, :hq], qk[:, hq:]
        blk.pool.write(i, blk.scratch, k, self._heads(qkv[:, (hq + hkv) * d :], hkv))
        ks, vs = blk.pool.scales(i)
        qa = q.to(attention_q_dtype(blk.pool.k_all[i].dtype, q.dtype))
        attn = blk.ops.block(
            qa,
            blk.pool.k_all[i],
            blk.pool.v_all[i],
            blk.page_table,
            blk.kv_lens,
            1,
            cfg.head_dim**-0.5,
            cfg.query_len,
            torch.empty(qa.shape, dtype=qa.dtype, device=qa.device),
            ks,
            vs,
            num_splits=blk.num_splits,
            **blk.tiling,
        ).to(q.dtype)
        # the residual adds ride in the GEMMs' epilogues (addmm)
        x = torch.addmm(x, attn.reshape(x.shape[0], -1), self.w[p + "self_attn.o_proj.weight"].T)
        h = self._norm(x, p + "post_attention_layernorm.weight")
        gate, up = (h @ self._gate_up[i].T).chunk(2, dim=-1)
        return torch.addmm(x, F.silu(gate) * up, self.w[p + "mlp.down_proj.weight"].T)

    # ------------------------------------------------------------- propose

    def block_tiling(
        self, kv_dtype: torch.dtype, device: torch.device
    ) -> decode_tuning.DecodeTuning:
        """The tiling of the block attention over a ``kv_dtype`` pool: on CUDA the device's
        target-verify tiling for that KV kind (``SGL_ATOM_DECODE_TUNING``, else the committed
        file of the device, else the launcher's defaults), as the atom backend launches the
        target's verify, whose tiles are of the same kind (a KV head's query rows of every
        block token: 16 here at k = 4 and GQA 4, 20 for the target's k + 1); the launcher's
        defaults on CPU. A file's fp8 ``kv_mode`` that the draft's query dtype cannot take is
        refused here, at the first pass (start-up's graph capture)."""
        q_dtype = attention_q_dtype(kv_dtype, self.dtype)
        key = (device, kv_dtype, q_dtype)
        if key in self._tilings:
            return self._tilings[key]
        tiling = decode_tuning.DecodeTuning()
        if device.type == "cuda":
            fp8 = kv_dtype == torch.float8_e4m3fn
            tiling, line = decode_tuning.for_device("verify", fp8, device, q_dtype)
            logger.info("ATOM_DSPARK draft block attention %s", line)
        self._tilings[key] = tiling
        return tiling

    @torch.no_grad()
    def base_logits(
        self,
        *,
        anchors: torch.Tensor,
        context_lens: torch.Tensor,
        page_table: torch.Tensor,
        pool,
        embed: torch.Tensor,
        lm_head: torch.Tensor,
        max_context: int | None = None,
    ) -> torch.Tensor:
        """Base logits U [batch, k, vocab] of one draft pass over every request's block.

        anchors [batch]: each request's last committed token, at position n_b = context_lens[b];
        page_table [batch, >= max n_b + k] int32 page-size-1 table into ``pool``: columns
        0..n_b-1 the context rows, n_b..n_b+k-1 ``pool.scratch_rows(batch)[b]``
        (:func:`sgl_atom.speculative.dspark.pool.block_page_table`); pool: the draft's
        :class:`~sgl_atom.speculative.dspark.pool.DraftKVPool`, whose scratch rows this overwrites;
        embed, lm_head: the target's [vocab, hidden] matrices; max_context: max n_b if the host
        knows it. Nothing but the scratch rows is written.
        """
        from sgl_atom.attention.kernel_ops import kernel_ops

        cfg, q = self.dspark, self.dspark.query_len
        batch = anchors.shape[0]
        lens = context_lens.to(anchors.device)
        positions = (lens.long()[:, None] + torch.arange(q, device=lens.device)).reshape(-1)
        if max_context is None:
            max_context = int(lens.max()) if batch else 0
        # one split plan per batch size, from the pool's capacity rather than this step's
        # lengths: the block attention's kernels see the same split count at every step of a
        # batch size, so growing contexts do not make Triton compile new variants (the target's
        # verify runs in CUDA graphs, compiled at capture)
        tiling = self.block_tiling(pool.k_all[0].dtype, lens.device)
        sms = num_sms(lens.device)
        splits = decode_num_splits(batch, cfg.num_key_value_heads, pool.slots, sms, tiling.waves)
        blk = _Block(
            rope=self._rope_rows(positions, max_context + q - 1),
            pool=pool,
            scratch=pool.scratch_rows(batch).reshape(-1),
            page_table=page_table,
            kv_lens=(lens + q).to(torch.int32),
            ops=kernel_ops(anchors.device),
            num_splits=splits,
            tiling=tiling.kernel_kwargs(),
        )
        x = embed[ref.block_input_ids(anchors, cfg).reshape(-1)].to(self.dtype)
        for i in range(cfg.num_hidden_layers):
            x = self._block_layer(i, x, blk)
        h = self._norm(x, "norm.weight").view(batch, q, -1)
        if not cfg.sample_from_anchor:  # the anchor's row samples nothing: no LM head for it
            h = h[:, 1:]
        return h @ lm_head.T.to(self.dtype)

    @torch.no_grad()
    def propose(self, *, anchors: torch.Tensor, **pass_args) -> torch.Tensor:
        """Draft tokens [batch, k] int64: :meth:`base_logits` (same arguments) refined by the
        Markov head, batched on the device."""
        base = self.base_logits(anchors=anchors, **pass_args)
        w1, w2 = self.w["markov_head.markov_w1.weight"], self.w["markov_head.markov_w2.weight"]
        return markov_refine(base, anchors, w1, w2)


@dataclass(frozen=True)
class _Block:
    """What every draft layer of one pass shares."""

    rope: tuple[torch.Tensor, torch.Tensor]  # (cos, sin) [batch * k, 1, head_dim] of the block rows
    pool: Any  # the DraftKVPool
    scratch: torch.Tensor  # [batch * k] the block rows' scratch slots
    page_table: torch.Tensor  # [batch, >= n + k] int32, page size 1
    kv_lens: torch.Tensor  # [batch] int32 n + k
    ops: Any  # sgl_atom.attention.kernel_ops.KernelOps
    num_splits: int  # the block attention's context splits (fixed per batch size)
    tiling: dict  # the block attention's kernel tiling (the device's verify tiling)


def _rope_tables(cfg: DSparkDraftConfig, device, dtype: torch.dtype, n: int):
    cos, sin = scaled_rope_tables(cfg, torch.arange(n, device=device))
    return cos.to(dtype), sin.to(dtype)


EntryClass = AtomDSparkDraftModel
