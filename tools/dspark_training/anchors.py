"""Many DSpark draft passes at once: every anchor of a batch of greedy sequences.

A draft pass at anchor ``n`` of a sequence reads the context K/V of positions ``0..n-1`` (from
the target's taps) and the block ``[ids[n], MASK x (k-1)]`` at positions ``n..n+k-1``
(:func:`sgl_atom.speculative.dspark.reference.reference_base_logits`). Passes at different anchors
share the context K/V and differ only in how much of it they see, so one batched forward
serves all of them: block rows ``[B, A, query_len]`` attend to the ``[B, L]`` context rows
below their anchor (a mask) and to their own block (no mask). Used for training (the
teacher-forced loss) and for measuring tokens per forward without a step-by-step loop
(:func:`simulate_speculative`: the draft of every anchor is computed up front, then the
greedy-acceptance walk over the known greedy sequence reads them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sgl_atom.speculative.dspark import reference as ref
from sgl_atom.speculative.dspark.accept import SpecStats
from sgl_atom.speculative.dspark.config import DSparkDraftConfig
from sgl_atom.speculative.dspark.markov import markov_refine

_ROPE: dict = {}


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """:func:`reference.rope` with a cached table: x [..., heads, d], positions x.shape[:-2]."""
    d = x.shape[-1]
    need = int(positions.max()) + 1
    key = (d, theta, x.device, x.dtype)
    cos, sin = _ROPE.get(key, (None, None))
    if cos is None or cos.shape[0] < need:
        n = max(need, 512)
        half = d // 2
        inv = 1.0 / theta ** (torch.arange(half, dtype=torch.float64) / half)
        ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
        ang = torch.cat([ang, ang], dim=-1)
        cos, sin = ang.cos().to(x.device, x.dtype), ang.sin().to(x.device, x.dtype)
        _ROPE[key] = (cos, sin)
    cos, sin = cos[positions].unsqueeze(-2), sin[positions].unsqueeze(-2)
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def anchor_base_logits(
    w: dict,
    cfg: DSparkDraftConfig,
    taps: torch.Tensor,
    ids: torch.Tensor,
    anchors: torch.Tensor,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
) -> torch.Tensor:
    """Base logits [B, A, k, vocab] of the draft passes at ``anchors`` [B, A].

    taps [B, L, num_taps * target_hidden] and ids [B, L] hold B sequences (right padding is
    fine: a pass at anchor n reads rows below n and ids[n] only); anchors index positions in
    [0, L). Row (b, a) equals :func:`reference.reference_base_logits` with context
    ``taps[b, :n]`` and anchor ``ids[b, n]``, n = anchors[b, a].
    """
    b, length = ids.shape
    a, q, eps = anchors.shape[1], cfg.query_len, cfg.rms_norm_eps
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    group, scale = hq // hkv, d**-0.5
    ctx = ref.project_taps(w, cfg, taps.reshape(b * length, -1)).view(b, length, -1)
    ctx_pos = torch.arange(length, device=ids.device).expand(b, length)
    block = torch.full((b, a, q), cfg.mask_token_id, dtype=torch.long, device=ids.device)
    block[:, :, 0] = ids.gather(1, anchors)
    pos = anchors[:, :, None] + torch.arange(q, device=ids.device)
    sees = torch.arange(length, device=ids.device) < anchors[:, :, None]  # [B, A, L]
    bias = torch.zeros(sees.shape, dtype=taps.dtype, device=ids.device)
    bias = bias.masked_fill(~sees, float("-inf"))[:, None, :, None, :]  # [B, 1, A, 1, L]
    x = embed[block]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}.self_attn."
        kc = (ctx @ w[p + "k_proj.weight"].T).view(b, length, hkv, d)
        kc = _rope(ref.rms_norm(kc, w[p + "k_norm.weight"], eps), ctx_pos, cfg.rope_theta)
        vc = (ctx @ w[p + "v_proj.weight"].T).view(b, length, hkv, d)
        h = ref.rms_norm(x, w[f"layers.{i}.input_layernorm.weight"], eps)
        qb = (h @ w[p + "q_proj.weight"].T).view(b, a, q, hq, d)
        qb = _rope(ref.rms_norm(qb, w[p + "q_norm.weight"], eps), pos, cfg.rope_theta)
        kb = (h @ w[p + "k_proj.weight"].T).view(b, a, q, hkv, d)
        kb = _rope(ref.rms_norm(kb, w[p + "k_norm.weight"], eps), pos, cfg.rope_theta)
        vb = (h @ w[p + "v_proj.weight"].T).view(b, a, q, hkv, d)
        kc, vc = kc.repeat_interleave(group, dim=2), vc.repeat_interleave(group, dim=2)
        kb, vb = kb.repeat_interleave(group, dim=3), vb.repeat_interleave(group, dim=3)
        s_ctx = torch.einsum("bajhd,bmhd->bhajm", qb, kc) * scale + bias
        s_blk = torch.einsum("bajhd,baihd->bhaji", qb, kb) * scale
        prob = torch.cat([s_ctx, s_blk], dim=-1).softmax(dim=-1)
        out = torch.einsum("bhajm,bmhd->bajhd", prob[..., :length], vc)
        out = out + torch.einsum("bhaji,baihd->bajhd", prob[..., length:], vb)
        x = x + out.reshape(b, a, q, hq * d) @ w[p + "o_proj.weight"].T
        m = f"layers.{i}."
        h = ref.rms_norm(x, w[m + "post_attention_layernorm.weight"], eps)
        gate, up = h @ w[m + "mlp.gate_proj.weight"].T, h @ w[m + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[m + "mlp.down_proj.weight"].T
    logits = ref.rms_norm(x, w["norm.weight"], eps) @ lm_head.T
    return logits if cfg.sample_from_anchor else logits[:, :, 1:]


def teacher_forced_loss(
    w: dict,
    cfg: DSparkDraftConfig,
    taps: torch.Tensor,
    ids: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    position_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of the Markov-refined logits over the valid anchors' k positions.

    Position j of the block at anchor n is labelled ``ids[n + 1 + j]`` and its Markov bias
    reads the true previous token ``ids[n + j]``: a drafted token only counts while every
    earlier one was accepted, and then the refinement walked exactly those tokens.
    ``valid`` [B, A] bool masks anchors without k labels; ``position_weights`` [k] weighs the
    block positions (default all one).
    """
    k = cfg.block_size
    base = anchor_base_logits(w, cfg, taps, ids, anchors, embed, lm_head)  # [B, A, k, V]
    offs = anchors[:, :, None] + torch.arange(k + 1, device=ids.device)
    offs = offs.clamp(max=ids.shape[1] - 1)
    seq = ids.gather(1, offs.reshape(ids.shape[0], -1)).view(*offs.shape)
    prev, labels = seq[..., :k], seq[..., 1:]
    w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
    logits = base + w1[prev] @ w2.T
    ce = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), labels.reshape(-1), reduction="none")
    ce = ce.view(*labels.shape)
    if position_weights is not None:
        ce = ce * position_weights
    mask = valid[:, :, None].expand_as(ce).to(ce.dtype)
    norm = mask.sum() * (1.0 if position_weights is None else position_weights.mean())
    return (ce * mask).sum() / norm.clamp(min=1.0)


def pad_batch(seqs: list[torch.Tensor], pad_id: int, device) -> torch.Tensor:
    """Right-pad 1-D id tensors into [B, max_len] on ``device``."""
    out = torch.full((len(seqs), max(len(s) for s in seqs)), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out.to(device)


@torch.no_grad()
def draft_tokens_at_anchors(w, cfg, taps, ids, anchors, embed, lm_head) -> torch.Tensor:
    """The draft's proposals [B, A, k] at ``anchors`` [B, A] (Markov walk on its own tokens)."""
    base = anchor_base_logits(w, cfg, taps, ids, anchors, embed, lm_head)
    b, a, k, v = base.shape
    w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
    first = ids.gather(1, anchors).reshape(-1)
    return markov_refine(base.reshape(b * a, k, v), first, w1, w2).view(b, a, k)


def accept_walk(
    seq: list[int], draft: list[list[int]], prompt_len: int, *, k: int, max_new: int
) -> list[int]:
    """Accepted counts of the greedy speculative loop over a known greedy sequence.

    ``draft[a]`` is the block proposed at anchor ``prompt_len + a``; ``seq`` is prompt + the
    target's greedy continuation (at least ``max_new + k`` tokens of it). Mirrors
    :func:`dspark_training.distill.speculative_greedy`: the first greedy token is the
    first anchor; each step accepts the longest matching prefix and commits one more token.
    """
    if len(seq) < prompt_len + max_new + k:
        raise ValueError(f"need {max_new + k} greedy tokens, got {len(seq) - prompt_len}")
    n, produced, counts = prompt_len, 1, []
    while produced < max_new:
        block = draft[n - prompt_len][:k]
        acc = 0
        while acc < k and block[acc] == seq[n + 1 + acc]:
            acc += 1
        counts.append(acc)
        produced += acc + 1
        n += acc + 1
    return counts


@torch.no_grad()
def speculative_counts(
    target,
    cfg: DSparkDraftConfig,
    w: dict,
    seqs: list[torch.Tensor],
    prompt_lens: list[int],
    *,
    k: int,
    max_new: int,
    tap_ids: tuple[int, ...] | None = None,
    batch: int = 256,
) -> list[list[int]]:
    """Accepted counts per step of the greedy speculative loop, one list per sequence.

    ``target`` is a :class:`~dspark_training.llama_target.LlamaTarget`; each sequence is
    prompt + at least ``max_new + k`` greedy tokens. Gives the counters
    :func:`dspark_training.distill.evaluate` would (taps of committed positions do not
    depend on what follows them), up to float rounding in near ties; every draft pass of
    ``batch`` sequences runs in one batched forward.
    """
    tap_ids = cfg.target_layer_ids if tap_ids is None else tap_ids
    dev, out = target.device, []
    for c in range(0, len(seqs), batch):
        chunk, plens = seqs[c : c + batch], prompt_lens[c : c + batch]
        ids = pad_batch(chunk, 0, dev)
        _, taps = target.forward(ids, tap_ids)
        anchors = torch.tensor(plens, device=dev)[:, None] + torch.arange(max_new, device=dev)
        anchors = anchors.clamp(max=ids.shape[1] - 1)
        draft = draft_tokens_at_anchors(w, cfg, taps, ids, anchors, target.embed, target.lm_head)
        draft = draft.cpu().tolist()
        for s, p, dr in zip(chunk, plens, draft, strict=True):
            out.append(accept_walk(s.tolist(), dr, p, k=k, max_new=max_new))
    return out


def simulate_speculative(
    target, cfg: DSparkDraftConfig, w: dict, seqs, prompt_lens, *, k: int, max_new: int, **kw
) -> SpecStats:
    """:func:`speculative_counts` summed into one :class:`SpecStats`."""
    stats = SpecStats(block_size=k)
    for counts in speculative_counts(target, cfg, w, seqs, prompt_lens, k=k, max_new=max_new, **kw):
        stats.update(counts)
    return stats
