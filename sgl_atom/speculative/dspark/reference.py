"""Pure-torch reference of the DSpark draft: what the server integration must compute.

One sequence at a time; every tensor in the dtype of the weights given. Three steps:

1. **Taps.** After each target forward, the outputs of the target layers in
   ``target_layer_ids`` are concatenated per token: ``taps [tokens, num_taps * target_hidden]``
   (tap ``i`` = HF ``hidden_states[i + 1]``, before the target's final norm).
2. **Context K/V** (:func:`reference_context_kv`), for every token the target just ran,
   prefill chunks included: ``ctx = hidden_norm(fc(taps))`` once, then for every draft layer
   ``K = rope(k_norm(k_proj(ctx)))``, ``V = v_proj(ctx)`` at the tokens' own positions (no
   input_layernorm: the projected taps go straight into each layer's K/V projections). These
   rows go to the draft's own KV pool at the tokens' slots; each row depends on its own token
   only, so chunked writes equal one write.
3. **Propose** (:func:`reference_base_logits`): the block ``[anchor, MASK x (k-1)]`` at
   positions ``n .. n+k-1`` (n = context length, the anchor's position) is embedded with the
   target's embedding and run through the draft layers (pre-norm Qwen3 layers: q/k norms, RoPE,
   GQA, SwiGLU). Block queries attend to the n context rows and to all block rows, with no
   causal mask inside the block, and to nothing else. ``norm`` and the target's LM head give
   the base logits U [k, vocab]; :func:`sgl_atom.speculative.dspark.markov.markov_refine` turns them
   into draft tokens.
"""

from __future__ import annotations

import torch

from sgl_atom.speculative.dspark.config import DSparkDraftConfig
from sgl_atom.speculative.dspark.markov import markov_refine
from sgl_atom.speculative.dspark.rope import tables as rope_tables

Weights = dict[str, torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.pow(2).mean(dim=-1, keepdim=True)
    return x * torch.rsqrt(var + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, cfg: DSparkDraftConfig) -> torch.Tensor:
    """Rotate-half RoPE over the whole head, with the config's ``rope_theta`` and
    ``rope_scaling`` (:mod:`.rope`): x [tokens, heads, head_dim], positions [tokens]."""
    half = x.shape[-1] // 2
    cos, sin = rope_tables(cfg, positions.to(x.device))
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :].to(x.dtype) + rotated * sin[:, None, :].to(x.dtype)


def taps_from_hidden_states(
    hidden_states: tuple, target_layer_ids: tuple[int, ...]
) -> torch.Tensor:
    """Taps from an HF ``output_hidden_states`` tuple (embedding, then each layer's output).

    Returns [..., num_taps * hidden]. The last layer cannot be tapped this way: HF puts the
    final norm into its entry (and SGLang's Llama does not capture after the last layer).
    """
    last = len(hidden_states) - 2
    if max(target_layer_ids) >= last:
        raise ValueError(
            f"dspark_target_layer_ids={list(target_layer_ids)}: ids must be below {last} "
            "(the last target layer's output is not capturable)"
        )
    return torch.cat([hidden_states[i + 1] for i in target_layer_ids], dim=-1)


def check_taps(cfg: DSparkDraftConfig, taps: torch.Tensor) -> None:
    """Refuse taps that are not [tokens, num_taps * target_hidden]."""
    width = cfg.num_taps * cfg.tap_hidden_size
    if taps.dim() != 2 or taps.shape[1] != width:
        raise ValueError(
            f"taps must be [tokens, {width}] ({cfg.num_taps} taps of {cfg.tap_hidden_size}), "
            f"got {tuple(taps.shape)}"
        )


def project_taps(w: Weights, cfg: DSparkDraftConfig, taps: torch.Tensor) -> torch.Tensor:
    """taps [tokens, num_taps * target_hidden] -> ctx [tokens, hidden] (fc, then hidden_norm)."""
    check_taps(cfg, taps)
    return rms_norm(taps @ w["fc.weight"].T, w["hidden_norm.weight"], cfg.rms_norm_eps)


def _heads(x: torch.Tensor, n: int, cfg: DSparkDraftConfig) -> torch.Tensor:
    return x.view(x.shape[0], n, cfg.head_dim)


def _kv(w: Weights, cfg: DSparkDraftConfig, i: int, x: torch.Tensor, positions: torch.Tensor):
    p = f"layers.{i}.self_attn."
    k = _heads(x @ w[p + "k_proj.weight"].T, cfg.num_key_value_heads, cfg)
    k = rope(rms_norm(k, w[p + "k_norm.weight"], cfg.rms_norm_eps), positions, cfg)
    v = _heads(x @ w[p + "v_proj.weight"].T, cfg.num_key_value_heads, cfg)
    return k, v


def reference_context_kv(
    w: Weights, cfg: DSparkDraftConfig, taps: torch.Tensor, positions: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each draft layer's context (K, V), both [tokens, kv_heads, head_dim], from the taps."""
    ctx = project_taps(w, cfg, taps)
    return [_kv(w, cfg, i, ctx, positions) for i in range(cfg.num_hidden_layers)]


def block_input_ids(anchor: torch.Tensor, cfg: DSparkDraftConfig) -> torch.Tensor:
    """[batch] anchors -> [batch, query_len] draft input ids: the anchor, then mask tokens."""
    shape = (anchor.shape[0], cfg.query_len)
    ids = torch.full(shape, cfg.mask_token_id, dtype=torch.int64, device=anchor.device)
    ids[:, 0] = anchor
    return ids


def masked_attention(q, k, v, cfg: DSparkDraftConfig, mask=None) -> torch.Tensor:
    """q [nq, heads, d], k/v [nk, kv_heads, d]; ``mask`` [nq, nk] bool: the keys each query
    sees (None: every query sees every key)."""
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * cfg.head_dim**-0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    return out.reshape(q.shape[0], -1)


def draft_layer(w, cfg, i, x, positions, ctx_k, ctx_v, mask=None) -> torch.Tensor:
    """Draft layer ``i`` over block rows x [nq, hidden] at ``positions`` [nq]: queries attend
    to the context rows ``ctx_k/ctx_v`` and to the block's own K/V (``mask`` [nq, nctx + nq]
    keeps several blocks apart when they run as one)."""
    p, eps = f"layers.{i}.", cfg.rms_norm_eps
    h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
    q = _heads(h @ w[p + "self_attn.q_proj.weight"].T, cfg.num_attention_heads, cfg)
    q = rope(rms_norm(q, w[p + "self_attn.q_norm.weight"], eps), positions, cfg)
    k, v = _kv(w, cfg, i, h, positions)
    attn = masked_attention(q, torch.cat([ctx_k, k]), torch.cat([ctx_v, v]), cfg, mask)
    x = x + attn @ w[p + "self_attn.o_proj.weight"].T
    h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
    gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
    return x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T


def reference_base_logits(
    w: Weights,
    cfg: DSparkDraftConfig,
    *,
    context_kv: list[tuple[torch.Tensor, torch.Tensor]],
    context_len: int,
    block_embeds: torch.Tensor,
    lm_head: torch.Tensor,
) -> torch.Tensor:
    """Base logits U [k, vocab] of one draft pass.

    context_kv: per draft layer (K, V) [>= context_len, kv_heads, head_dim], rows at positions
    0..context_len-1 (rows past context_len, like stale pool slots, are not read);
    block_embeds: [query_len, hidden], the target's embedding of :func:`block_input_ids`;
    lm_head: the target's [vocab, hidden] head.
    """
    if block_embeds.shape != (cfg.query_len, cfg.hidden_size):
        raise ValueError(
            f"block_embeds must be [query_len={cfg.query_len}, hidden={cfg.hidden_size}], "
            f"got {tuple(block_embeds.shape)}"
        )
    positions = torch.arange(context_len, context_len + cfg.query_len, device=block_embeds.device)
    x = block_embeds
    for i, (ck, cv) in enumerate(context_kv):
        x = draft_layer(w, cfg, i, x, positions, ck[:context_len], cv[:context_len])
    logits = rms_norm(x, w["norm.weight"], cfg.rms_norm_eps) @ lm_head.T
    return logits if cfg.sample_from_anchor else logits[1:]


def reference_propose(
    w: Weights,
    cfg: DSparkDraftConfig,
    *,
    taps: torch.Tensor,
    anchor: int,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft tokens [k] and base logits [k, vocab] after a context of ``len(taps)`` tokens.

    taps: [n, num_taps * target_hidden] for positions 0..n-1; anchor: the token at position n
    (the target's last greedy choice); embed, lm_head: the target's [vocab, hidden] matrices.
    """
    n = taps.shape[0]
    kv = reference_context_kv(w, cfg, taps, torch.arange(n, device=taps.device))
    ids = block_input_ids(torch.tensor([anchor], device=taps.device), cfg)[0]
    base = reference_base_logits(
        w, cfg, context_kv=kv, context_len=n, block_embeds=embed[ids], lm_head=lm_head
    )
    w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
    tokens = markov_refine(base[None], ids[:1], w1, w2)[0]
    return tokens, base
