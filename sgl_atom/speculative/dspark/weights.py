"""The DSpark draft's checkpoint layout: weight names, shapes, and a seeded random init.

Names follow DeepSpec drafters (HF Qwen3 decoder layers, no ``model.`` prefix). The embedding
and LM head are the target's and are not in the draft checkpoint.
"""

from __future__ import annotations

import torch

from sgl_atom.speculative.dspark.config import DSparkDraftConfig


def draft_weight_shapes(cfg: DSparkDraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a draft checkpoint holds, by name, with its shape."""
    h, hd, r = cfg.hidden_size, cfg.head_dim, cfg.markov_rank
    q, kv, inter = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, cfg.num_taps * cfg.tap_hidden_size),
        "hidden_norm.weight": (h,),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    shapes |= {
        "norm.weight": (h,),
        "markov_head.markov_w1.weight": (cfg.vocab_size, r),
        "markov_head.markov_w2.weight": (cfg.vocab_size, r),
    }
    if cfg.enable_confidence_head:
        width = h + (r if cfg.confidence_head_with_markov else 0)
        shapes |= {"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)}
    return shapes


def init_draft_weights(
    cfg: DSparkDraftConfig, *, seed: int, init_range: float, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Seeded random weights: norms at one, biases at zero, the rest N(0, init_range)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in draft_weight_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif name.endswith(".bias"):
            t = torch.zeros(shape)
        else:
            t = torch.randn(shape, generator=gen) * init_range
        out[name] = t.to(dtype).contiguous()
    return out


def check_draft_weights(cfg: DSparkDraftConfig, weights: dict[str, torch.Tensor]) -> None:
    """Refuse a state dict that lacks a tensor, has one of the wrong shape, or an extra one."""
    expected = draft_weight_shapes(cfg)
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    bad = [n for n in expected if n in weights and tuple(weights[n].shape) != expected[n]]
    if missing or extra or bad:
        shapes = ", ".join(f"{n} {tuple(weights[n].shape)} != {expected[n]}" for n in bad)
        raise ValueError(
            f"DSpark draft weights do not match the config: missing {missing}, "
            f"unexpected {extra}, wrong shapes [{shapes}]"
        )
