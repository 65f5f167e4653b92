"""A pure-torch MiniMax-M3-style target for distillation: batched greedy decoding and taps.

Same interface as :class:`~dspark_training.llama_target.LlamaTarget` (``embed``,
``lm_head``, ``logits``, ``forward``, ``greedy``, ``greedy_sequences``, ``encode``,
``encode_batch``, ``num_layers``, ``hidden``, ``device``, ``w``), so the target trainer and the
DSpark distiller can drive either. The math is :class:`~m3_reference.M3Reference`'s
(whose ``gemma_rms_norm``, ``rope_neox`` and ``route`` it reuses), batched over right-padded
rows: Gemma RMSNorms, per-head q/k norms before NeoX RoPE on the first ``rotary_dim`` channels,
scale ``head_dim ** -0.5``, GQA, a SiLU-and-mul MLP on layers with ``moe_layer_freq[i] == 0``
and the routed MoE (plus unscaled shared experts) elsewhere, final Gemma norm, untied lm_head.
``_layer`` and ``logits`` keep autograd (the trainer backpropagates through them); ``forward``
and ``greedy`` run without grad. The router alone runs in float32 (as served); its matmul
rounds differently for other batch shapes, so a row of a batch agrees with the same row alone
to float32 rounding of the routing weights (about 1e-7 relative), even with float64 weights.

Attention is DENSE causal attention on every layer: no block scoring, so the ``index_q`` /
``index_k`` projections and their norms are loaded but unused. This equals the served sparse
model exactly when every visible KV block is selected. A query at position ``pos`` sees
``pos // block + 1`` blocks of ``block = 128`` tokens; the served selection keeps
``min(topk_blocks, visible)`` of them (``reference_select_blocks``: the init and local blocks
are forced in but count within the ``topk_blocks``, ``SparseConfig`` requires
``init + local <= topk``), so nothing is dropped iff ``pos // block + 1 <= topk_blocks`` for
every position, i.e. a sequence of at most ``topk_blocks * block`` tokens
(:attr:`M3Target.dense_exact_tokens`; reused selections of ``use_index_cache`` come from the same
positions and are complete too). Longer sequences differ silently from the served model, so
``forward`` / ``greedy`` refuse them unless ``allow_beyond_sparse=True``. A model without
sparse layers is exact up to ``max_position_embeddings``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from sgl_atom.kernels.sparse_attention import SPARSE_BLOCK

from m3_reference import gemma_rms_norm, rope_neox, route
from sgl_atom.attention.sparse import SparseConfig

from .llama_target import LlamaTarget, load_tokenizer

M3_MODEL_TYPE = "minimax_m2"  # what MiniMaxM3SparseForCausalLM checkpoints declare
M3_ARCHITECTURE = "MiniMaxM3SparseForCausalLM"


def _check_m3_config(target_dir: Path, config: dict) -> None:
    model_type, archs = config.get("model_type"), config.get("architectures") or []
    if model_type != M3_MODEL_TYPE or M3_ARCHITECTURE not in archs:
        raise ValueError(
            f"{target_dir}: model_type {model_type!r} (architectures {archs}) is not a MiniMax-M3 "
            f"checkpoint (model_type {M3_MODEL_TYPE!r}, {M3_ARCHITECTURE}); load a llama "
            "checkpoint with LlamaTarget, or any of both with load_target_model"
        )


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    cache: tuple[torch.Tensor, torch.Tensor] | None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal GQA attention of q [B, heads, T, d] over k, v [B, kv_heads, T, d] at positions
    start..start+T-1 -> [B, T, heads * d]. With ``cache`` (K, V [B, kv_heads, max, d]) the new
    K/V are written there first and every cached position up to start+T is attended: T == 1
    decodes against the whole cache; a multi-token chunk must start at position 0."""
    b, heads, t, _ = q.shape
    if cache is not None:
        ck, cv = cache
        ck[:, :, start : start + t] = k
        cv[:, :, start : start + t] = v
        k, v = ck[:, :, : start + t], cv[:, :, : start + t]
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    causal = t > 1
    if causal and start:
        raise ValueError("a multi-token chunk must start at position 0")
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return o.transpose(1, 2).reshape(b, t, -1)


class M3Target:
    """Frozen M3 target weights on one device; ``forward`` / ``greedy`` are batched, no grad."""

    def __init__(self, config: dict, weights: dict[str, torch.Tensor], tokenizer=None):
        self.cfg = config
        self.w = weights
        self.tokenizer = tokenizer
        self.num_layers = int(config["num_hidden_layers"])
        self.heads = int(config["num_attention_heads"])
        self.kv_heads = int(config["num_key_value_heads"])
        self.hidden = int(config["hidden_size"])
        self.head_dim = int(config["head_dim"])
        self.rotary_dim = int(config["rotary_dim"])
        self.theta = float(config["rope_theta"])
        self.eps = float(config["rms_norm_eps"])
        self.moe = [bool(f) for f in config["moe_layer_freq"]]
        self.sparse = SparseConfig.from_hf(config, self.kv_heads, self.head_dim)
        self.embed = weights["model.embed_tokens.weight"]
        self.lm_head = weights["lm_head.weight"]
        self.device = self.embed.device
        self.dtype = self.embed.dtype

    @classmethod
    def load(
        cls,
        target_dir: Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> M3Target:
        """Read config.json, model.safetensors (as ``dtype`` on ``device``; ``block_sparse_moe``
        renamed ``mlp`` like M3Reference) and tokenizer.json; refuse a non-M3 model_type."""
        from safetensors.torch import load_file

        target_dir = Path(target_dir)
        config = json.loads((target_dir / "config.json").read_text())
        _check_m3_config(target_dir, config)
        weights = {
            k.replace(".block_sparse_moe.", ".mlp."): v.to(device=device, dtype=dtype)
            for k, v in load_file(str(target_dir / "model.safetensors")).items()
        }
        return cls(config, weights, load_tokenizer(target_dir))

    # the same tokenizers tokenizer as LlamaTarget's
    encode = LlamaTarget.encode
    encode_batch = LlamaTarget.encode_batch

    @property
    def dense_exact_tokens(self) -> int:
        """Longest sequence (tokens) whose dense attention equals the served sparse attention:
        ``sparse_topk_blocks * 128`` (module docstring), capped by max_position_embeddings."""
        max_pos = int(self.cfg["max_position_embeddings"])
        if self.sparse is None or not self.sparse.sparse_layer_ids:
            return max_pos
        return min(self.sparse.topk_blocks * SPARSE_BLOCK, max_pos)

    def _check_length(self, tokens: int, allow_beyond_sparse: bool) -> None:
        bound = self.dense_exact_tokens
        if tokens > bound and not allow_beyond_sparse:
            raise ValueError(
                f"{tokens} tokens exceed dense_exact_tokens={bound}: past it the served model "
                "attends only its top-k sparse blocks and this dense forward differs; shorten "
                "the sequences or pass allow_beyond_sparse=True"
            )

    # ------------------------------------------------------------ forward pieces

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return gemma_rms_norm(x, self.w[name], self.eps)

    def _heads(self, h: torch.Tensor, name: str, heads: int, pos: torch.Tensor) -> torch.Tensor:
        """Project, Gemma-norm per head, NeoX RoPE: [B, heads, T, head_dim]."""
        b, t, _ = h.shape
        x = (h @ self.w[name + "_proj.weight"].T).view(b, t, heads, self.head_dim)
        x = gemma_rms_norm(x, self.w[name + "_norm.weight"], self.eps)
        return rope_neox(x, pos, self.rotary_dim, self.theta).transpose(1, 2)

    def _attention(self, i: int, h: torch.Tensor, start: int, cache: list | None) -> torch.Tensor:
        a = f"model.layers.{i}.self_attn."
        b, t, _ = h.shape
        pos = torch.arange(start, start + t, device=h.device)
        q = self._heads(h, a + "q", self.heads, pos)
        k = self._heads(h, a + "k", self.kv_heads, pos)
        v = (h @ self.w[a + "v_proj.weight"].T).view(b, t, self.kv_heads, -1).transpose(1, 2)
        layer_cache = None if cache is None else cache[i]
        o = cached_attention(q, k, v, start, layer_cache, scale=self.head_dim**-0.5)
        return o @ self.w[a + "o_proj.weight"].T

    def _mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        gate, up = x @ self.w[p + "gate_proj.weight"].T, x @ self.w[p + "up_proj.weight"].T
        return (F.silu(gate) * up) @ self.w[p + "down_proj.weight"].T

    def _moe(self, p: str, x: torch.Tensor) -> torch.Tensor:
        c, w, flat = self.cfg, self.w, x.reshape(-1, x.shape[-1])
        weights, ids = route(
            flat.float() @ w[p + "gate.weight"].float().T,
            w.get(p + "e_score_correction_bias"),
            int(c["num_experts_per_tok"]),
            c.get("scoring_func", "softmax"),
            float(c.get("routed_scaling_factor", 1.0)),
        )
        out = torch.zeros_like(flat)
        for e in range(int(c["num_local_experts"])):
            rows, slot = (ids == e).nonzero(as_tuple=True)
            if rows.numel():
                ex, xe = f"{p}experts.{e}.", flat[rows]
                y = F.silu(xe @ w[ex + "w1.weight"].T) * (xe @ w[ex + "w3.weight"].T)
                y = (y @ w[ex + "w2.weight"].T) * weights[rows, slot, None].to(x.dtype)
                out = out.index_add(0, rows, y)
        if c.get("n_shared_experts"):
            out = out + self._mlp(p + "shared_experts.", flat)
        return out.view_as(x)

    def _layer(
        self,
        i: int,
        x: torch.Tensor,
        start: int,
        cache: list | None,
        *,
        allow_beyond_sparse: bool = False,
    ) -> torch.Tensor:
        """Decoder layer ``i`` on the residual stream x [B, T, hidden] at positions start.."""
        self._check_length(start + x.shape[1], allow_beyond_sparse)
        p = f"model.layers.{i}."
        x = x + self._attention(i, self._norm(x, p + "input_layernorm.weight"), start, cache)
        h = self._norm(x, p + "post_attention_layernorm.weight")
        return x + (self._moe(p + "mlp.", h) if self.moe[i] else self._mlp(p + "mlp.", h))

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] of ids [B, T] through :meth:`_layer`, with autograd."""
        x = self.embed[ids]
        for i in range(self.num_layers):
            x = self._layer(i, x, 0, None)
        return self._norm(x, "model.norm.weight") @ self.lm_head.T

    @torch.no_grad()
    def forward(
        self,
        ids: torch.Tensor,
        tap_ids: tuple[int, ...] = (),
        *,
        start: int = 0,
        cache: list | None = None,
        allow_beyond_sparse: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [B, T] -> (logits [B, T, vocab], taps [B, T, len(tap_ids) * hidden] or None).

        Tap ``i`` is the output of layer ``i``, before the final norm. Right padding is
        harmless: attention is causal and the MoE routes each row on its own. Raises
        ValueError past :attr:`dense_exact_tokens` unless ``allow_beyond_sparse``.
        """
        if tap_ids and (max(tap_ids) >= self.num_layers or min(tap_ids) < 0):
            raise ValueError(f"tap ids {list(tap_ids)} must lie in [0, {self.num_layers})")
        self._check_length(start + ids.shape[1], allow_beyond_sparse)
        x = self.embed[ids]
        taps = []
        for i in range(self.num_layers):
            x = self._layer(i, x, start, cache, allow_beyond_sparse=allow_beyond_sparse)
            if i in tap_ids:
                taps.append(x)
        logits = self._norm(x, "model.norm.weight") @ self.lm_head.T
        return logits, (torch.cat(taps, dim=-1) if tap_ids else None)

    @torch.no_grad()
    def greedy(
        self, prompts: torch.Tensor, max_new: int, *, allow_beyond_sparse: bool = False
    ) -> torch.Tensor:
        """Greedy continuations [B, max_new] of equal-length ``prompts`` [B, P], KV-cached.
        The last new token is never fed back, so P + max_new - 1 tokens must be dense-exact."""
        b, plen = prompts.shape
        self._check_length(plen + max_new - 1, allow_beyond_sparse)
        total = plen + max_new
        shape = (b, self.kv_heads, total, self.head_dim)
        # NaN-filled: a read of an unwritten slot would show in the logits
        cache = [
            tuple(torch.full(shape, torch.nan, device=self.device, dtype=self.dtype) for _ in "kv")
            for _ in range(self.num_layers)
        ]
        kw = dict(cache=cache, allow_beyond_sparse=allow_beyond_sparse)
        logits, _ = self.forward(prompts, **kw)
        new = [logits[:, -1].argmax(dim=-1)]
        while len(new) < max_new:
            pos = plen + len(new) - 1
            logits, _ = self.forward(new[-1][:, None], start=pos, **kw)
            new.append(logits[:, -1].argmax(dim=-1))
        return torch.stack(new, dim=1)

    # prompts of one token length decode together (LlamaTarget's batching over self.greedy, so
    # sequences past dense_exact_tokens are refused)
    greedy_sequences = LlamaTarget.greedy_sequences


TorchTarget = LlamaTarget | M3Target  # the targets distillation and training run


def load_target_model(target_dir: Path, device: str | torch.device = "cpu") -> TorchTarget:
    """LlamaTarget or M3Target by config.json's model_type (float32 on ``device``)."""
    target_dir = Path(target_dir)
    model_type = json.loads((target_dir / "config.json").read_text()).get("model_type")
    if model_type == "llama":
        return LlamaTarget.load(target_dir, device)
    if model_type == M3_MODEL_TYPE:
        return M3Target.load(target_dir, device)
    raise ValueError(
        f"{target_dir}: no distillation target for model_type {model_type!r}; "
        f"supported: 'llama', {M3_MODEL_TYPE!r}"
    )
