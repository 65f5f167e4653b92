"""``AtomDSparkDraftModel``: the DSpark draft as an SGLang model class.

Registered with SGLang's model registry when ``SGLANG_EXTERNAL_MODEL_PACKAGE=sgl_atom.models``
(the draft checkpoint's ``architectures[0]`` names it). The ``ATOM_DSPARK`` speculative worker
(:mod:`sgl_atom.speculative.dspark.worker`) builds it through the registry and drives its two entry
points; neither runs through SGLang's ModelRunner, because the draft keeps its own KV pool
(:class:`sgl_atom.speculative.dspark.pool.DraftKVPool`) at the settled draft KV dtype:

* :meth:`context_kv` — the draft layers' K/V of tokens the target just ran, from their taps;
* :meth:`propose` — one non-causal pass over ``[anchor, MASK x (k-1)]`` for every request of a
  batch at once, refined left to right by the low-rank Markov head.

The layers are SGLang's: fused ``QKVParallelLinear`` and ``MergedColumnParallelLinear``
projections and ``ReplicatedLinear`` ones, all replicated by design (``parallel_group=
"replicated"``: the draft is small and runs whole on every TP rank, beside the target's shards),
``RMSNorm`` (residual adds fused into the next norm), ``SiluAndMul`` and the rotary embedding of
``get_rope`` with the config's ``rope_theta`` and ``rope_scaling``. A draft layer's block attention
is one paged-attention call: the block's K/V go to the pool's scratch rows, which the page table
places right after each request's context, and the atom ``verify`` kernel with ``causal=False``
lets every block row see context and block (``kernel_ops(device).block``; on CPU
``SGL_ATOM_CPU_KERNELS`` picks the interpreted kernel or its torch reference, as for the atom
backend). The math is :mod:`sgl_atom.speculative.dspark.reference`'s, the float64 test oracle.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
)
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.utils import add_prefix
from torch import nn

from sgl_atom.attention import decode_tuning
from sgl_atom.kernels.common import num_sms
from sgl_atom.kernels.paged_attention import decode_num_splits
from sgl_atom.log import get_logger
from sgl_atom.speculative.dspark import reference as ref
from sgl_atom.speculative.dspark.config import DSparkDraftConfig
from sgl_atom.speculative.dspark.fp8_weights import (
    DraftFp8LinearMethod,
    Fp8Rows,
    fp8_matmul,
    is_quantized,
    weight_rows,
)
from sgl_atom.speculative.dspark.markov import markov_refine
from sgl_atom.speculative.dspark.pool import attention_q_dtype
from sgl_atom.speculative.dspark.weights import check_draft_weights

logger = get_logger("sgl_atom.speculative")

REPLICATED = "replicated"  # SGLang's linear parallel group of a layer every rank holds whole
# checkpoint name part -> (fused parameter name part, shard id), as SGLang's Llama loads them
STACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class DSparkDraftAttention(nn.Module):
    """q/k/v in one GEMM, per-head q and k RMSNorm, the output projection; the attention itself
    is the model's (over the draft pool)."""

    def __init__(self, cfg: DSparkDraftConfig, prefix: str) -> None:
        super().__init__()
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size, self.head_dim = hq * d, hkv * d, d
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, d, hq, hkv, bias=False, parallel_group=REPLICATED,
            prefix=add_prefix("qkv_proj", prefix),
        )  # fmt: skip
        self.o_proj = ReplicatedLinear(
            hq * d, cfg.hidden_size, bias=False, prefix=add_prefix("o_proj", prefix)
        )
        self.q_norm = RMSNorm(d, eps=cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, eps=cfg.rms_norm_eps)

    def heads_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """``norm`` over every head of x [tokens, heads * head_dim] -> [tokens, heads, head_dim]."""
        return norm(x.reshape(-1, self.head_dim)).view(x.shape[0], -1, self.head_dim)

    def kv(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(K before its norm, V) [tokens, kv_size] of context rows: one GEMM over the fused
        weight's k/v rows (no q rows: the context is never a query)."""
        if is_quantized(self.qkv_proj):
            kv = fp8_matmul(hidden, weight_rows(self.qkv_proj).rows(self.q_size), hidden.dtype)
        else:
            kv = nn.functional.linear(hidden, self.qkv_proj.weight[self.q_size :])
        return kv.split([self.kv_size, self.kv_size], dim=-1)


class DSparkDraftMLP(nn.Module):
    def __init__(self, cfg: DSparkDraftConfig, prefix: str) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [inter, inter], bias=False, parallel_group=REPLICATED,
            prefix=add_prefix("gate_up_proj", prefix),
        )  # fmt: skip
        self.act_fn = SiluAndMul()
        self.down_proj = ReplicatedLinear(
            inter, cfg.hidden_size, bias=False, prefix=add_prefix("down_proj", prefix)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(self.act_fn(gate_up))
        return out


class DSparkDraftLayer(nn.Module):
    def __init__(self, cfg: DSparkDraftConfig, prefix: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = DSparkDraftAttention(cfg, add_prefix("self_attn", prefix))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = DSparkDraftMLP(cfg, add_prefix("mlp", prefix))


class MarkovHead(nn.Module):
    """The low-rank Markov head's two [vocab, rank] matrices (read by ``markov_refine``)."""

    def __init__(self, cfg: DSparkDraftConfig) -> None:
        super().__init__()
        self.markov_w1 = ReplicatedLinear(cfg.markov_rank, cfg.vocab_size, bias=False)
        self.markov_w2 = ReplicatedLinear(cfg.markov_rank, cfg.vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    """A trained drafter's confidence head: loaded and checked, not used to draft."""

    def __init__(self, cfg: DSparkDraftConfig) -> None:
        super().__init__()
        width = cfg.hidden_size + (cfg.markov_rank if cfg.confidence_head_with_markov else 0)
        self.proj = ReplicatedLinear(width, 1, bias=True)


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
        self.dspark = cfg = DSparkDraftConfig.from_hf_dict(raw)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = ReplicatedLinear(cfg.num_taps * cfg.tap_hidden_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, eps=eps)
        self.layers = nn.ModuleList(
            DSparkDraftLayer(cfg, add_prefix(f"layers.{i}", prefix))
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(h, eps=eps)
        self.markov_head = MarkovHead(cfg)
        if cfg.enable_confidence_head:
            self.confidence_head = ConfidenceHead(cfg)
        self.rotary_emb = self._rope(cfg.max_position_embeddings)
        self._tilings: dict[tuple, decode_tuning.DecodeTuning] = {}
        self.weight_quantization: str | None = None  # "fp8" once quantize_fp8 ran

    # ------------------------------------------------------------- weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's tensors (q/k/v and gate/up into their fused parameters); a missing,
        unexpected or misshapen tensor is refused before any parameter is written."""
        named = {name.removeprefix("model."): t for name, t in weights}
        check_draft_weights(self.dspark, named)
        params = dict(self.named_parameters())
        for name, tensor in named.items():
            part = name.split(".")[-2]
            if part in STACKED:
                fused, shard = STACKED[part]
                param = params[name.replace(f".{part}.", f".{fused}.")]
                param.weight_loader(param, tensor, shard)
            else:
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)

    def checkpoint_weights(self) -> dict[str, torch.Tensor]:
        """Every tensor under its checkpoint name: views of the served parameters (the fused
        q/k/v and gate/up split by rows), what the float64 reference reads; an fp8 layer's
        weight dequantized (float32), as its GEMMs multiply by it."""
        out = {}
        for name, param in self.named_parameters():
            if name.endswith(".weight_scale"):
                continue
            module = self.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self
            data = weight_rows(module).dequantized() if is_quantized(module) else param.data
            owner, fused = name.rsplit(".", 2)[:2] if name.count(".") > 1 else ("", "")
            parts = [p for p, (f, _) in STACKED.items() if f == fused]
            if not parts:
                out[name] = data
                continue
            rows = self.get_submodule(f"{owner}.{fused}").output_sizes
            for part, chunk in zip(parts, data.split(rows), strict=True):
                out[name.replace(f".{fused}.", f".{part}.")] = chunk
        return out

    def place(self, device: torch.device | str, dtype: torch.dtype) -> AtomDSparkDraftModel:
        """Parameters to ``device`` and ``dtype`` (the target's), the rotary table to
        ``device`` (it stays float32): the passes need a placed draft. Before
        :meth:`quantize_fp8`, which quantizes the placed weights."""
        if self.weight_quantization is not None:
            raise RuntimeError("place the draft before quantizing its weights")
        for param in self.parameters():
            param.data = param.data.to(device=device, dtype=dtype)
        self.rotary_emb.to(device)
        return self

    def linear_layers(self) -> dict[str, nn.Module]:
        """The draft's own GEMM layers by name: ``fc`` and each layer's fused q/k/v, o, fused
        gate/up and down projections (the Markov and confidence heads are not GEMMs of a pass)."""
        out = {"fc": self.fc}
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            for name, mod in (("self_attn.qkv_proj", attn.qkv_proj), ("self_attn.o_proj",
                              attn.o_proj), ("mlp.gate_up_proj", mlp.gate_up_proj),
                              ("mlp.down_proj", mlp.down_proj)):  # fmt: skip
                out[f"layers.{i}.{name}"] = mod
        return out

    def quantize_fp8(self) -> int:
        """Quantize the placed draft's GEMM layers and the Markov head's w2 to fp8 rows in
        place (each an SGLang layer with :class:`DraftFp8LinearMethod`); every layer is checked
        before any is changed. Returns the bytes their weights now take."""
        if self.weight_quantization is not None:
            return 0
        layers = self.linear_layers()
        rows = {name: Fp8Rows.of(mod.weight.data, name) for name, mod in layers.items()}
        w2 = layers["markov_head.markov_w2"] = self.markov_head.markov_w2
        rows["markov_head.markov_w2"] = Fp8Rows.quantize(w2.weight.data)  # no GEMM reads it
        for name, mod in layers.items():
            DraftFp8LinearMethod.install(mod, rows[name])
        self.weight_quantization = "fp8"
        return sum(r.nbytes for r in rows.values())

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the target's): the norms' weights, never quantized."""
        return self.hidden_norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    # ------------------------------------------------------------------ RoPE

    def _rope(self, positions: int) -> nn.Module:
        cfg = self.dspark
        scaling = cfg.rope_scaling.to_hf() if cfg.rope_scaling else None
        return get_rope(
            cfg.head_dim, cfg.head_dim, positions, cfg.rope_theta, True, scaling,
            dtype=torch.float32,
        )  # fmt: skip

    def cover_positions(self, positions: int) -> None:
        """Make the rotary table hold ``positions`` rows (positions 0..positions-1): SGLang's
        RoPE kernel reads past its table unchecked. Regrown (doubling) on the host, so call it
        before capturing a graph; refused when the scaling fixes the table shorter."""
        have = self.rotary_emb.cos_sin_cache.shape[0]
        if positions <= have:
            return
        n = have
        while n < positions:
            n *= 2
        rope = self._rope(n).to(self.device)
        if rope.cos_sin_cache.shape[0] < positions:
            cfg = self.dspark
            raise ValueError(
                f"the DSpark draft's RoPE ({cfg.rope_scaling.rope_type} scaling) covers "
                f"{rope.cos_sin_cache.shape[0]} positions, the server needs {positions}: serve "
                "a shorter --context-length"
            )
        self.rotary_emb = rope

    # ------------------------------------------------------------- layers

    @torch.no_grad()
    def context_kv(
        self, taps: torch.Tensor, positions: torch.Tensor, max_position: int | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """taps [tokens, num_taps * target_hidden], positions [tokens] -> per draft layer
        (K, V), each [tokens, kv_heads, head_dim] (head_dim contiguous). ``max_position``: a
        bound on ``positions`` known on the host (else read from the device)."""
        cfg = self.dspark
        ref.check_taps(cfg, taps)
        self.cover_positions(_bound(positions, max_position) + 1)
        ctx = self.hidden_norm(self.fc(taps.to(self.dtype))[0])
        out = []
        for layer in self.layers:
            attn = layer.self_attn
            k, v = attn.kv(ctx)
            k = attn.heads_norm(k, attn.k_norm)
            _, k = self.rotary_emb(positions, torch.empty_like(k), k)  # K alone: a dummy q
            out.append((k, v.view(k.shape)))
        return out

    def _block_layer(
        self, i: int, x: torch.Tensor, residual: torch.Tensor | None, blk
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft layer ``i`` over the block rows x [batch * k, hidden] of every request (the
        residual stream beside it, None before the first layer)."""
        layer = self.layers[i]
        attn = layer.self_attn
        if residual is None:
            x, residual = layer.input_layernorm(x), x
        else:
            x, residual = layer.input_layernorm(x, residual)
        qkv, _ = attn.qkv_proj(x)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = self.rotary_emb(blk.positions, attn.heads_norm(q, attn.q_norm),
                            attn.heads_norm(k, attn.k_norm))  # fmt: skip
        blk.pool.write(i, blk.scratch, k, v.view(k.shape))
        ks, vs = blk.pool.scales(i)
        qa = q.to(attention_q_dtype(blk.pool.k_all[i].dtype, q.dtype))
        out = blk.ops.block(
            qa,
            blk.pool.k_all[i],
            blk.pool.v_all[i],
            blk.page_table,
            blk.kv_lens,
            1,
            attn.head_dim**-0.5,
            self.dspark.query_len,
            torch.empty(qa.shape, dtype=qa.dtype, device=qa.device),
            ks,
            vs,
            num_splits=blk.num_splits,
            **blk.tiling,
        ).to(x.dtype)
        x, _ = attn.o_proj(out.reshape(x.shape[0], -1))
        x, residual = layer.post_attention_layernorm(x, residual)
        return layer.mlp(x), residual

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
        embed, lm_head: the target's [vocab, hidden] matrices (lm_head may be its fp8 rows,
        :class:`~sgl_atom.speculative.dspark.fp8_weights.Fp8Rows`); max_context: max n_b if the
        host knows it. Nothing but the scratch rows is written.
        """
        from sgl_atom.attention.kernel_ops import kernel_ops

        cfg, q = self.dspark, self.dspark.query_len
        batch = anchors.shape[0]
        lens = context_lens.to(anchors.device)
        positions = (lens.long()[:, None] + torch.arange(q, device=lens.device)).reshape(-1)
        self.cover_positions(_bound(lens, max_context) + q)
        # one split plan per batch size, from the pool's capacity rather than this step's
        # lengths: the block attention's kernels see the same split count at every step of a
        # batch size, so growing contexts do not make Triton compile new variants (the target's
        # verify runs in CUDA graphs, compiled at capture)
        tiling = self.block_tiling(pool.k_all[0].dtype, lens.device)
        sms = num_sms(lens.device)
        splits = decode_num_splits(batch, cfg.num_key_value_heads, pool.slots, sms, tiling.waves)
        blk = _Block(
            positions=positions,
            pool=pool,
            scratch=pool.scratch_rows(batch).reshape(-1),
            page_table=page_table,
            kv_lens=(lens + q).to(torch.int32),
            ops=kernel_ops(anchors.device),
            num_splits=splits,
            tiling=tiling.kernel_kwargs(),
        )
        x, residual = embed[ref.block_input_ids(anchors, cfg).reshape(-1)].to(self.dtype), None
        for i in range(len(self.layers)):
            x, residual = self._block_layer(i, x, residual, blk)
        h, _ = self.norm(x, residual)
        h = h.view(batch, q, -1)
        if not cfg.sample_from_anchor:  # the anchor's row samples nothing: no LM head for it
            h = h[:, 1:]
        if isinstance(lm_head, Fp8Rows):  # the draft's fp8 copy of the target's head
            return fp8_matmul(h, lm_head, self.dtype)
        return h @ lm_head.T.to(self.dtype)

    @torch.no_grad()
    def propose(self, *, anchors: torch.Tensor, **pass_args) -> torch.Tensor:
        """Draft tokens [batch, k] int64: :meth:`base_logits` (same arguments) refined by the
        Markov head, batched on the device."""
        base = self.base_logits(anchors=anchors, **pass_args)
        w1, w2 = self.markov_head.markov_w1.weight, self.markov_head.markov_w2
        if is_quantized(w2):
            rows = weight_rows(w2)
            return markov_refine(base, anchors, w1, rows.q, w2_scale=rows.scale)
        return markov_refine(base, anchors, w1, w2.weight)


@dataclass(frozen=True)
class _Block:
    """What every draft layer of one pass shares."""

    positions: torch.Tensor  # [batch * k] the block rows' positions
    pool: Any  # the DraftKVPool
    scratch: torch.Tensor  # [batch * k] the block rows' scratch slots
    page_table: torch.Tensor  # [batch, >= n + k] int32, page size 1
    kv_lens: torch.Tensor  # [batch] int32 n + k
    ops: Any  # sgl_atom.attention.kernel_ops.KernelOps
    num_splits: int  # the block attention's context splits (fixed per batch size)
    tiling: dict  # the block attention's kernel tiling (the device's verify tiling)


def _bound(values: torch.Tensor, bound: int | None) -> int:
    """``bound`` if the host knows it, else the largest of ``values`` (a device read)."""
    if bound is not None:
        return bound
    return int(values.max()) if values.numel() else 0


EntryClass = AtomDSparkDraftModel
