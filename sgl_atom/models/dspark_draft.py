"""``AtomDSparkDraftModel``: the DSpark draft as an SGLang model class.

Registered with SGLang's model registry when ``SGLANG_EXTERNAL_MODEL_PACKAGE=sgl_atom.models``
(the draft checkpoint's ``architectures[0]`` names it). The ``ATOM_DSPARK`` speculative worker
(:mod:`sgl_atom.spec.dspark.worker`) builds it through the registry and drives its two entry
points; neither runs through SGLang's ModelRunner, because the draft keeps its own KV pool
(:class:`sgl_atom.spec.dspark.pool.DraftKVPool`) at the settled draft KV dtype:

* :meth:`context_kv` — the draft layers' K/V of tokens the target just ran, from their taps;
* :meth:`propose` — one non-causal pass over ``[anchor, MASK x (k-1)]`` per request against
  that request's context rows, refined left to right by the low-rank Markov head.

The math is :mod:`sgl_atom.spec.dspark.reference`'s (batched here: the blocks of a batch run as
one masked pass).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from sgl_atom.spec.dspark import reference as ref
from sgl_atom.spec.dspark.config import DSparkDraftConfig
from sgl_atom.spec.dspark.markov import markov_refine
from sgl_atom.spec.dspark.weights import check_draft_weights


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

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            self.w[name.removeprefix("model.")] = tensor  # unknown names are refused below
        check_draft_weights(self.dspark, self.w)

    def place(self, device: torch.device | str, dtype: torch.dtype) -> AtomDSparkDraftModel:
        self.w = {n: t.to(device=device, dtype=dtype).contiguous() for n, t in self.w.items()}
        return self

    @torch.no_grad()
    def context_kv(
        self, taps: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """taps [tokens, num_taps * target_hidden], positions [tokens] -> per draft layer
        (K, V), each [tokens, kv_heads, head_dim]."""
        dtype = self.w["fc.weight"].dtype
        return ref.reference_context_kv(self.w, self.dspark, taps.to(dtype), positions)

    @torch.no_grad()
    def propose(
        self,
        *,
        anchors: torch.Tensor,
        context_lens: torch.Tensor,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],
        context_owner: torch.Tensor,
        embed: torch.Tensor,
        lm_head: torch.Tensor,
    ) -> torch.Tensor:
        """Draft tokens [batch, k].

        anchors [batch]: each request's last committed token, at position ``context_lens``;
        context_kv: per layer (K, V) [rows, kv_heads, head_dim], every request's context rows
        one after another; context_owner [rows]: the request of each row;
        embed, lm_head: the target's [vocab, hidden] matrices.
        """
        cfg, q = self.dspark, self.dspark.query_len
        batch = anchors.shape[0]
        owner = torch.arange(batch, device=anchors.device).repeat_interleave(q)
        offsets = torch.arange(q, device=anchors.device).repeat(batch)
        positions = context_lens.to(anchors.device).long()[owner] + offsets
        mask = torch.cat(
            [owner[:, None] == context_owner[None, :], owner[:, None] == owner[None, :]], dim=1
        )
        ids = ref.block_input_ids(anchors, cfg)
        x = embed[ids.reshape(-1)].to(self.w["fc.weight"].dtype)
        for i, (ck, cv) in enumerate(context_kv):
            x = ref.draft_layer(self.w, cfg, i, x, positions, ck, cv, mask)
        logits = ref.rms_norm(x, self.w["norm.weight"], cfg.rms_norm_eps) @ lm_head.T
        logits = logits.view(batch, q, -1)
        base = logits if cfg.sample_from_anchor else logits[:, 1:]
        w1, w2 = self.w["markov_head.markov_w1.weight"], self.w["markov_head.markov_w2.weight"]
        return markov_refine(base, anchors, w1, w2)


EntryClass = AtomDSparkDraftModel
