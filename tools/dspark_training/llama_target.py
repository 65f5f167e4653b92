"""The Llama target for distillation: transformers' ``LlamaForCausalLM`` behind the interface the
distiller and the target trainer drive (shared with :class:`~dspark_training.m3_target.M3Target`):
taps of any layer, batched KV-cached greedy decoding, the checkpoint's ``tokenizers`` tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def load_tokenizer(target_dir: Path):
    """The checkpoint's ``tokenizers`` tokenizer, or None when it ships no tokenizer.json."""
    if not (target_dir / "tokenizer.json").exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(target_dir / "tokenizer.json"))


class LlamaTarget:
    """A float32 ``LlamaForCausalLM`` on one device; ``forward`` / ``greedy`` run without grad."""

    def __init__(self, model, tokenizer=None):
        self.model = model
        self.tokenizer = tokenizer
        self.num_layers = int(model.config.num_hidden_layers)
        self.hidden = int(model.config.hidden_size)
        self.w = dict(model.named_parameters())  # checkpoint names, e.g. model.norm.weight
        self.embed = model.get_input_embeddings().weight.detach()  # [vocab, hidden]
        self.lm_head = model.get_output_embeddings().weight.detach()  # [vocab, hidden]
        self.device = self.embed.device

    @classmethod
    def load(cls, target_dir: Path, device: str | torch.device = "cpu") -> LlamaTarget:
        """Read a llama checkpoint directory, frozen (eval, no grad), float32 on ``device``."""
        from transformers import LlamaForCausalLM

        target_dir = Path(target_dir)
        model_type = json.loads((target_dir / "config.json").read_text()).get("model_type")
        if model_type != "llama":
            raise ValueError(f"{target_dir}: model_type {model_type!r} is not llama")
        model = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        model.requires_grad_(False)
        return cls(model.to(device).eval(), load_tokenizer(target_dir))

    @classmethod
    def from_weights(
        cls, config: dict, weights: dict[str, torch.Tensor], tokenizer=None
    ) -> LlamaTarget:
        """A trainable model of ``config`` (a config.json dict) holding copies of ``weights``
        (every checkpoint tensor, float32, all on one device); its parameters are ``self.w``."""
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig.from_dict(config)).float()
        model.load_state_dict(weights, strict=True)
        return cls(model.to(next(iter(weights.values())).device).eval(), tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts)]

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] of ids [B, T], with autograd (the target trainer's loss)."""
        return self.model(ids, use_cache=False).logits

    @torch.no_grad()
    def forward(
        self, ids: torch.Tensor, tap_ids: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [B, T] -> (logits [B, T, vocab], taps [B, T, len(tap_ids) * hidden] or None).

        Tap ``i`` is the output of decoder layer ``i`` before the final norm (HF
        ``hidden_states[i + 1]`` below the last layer), read by a forward hook on the layer. The
        last layer's output can be tapped too (HF's entry for it is normed, and serving does not
        capture it: measurements only). Right padding is harmless: attention is causal, so pads
        change no earlier row.
        """
        if tap_ids and (max(tap_ids) >= self.num_layers or min(tap_ids) < 0):
            raise ValueError(f"tap ids {list(tap_ids)} must lie in [0, {self.num_layers})")
        out: dict[int, torch.Tensor] = {}
        layers = self.model.model.layers
        hooks = [layers[i].register_forward_hook(_keep_output(out, i)) for i in set(tap_ids)]
        try:
            logits = self.model(ids, use_cache=False).logits
        finally:
            for h in hooks:
                h.remove()
        return logits, (torch.cat([out[i] for i in tap_ids], dim=-1) if tap_ids else None)

    @torch.no_grad()
    def greedy(self, prompts: torch.Tensor, max_new: int) -> torch.Tensor:
        """Greedy continuations [B, max_new] of equal-length ``prompts`` [B, P], through HF's
        KV cache, with no stop token."""
        out = self.model(prompts, use_cache=True, logits_to_keep=1)
        new = [out.logits[:, -1].argmax(dim=-1)]
        while len(new) < max_new:
            out = self.model(new[-1][:, None], past_key_values=out.past_key_values, use_cache=True)
            new.append(out.logits[:, -1].argmax(dim=-1))
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


def _keep_output(out: dict[int, torch.Tensor], i: int):
    def hook(_module, _args, output):
        out[i] = output  # LlamaDecoderLayer returns the residual stream [B, T, hidden]

    return hook
