"""A pure-torch Llama target for distillation: batched greedy decoding and taps on any device.

Reads an HF Llama checkpoint directory (``config.json``, ``model.safetensors``,
``tokenizer.json``) with only ``safetensors`` and ``tokenizers``, so distillation runs where
``transformers`` is absent. The math is HF's ``LlamaForCausalLM`` (pre-norm RMSNorm layers,
rotate-half RoPE over the whole head, GQA, SwiGLU, untied LM head); a unit test holds it to
the transformers forward.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F


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


def load_tokenizer(target_dir: Path):
    """The checkpoint's ``tokenizers`` tokenizer, or None when it ships no tokenizer.json."""
    if not (target_dir / "tokenizer.json").exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(target_dir / "tokenizer.json"))


class LlamaTarget:
    """Frozen target weights on one device; every method is batched and runs without grad."""

    def __init__(self, config: dict, weights: dict[str, torch.Tensor], tokenizer=None):
        self.cfg = config
        self.w = weights
        self.tokenizer = tokenizer
        self.num_layers = int(config["num_hidden_layers"])
        self.heads = int(config["num_attention_heads"])
        self.kv_heads = int(config.get("num_key_value_heads") or self.heads)
        self.hidden = int(config["hidden_size"])
        self.head_dim = int(config.get("head_dim") or self.hidden // self.heads)
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        rope = config.get("rope_parameters") or {}
        self.theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
            raise ValueError("only default (unscaled) RoPE is implemented")
        self.embed = weights["model.embed_tokens.weight"]
        self.lm_head = weights.get("lm_head.weight", self.embed)
        self.device = self.embed.device
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def load(cls, target_dir: Path, device: str | torch.device = "cpu") -> LlamaTarget:
        from safetensors.torch import load_file

        target_dir = Path(target_dir)
        config = json.loads((target_dir / "config.json").read_text())
        if config.get("model_type") != "llama":
            raise ValueError(f"{target_dir}: model_type {config.get('model_type')!r} is not llama")
        weights = {
            k: v.float().to(device)
            for k, v in load_file(str(target_dir / "model.safetensors")).items()
        }
        return cls(config, weights, load_tokenizer(target_dir))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts)]

    # ------------------------------------------------------------ forward pieces

    def _cos_sin(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope_cache is None or self._rope_cache[0].shape[0] < length:
            n = max(length, 256)
            half = self.head_dim // 2
            inv = 1.0 / self.theta ** (torch.arange(half, dtype=torch.float64) / half)
            ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
            ang = torch.cat([ang, ang], dim=-1)
            self._rope_cache = (
                ang.cos().float().to(self.device),
                ang.sin().float().to(self.device),
            )
        return self._rope_cache

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, heads, T, d] at ``positions`` [T]."""
        cos, sin = self._cos_sin(int(positions.max()) + 1)
        cos, sin = cos[positions], sin[positions]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        var = x.pow(2).mean(dim=-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.w[name]

    def _layer(self, i: int, x: torch.Tensor, start: int, cache: list | None) -> torch.Tensor:
        p = f"model.layers.{i}."
        b, t, _ = x.shape
        pos = torch.arange(start, start + t, device=x.device)
        h = self._norm(x, p + "input_layernorm.weight")
        q = (h @ self.w[p + "self_attn.q_proj.weight"].T).view(b, t, self.heads, -1)
        k = (h @ self.w[p + "self_attn.k_proj.weight"].T).view(b, t, self.kv_heads, -1)
        v = (h @ self.w[p + "self_attn.v_proj.weight"].T).view(b, t, self.kv_heads, -1)
        q = self._rope(q.transpose(1, 2), pos)
        k = self._rope(k.transpose(1, 2), pos)
        attn = cached_attention(q, k, v.transpose(1, 2), start, None if cache is None else cache[i])
        x = x + attn @ self.w[p + "self_attn.o_proj.weight"].T
        h = self._norm(x, p + "post_attention_layernorm.weight")
        gate = h @ self.w[p + "mlp.gate_proj.weight"].T
        up = h @ self.w[p + "mlp.up_proj.weight"].T
        return x + (F.silu(gate) * up) @ self.w[p + "mlp.down_proj.weight"].T

    @torch.no_grad()
    def forward(
        self,
        ids: torch.Tensor,
        tap_ids: tuple[int, ...] = (),
        *,
        start: int = 0,
        cache: list | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [B, T] -> (logits [B, T, vocab], taps [B, T, len(tap_ids) * hidden] or None).

        Tap ``i`` is the output of layer ``i`` (HF ``hidden_states[i + 1]``), before the final
        norm; the last layer's output can be tapped here too (HF's entry for it is normed, and
        serving does not capture it: measurements only). Right padding is harmless: attention
        is causal, so pads change no earlier row.
        """
        if tap_ids and (max(tap_ids) >= self.num_layers or min(tap_ids) < 0):
            raise ValueError(f"tap ids {list(tap_ids)} must lie in [0, {self.num_layers})")
        x = self.embed[ids]
        taps = []
        for i in range(self.num_layers):
            x = self._layer(i, x, start, cache)
            if i in tap_ids:
                taps.append(x)
        logits = self._norm(x, "model.norm.weight") @ self.lm_head.T
        return logits, (torch.cat(taps, dim=-1) if tap_ids else None)

    @torch.no_grad()
    def greedy(self, prompts: torch.Tensor, max_new: int) -> torch.Tensor:
        """Greedy continuations [B, max_new] of equal-length ``prompts`` [B, P], KV-cached."""
        b, plen = prompts.shape
        total = plen + max_new
        cache = [
            (
                torch.empty(b, self.kv_heads, total, self.head_dim, device=self.device),
                torch.empty(b, self.kv_heads, total, self.head_dim, device=self.device),
            )
            for _ in range(self.num_layers)
        ]
        logits, _ = self.forward(prompts, cache=cache)
        new = [logits[:, -1].argmax(dim=-1)]
        while len(new) < max_new:
            pos = plen + len(new) - 1
            logits, _ = self.forward(new[-1][:, None], start=pos, cache=cache)
            new.append(logits[:, -1].argmax(dim=-1))
        return torch.stack(new, dim=1)

    def greedy_sequences(
        self, prompts: list[list[int]], max_new: int, *, batch: int = 4096
    ) -> list[torch.Tensor]:
        """prompt + greedy continuation (CPU int64, one tensor per prompt, in prompt order).

        Prompts of one token length decode together, in chunks of ``batch`` rows.
        """
        by_len: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_len.setdefault(len(p), []).append(i)
        out: list[torch.Tensor | None] = [None] * len(prompts)
        for _, idx in sorted(by_len.items()):
            for c in range(0, len(idx), batch):
                rows = idx[c : c + batch]
                ids = torch.tensor([prompts[i] for i in rows], device=self.device)
                full = torch.cat([ids, self.greedy(ids, max_new)], dim=1).cpu()
                for r, i in enumerate(rows):
                    out[i] = full[r]
        return out  # type: ignore[return-value]
