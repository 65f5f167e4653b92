"""Pure-torch forward of a MiniMax-M3-style checkpoint: the oracle for teacher-forced log-probs.

One sequence, no cache, float64 by default. Attention goes through the sparse-attention torch
references (``reference_block_scores`` / ``reference_select_blocks`` /
``reference_sparse_attention`` / ``reference_dense_attention``). Paths below are relative to
``sglang/srt`` of SGLang 0.5.23; ``m3`` is ``models/minimax_m3.py``.

Modelling choices and what they mirror:

* Residual stream: pre-norm, ``h += attn(norm1(h)); h += mlp(norm2(h))``, final norm, lm_head
  (m3:1748 decoder norms, m3:1883 final norm, lm_head untied).
* Every RMSNorm is Gemma-style, ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in float
  (layers/layernorm.py:1152 ``GemmaRMSNorm.forward_native``; used when ``use_gemma_norm``).
* q/k norms are per head over ``head_dim`` (m3:875, ``qk_norm_type == "per_head"``); the index
  q/k norms per index head over ``sparse_index_dim`` (m3:882). Norm before RoPE (m3:1039).
* RoPE is NeoX-style on the first ``rotary_dim`` channels of each head, the rest pass through
  (m3:773 ``rotary_dim``; layers/rotary_embedding/base.py:240 inverse frequencies over
  ``rotary_dim``, base.py:347 rotate/pass split; utils.py:52 NeoX halves). The index heads use
  the same rotary (m3:856) applied per index head. SGLang's class views the index tensors in
  ``head_dim`` chunks (base.py:347), which only agrees with this when
  ``sparse_index_dim == head_dim``.
* Attention scale ``head_dim ** -0.5`` (m3:769); index scores scaled by
  ``sparse_index_dim ** -0.5`` (layers/attention/minimax_sparse_backend.py:869).
* Sparse layers (``sparse_attention_freq[i] != 0``, configs/model_config.py:460) project
  ``index_q`` [tokens, sparse_num_index_heads, index_dim] and ONE ``index_k`` head; with
  ``sparse_disable_index_value`` set there is no index value/output (m3:1108, m3:1638), which
  is the only variant modelled here. Index head ``h`` picks the blocks of KV head ``h``.
* With ``use_index_cache`` and ``index_topk_freq > 1``, sparse layers whose ordinal does not
  score reuse the previous selection (ATOM semantics, ``SparseConfig.scores``).
* MLP: dense layers (``moe_layer_freq[i] == 0``, m3:1791) use ``dense_intermediate_size``
  (m3:1741) with SiLU-and-mul (m3:335); gate_proj first, up_proj second (stacked mapping).
* MoE (m3:445-450): router logits in float32 from ``gate`` (m3:720); scores by
  ``scoring_func`` (sigmoid or softmax); experts picked by ``score + e_score_correction_bias``,
  weighted by the unbiased score, renormalised to sum 1, times ``routed_scaling_factor``
  (layers/moe/topk.py:1098 ``fused_topk_torch_native``). Experts are ``w2(silu(w1 x) * w3 x)``
  (``swiglu_alpha``/``swiglu_limit`` None: layers/moe/moe_runner/triton_utils/fused_moe.py:741).
  The shared expert (``n_shared_experts * intermediate_size``, m3:455) is added unscaled
  (m3:646).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from sgl_atom.kernels.sparse_attention.index_reuse import should_score
from sgl_atom.kernels.sparse_attention.reference import (
    int4_query,
    reference_block_scores,
    reference_dense_attention,
    reference_index_write,
    reference_select_blocks,
    reference_sparse_attention,
    unpack_int4,
)

from sgl_atom.attention.sparse import SparseConfig


@dataclass
class M3Reference:
    cfg: dict
    weights: dict[str, torch.Tensor]
    sparse: SparseConfig
    dtype: torch.dtype = torch.float64
    index_dtype: str | None = None  # "int4": score as the served 4-bit index keys and kernels do

    @classmethod
    def load(
        cls, path, dtype: torch.dtype = torch.float64, index_dtype: str | None = None,
        **sparse_overrides,
    ) -> M3Reference:  # fmt: skip
        """Read config.json + model.safetensors; ``sparse_overrides`` replace SparseConfig fields
        (e.g. ``topk_blocks=8``); ``index_dtype`` "int4" scores the blocks from index keys
        rounded as the served packed 4-bit index cache stores them (SGL_ATOM_M3_INDEX_DTYPE)."""
        from safetensors.torch import load_file

        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        sparse = SparseConfig.from_hf(cfg, cfg["num_key_value_heads"], cfg["head_dim"])
        if sparse_overrides:
            sparse = replace(sparse, **sparse_overrides)
        raw = load_file(str(path / "model.safetensors"))
        weights = {k.replace(".block_sparse_moe.", ".mlp."): v.to(dtype) for k, v in raw.items()}
        return cls(cfg, weights, sparse, dtype, index_dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        dense: bool = False,
        trace: dict | None = None,
        margins: list | None = None,
    ) -> torch.Tensor:
        """Logits [tokens, vocab] of one sequence at positions 0..; ``dense`` makes every layer
        attend causally to everything; ``trace`` (a dict) receives each sparse layer's
        ``(selected, count)``; ``margins`` (a list) receives each MoE layer's routing margins
        (``route_margin``)."""
        w, eps = self.weights, self.cfg["rms_norm_eps"]
        h = w["model.embed_tokens.weight"][input_ids.long()]
        holder: list = []
        for i in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = gemma_rms_norm(h, w[p + "input_layernorm.weight"], eps)
            h = h + self._attention(i, x, dense, holder, trace)
            x = gemma_rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
            h = h + (
                self._moe(p + "mlp.", x, margins)
                if self.cfg["moe_layer_freq"][i]
                else self._mlp(p + "mlp.", x)
            )
        h = gemma_rms_norm(h, w["model.norm.weight"], eps)
        return h @ w["lm_head.weight"].T

    def logprobs(self, input_ids: torch.Tensor, **kw) -> torch.Tensor:
        """Teacher-forced log-probs [tokens - 1] of input_ids[1:] given the prefix."""
        logp = self.forward(input_ids, **kw).log_softmax(-1)
        return logp[:-1].gather(-1, input_ids[1:].long()[:, None])[:, 0]

    def route_margins(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Per token, the smallest expert-routing margin over the MoE layers (the last chosen
        expert's choice score minus the best unchosen one's): where it is small, rounding
        elsewhere can pick another expert."""
        margins: list = []
        self.forward(input_ids, margins=margins)
        return torch.stack(margins).min(0).values

    # ---- attention ----
    def _heads(self, x, name, heads, dim):
        """Project, Gemma-norm per head, NeoX RoPE: [tokens, heads, dim]."""
        w, eps = self.weights, self.cfg["rms_norm_eps"]
        t = (x @ w[name + "_proj.weight"].T).view(x.shape[0], heads, dim)
        t = gemma_rms_norm(t, w[name + "_norm.weight"], eps)
        pos = torch.arange(x.shape[0])
        return rope_neox(t, pos, self.cfg["rotary_dim"], self.cfg["rope_theta"])

    def _attention(self, i, x, dense, holder, trace):
        c, a = self.cfg, f"model.layers.{i}.self_attn."
        hd, kvh = c["head_dim"], c["num_key_value_heads"]
        q = self._heads(x, a + "q", c["num_attention_heads"], hd)
        k = self._heads(x, a + "k", kvh, hd)
        v = (x @ self.weights[a + "v_proj.weight"].T).view(x.shape[0], kvh, hd)
        n = x.shape[0]
        table, lens, qo = torch.arange(n)[None], torch.tensor([n]), torch.tensor([0, n])
        common = (k, v, table, lens, qo)
        if dense or i not in self.sparse.ordinal_of:
            o = reference_dense_attention(q, *common, 1, hd**-0.5, dtype=self.dtype)
        else:
            selected = self._select(i, a, x, table, lens, qo, holder)
            if trace is not None:
                trace[i] = selected
            o = reference_sparse_attention(q, *common, selected[0], 1, hd**-0.5, dtype=self.dtype)
        return o.reshape(n, -1).to(self.dtype) @ self.weights[a + "o_proj.weight"].T

    def _select(self, i, a, x, table, lens, qo, holder):
        sc, ordinal = self.sparse, self.sparse.ordinal_of[i]
        if sc.use_index_cache and not should_score(
            ordinal, sc.index_topk_freq, sc.index_skip_topk_offset
        ):
            if not holder:
                raise RuntimeError(f"sparse layer {i} reuses a selection but none was scored")
            return holder[-1]
        idim = sc.index_dim
        iq = self._heads(x, a + "index_q", sc.num_index_heads, idim)
        ik = self._heads(x, a + "index_k", 1, idim)[:, 0]
        if self.index_dtype == "int4":  # keys as the cache holds them, q as the kernels round it
            ik, iq = int4_values(ik), int4_query(iq)
        scores = reference_block_scores(iq, ik, table, lens, qo, 1, idim**-0.5, dtype=self.dtype)
        picked = reference_select_blocks(
            scores, lens, qo, sc.topk_blocks, sc.init_blocks, sc.local_blocks
        )
        holder.append(picked)
        return picked

    # ---- MLP / MoE ----
    def _mlp(self, p, x):
        w = self.weights
        g, u = x @ w[p + "gate_proj.weight"].T, x @ w[p + "up_proj.weight"].T
        return (torch.nn.functional.silu(g) * u) @ w[p + "down_proj.weight"].T

    def _moe(self, p, x, margins: list | None = None):
        c, w = self.cfg, self.weights
        logits, bias = (
            x.float() @ w[p + "gate.weight"].float().T,
            w.get(p + "e_score_correction_bias"),
        )
        top_k, scoring = c["num_experts_per_tok"], c.get("scoring_func", "softmax")
        weights, ids = route(
            logits, bias, top_k, scoring, float(c.get("routed_scaling_factor", 1.0))
        )
        if margins is not None:
            margins.append(route_margin(logits, bias, top_k, scoring))
        out = torch.zeros_like(x)
        for e in range(c["num_local_experts"]):
            rows, slot = (ids == e).nonzero(as_tuple=True)
            if rows.numel():
                ex = f"{p}experts.{e}."
                y = torch.nn.functional.silu(x[rows] @ w[ex + "w1.weight"].T)
                y = (y * (x[rows] @ w[ex + "w3.weight"].T)) @ w[ex + "w2.weight"].T
                out.index_add_(0, rows, y * weights[rows, slot, None].to(x.dtype))
        if c.get("n_shared_experts"):
            out = out + self._mlp(p + "shared_experts.", x)
        return out


def int4_values(x: torch.Tensor) -> torch.Tensor:
    """Index keys [tokens, dim] as the packed 4-bit cache holds them (the kernels' reference
    writer, then q * scale), in x's dtype."""
    cache = torch.empty(x.shape[0], x.shape[1] // 2, dtype=torch.uint8)
    scale = torch.empty(x.shape[0])
    reference_index_write(x, cache, torch.arange(x.shape[0]), scale)
    return unpack_int4(cache, x.dtype) * scale.to(x.dtype)[:, None]


def route(logits, bias, top_k: int, scoring: str, scale: float):
    """(weights [tokens, top_k] float32, expert ids [tokens, top_k]): pick by score + bias,
    weigh by the unbiased score, renormalise, times the routed scaling factor."""
    choice, scores = _choice(logits, bias, scoring)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    return weights / weights.sum(-1, keepdim=True) * scale, ids


def route_margin(logits, bias, top_k: int, scoring: str) -> torch.Tensor:
    """Per token, the last picked expert's choice score minus the best one left out (float64;
    inf where every expert is picked): how close `route` is to picking another expert."""
    choice, _ = _choice(logits, bias, scoring)
    if choice.shape[-1] <= top_k:
        return torch.full((choice.shape[0],), float("inf"), dtype=torch.float64)
    top = choice.topk(top_k + 1, dim=-1).values
    return (top[:, top_k - 1] - top[:, top_k]).double()


def _choice(logits, bias, scoring: str):
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(-1)
    return (scores if bias is None else scores + bias.float()[None]), scores


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, scaled by ``1 + weight``."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


def rope_neox(x: torch.Tensor, pos: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """NeoX RoPE on the first ``rotary_dim`` channels of x [tokens, heads, dim]."""
    inv = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=pos.device) / rotary_dim
    inv = 1.0 / theta**inv
    ang = pos.to(torch.float64)[:, None] * inv[None]
    cos, sin = ang.cos().to(x.dtype)[:, None], ang.sin().to(x.dtype)[:, None]
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
