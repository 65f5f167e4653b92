"""MiniMax-M3-style sparse-attention MoE served through the atom attention backend.

Registered under ``MiniMaxM3SparseForCausalLM`` (the checkpoint's ``architectures[0]``), so with
``SGLANG_EXTERNAL_MODEL_PACKAGE=sgl_atom.models`` this class is loaded instead of SGLang's. It
needs ``--attention-backend atom``: dense layers attend through ``RadixAttention``, sparse layers
(``sparse_attention_freq[i] != 0``) through the atom backend's ``forward_sparse``. The
modelling follows the float64 reference ``tools/m3_reference.py`` (its docstring cites the
SGLang lines mirrored): pre-norm residual stream with Gemma RMSNorms, per-head q/k (and index
q/k) norms before NeoX RoPE on the first ``rotary_dim`` channels, index value disabled.

MoE: the routed experts are SGLang's ``FusedMoE`` (the fused Triton MoE on GPU; on a CPU without
AMX/sgl_kernel its native per-expert path, which matches a plain torch loop within bf16: max
0.008 in log-prob on the tiny checkpoint). Routing stays here, not in SGLang's ``TopK``: its
sigmoid routing on a CPU without AMX calls ``topk_sigmoid``, which SGLang 0.5.23 imports for
CUDA/HIP/XPU/MUSA only (layers/moe/topk.py). The routing is the reference's: sigmoid (or
softmax) scores in float32, experts chosen by score + ``e_score_correction_bias``, weighted by
the unbiased score renormalised to 1, times ``routed_scaling_factor``; the shared expert is
added. The routed experts run with ``inplace=False``: FusedMoE's default (``inplace=True``) lets
the CUDA Triton runner write the routed output over its input (SGLang 0.5.23
layers/moe/moe_runner/triton_utils/fused_moe.py:619), which the shared expert then read in
place of the normed hidden states; the CPU paths never write in place, so only the GPU was off
(tiny m3 on an H200: max |dlogp| 0.40 against the float64 reference).

Quantisation: ``--quantization fp8`` (an fp8 checkpoint, or a bf16 one quantised as it loads)
reaches the attention, index and MLP projections and the routed and shared experts, as in
SGLang's own M3 class; the router, the embedding and the LM head stay unquantised (a DSpark
draft reads the last two). Other methods are refused at start-up.

Layer taps (DSpark/DFlash drafts): :meth:`MiniMaxM3SparseForCausalLM.set_dflash_layers_to_capture`
arms them as SGLang's Llama does (models/llama.py): the output of HF layer ``i`` is the residual
stream entering layer ``i + 1`` (``h + residual``, as the input norm's fused add returns it), so
the last layer's output is not capturable. A forward whose ``capture_hidden_mode`` asks for
hidden states hands the captures to the LogitsProcessor, which packs them ``[tokens, taps *
hidden]`` into ``hidden_states``; a forward that does not ask runs as without taps.

Pipeline parallelism (``--pp-size``): a stage builds layers ``[start_layer, end_layer)`` (SGLang's
``make_pp_layers``; ``PPMissingLayer`` elsewhere), the embedding on the first stage, the final
norm and LM head on the last. A stage that is not the last returns ``PPProxyTensors`` with
``hidden_states`` and ``residual`` (the residual stream before the next layer's fused add),
plus, with ``use_index_cache``, the atom backend's latest top-k selection (``pp_export`` in
:mod:`sgl_atom.attention.sparse`), which the next stage's first sparse layers may reuse. Taps
under PP: see :class:`StageTaps`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import partial

import torch
import torch.nn.functional as F
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.aux_hidden_states import AuxHiddenStateList
from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm
from sglang.srt.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
from sglang.srt.layers.moe.topk import StandardTopKOutput
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.layers.utils import PPMissingLayer
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import PPProxyTensors
from sglang.srt.model_executor.forward_context import get_attn_backend
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils import add_prefix
from sglang.srt.utils.common import make_pp_layers
from sglang.srt.utils.hf_transformers_utils import get_rope_config
from torch import nn

from sgl_atom.attention.sparse import SparseConfig
from sgl_atom.log import get_logger

ATOM_BACKEND = "atom"
logger = get_logger("sgl_atom.models")


class M3ServingError(ValueError):
    """The server arguments cannot serve this model; names the flag and the fix."""


def _norm(config, dim: int) -> nn.Module:
    cls = GemmaRMSNorm if getattr(config, "use_gemma_norm", False) else RMSNorm
    return cls(dim, eps=config.rms_norm_eps)


def _attention_backends() -> list[str | None]:
    """The attention backends in effect (prefill/decode overrides included)."""
    from sglang.srt.runtime_context import get_server_args

    args = get_server_args()
    names = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")
    main = getattr(args, "attention_backend", None)
    return [main] + [getattr(args, n, None) or main for n in names[1:]]


def check_atom_backend() -> None:
    """Refuse to build the sparse model unless every attention step runs on the atom backend."""
    found = _attention_backends()
    if any(b != ATOM_BACKEND for b in found):
        raise M3ServingError(
            f"MiniMaxM3SparseForCausalLM (sgl_atom) runs its sparse layers on the atom backend, "
            f"got --attention-backend {found[0]!r} (prefill {found[1]!r}, decode {found[2]!r}); "
            f"launch with --attention-backend {ATOM_BACKEND} (and no other "
            "--prefill-attention-backend/--decode-attention-backend)"
        )


# --quantization methods this class builds its layers with (SGLang's fp8: an fp8 checkpoint, or
# a bf16 one quantised at load); the router and the embedding/LM head stay unquantised
QUANTIZATIONS = ("fp8",)


def check_quantization(quant_config) -> None:
    """Refuse a quantisation method this class was not built for, naming the ones it was."""
    name = quant_config.get_name() if quant_config is not None else None
    if name is not None and name not in QUANTIZATIONS:
        raise M3ServingError(
            f"sgl_atom's MiniMax-M3 model serves unquantised or {'/'.join(QUANTIZATIONS)} "
            f"checkpoints, got quantization {name!r}: use --quantization "
            f"{QUANTIZATIONS[0]} or none, or SGLang's class (unset "
            "SGLANG_EXTERNAL_MODEL_PACKAGE)"
        )


def _backend(forward_batch):
    """The step's atom backend. SGLang 0.5.23 keeps the backend in the forward context and, for
    a config with ``sparse_attention_config``, wraps the chosen backend in its
    ``MiniMaxHybridAttnBackend`` (layers/attention/attention_registry.py:375), whose ``dense``
    is ours: dense layers reach it through the wrapper, sparse layers take it from there."""
    backend = getattr(forward_batch, "attn_backend", None) or get_attn_backend()
    backend = getattr(backend, "dense", backend)
    if not hasattr(backend, "forward_sparse"):
        raise M3ServingError(
            f"sparse layers need the atom backend, got {type(backend).__name__}; launch with "
            f"--attention-backend {ATOM_BACKEND}"
        )
    return backend


class M3MLP(nn.Module):
    """SiLU-and-mul MLP: ``down(silu(gate x) * up x)``."""

    def __init__(self, hidden: int, inter: int, prefix: str = "", quant_config=None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden,
            [inter] * 2,
            bias=False,
            quant_config=quant_config,
            prefix=add_prefix("gate_up_proj", prefix),
        )
        self.down_proj = RowParallelLinear(
            inter,
            hidden,
            bias=False,
            quant_config=quant_config,
            prefix=add_prefix("down_proj", prefix),
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(self.act_fn(gate_up))
        return out


def route(logits: torch.Tensor, bias, top_k: int, scoring: str, scale: float):
    """(weights [tokens, top_k] float32, ids [tokens, top_k]) from float32 router logits."""
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(-1)
    choice = scores if bias is None else scores + bias.float()[None]
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    return weights / weights.sum(-1, keepdim=True) * scale, ids


class M3MoE(nn.Module):
    """Routed experts in SGLang's ``FusedMoE`` (``w13`` = [w1; w3], ``w2``), routing as the
    reference, plus the shared expert. ``quant_config`` reaches the experts and the shared
    expert; the router stays unquantised (its logits are taken in float32)."""

    def __init__(self, config, layer_id: int, prefix: str = "", quant_config=None):
        super().__init__()
        if getattr(config, "swiglu_alpha", None) or getattr(config, "swiglu_limit", None):
            raise M3ServingError(
                "sgl_atom's MiniMax-M3 MoE runs plain SiLU-and-mul experts; swiglu_alpha / "
                "swiglu_limit are not supported"
            )
        h, e = config.hidden_size, config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.scoring = getattr(config, "scoring_func", "softmax")
        self.scale = float(getattr(config, "routed_scaling_factor", 1.0) or 1.0)
        self.gate = ReplicatedLinear(h, e, bias=False, prefix=add_prefix("gate", prefix))
        self.e_score_correction_bias = None
        if getattr(config, "use_routing_bias", False):
            self.e_score_correction_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32))
        self.experts = FusedMoE(
            num_experts=e,
            hidden_size=h,
            intermediate_size=config.intermediate_size,
            layer_id=layer_id,
            top_k=self.top_k,
            reduce_results=True,
            prefix=add_prefix("experts", prefix),
            activation="silu",
            gate_up_interleaved=False,
            inplace=False,  # the shared expert reads x after the routed experts
            quant_config=quant_config,
        )
        shared = getattr(config, "n_shared_experts", 0) or 0
        self.shared_experts = (
            M3MLP(
                h,
                config.intermediate_size * shared,
                add_prefix("shared_experts", prefix),
                quant_config,
            )
            if shared
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.weight.float())
        weights, ids = route(
            logits, self.e_score_correction_bias, self.top_k, self.scoring, self.scale
        )
        out = self.experts(x, StandardTopKOutput(weights, ids.to(torch.int32), logits))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class M3Attention(nn.Module):
    """GQA attention with per-head norms and partial NeoX RoPE; sparse layers add the index
    q/k projections and attend through the step's atom backend's ``forward_sparse``."""

    def __init__(
        self,
        config,
        layer_id: int,
        sparse: SparseConfig | None,
        prefix: str = "",
        quant_config=None,
    ):
        super().__init__()
        if getattr(config, "qk_norm_type", "per_layer") != "per_head":
            raise M3ServingError(
                f"qk_norm_type={config.qk_norm_type!r} is not supported by sgl_atom's "
                "MiniMax-M3 model; supported: 'per_head'"
            )
        h, hd = config.hidden_size, config.head_dim
        theta, scaling = get_rope_config(config)
        self.layer_id, self.head_dim = layer_id, hd
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.qkv_proj = QKVParallelLinear(
            h,
            hd,
            self.num_heads,
            self.num_kv_heads,
            bias=False,
            quant_config=quant_config,
            prefix=add_prefix("qkv_proj", prefix),
        )
        self.o_proj = RowParallelLinear(
            self.num_heads * hd,
            h,
            bias=False,
            quant_config=quant_config,
            prefix=add_prefix("o_proj", prefix),
        )
        # this TP rank's heads (SGLang's cut: KV heads replicated when TP exceeds them)
        tp = get_parallel().tp_size
        if self.num_heads % tp or (self.num_kv_heads % tp and tp % self.num_kv_heads):
            raise M3ServingError(
                f"--tp-size {tp} does not divide num_attention_heads {self.num_heads} / "
                f"num_key_value_heads {self.num_kv_heads}: use a TP size that divides them"
            )
        local_heads, local_kv = self.num_heads // tp, max(1, self.num_kv_heads // tp)
        self.q_size, self.kv_size = local_heads * hd, local_kv * hd
        self.rotary_emb = get_rope(
            hd,
            rotary_dim=getattr(config, "rotary_dim", hd),
            max_position=config.max_position_embeddings,
            base=theta,
            is_neox_style=True,
            rope_scaling=scaling,
        )
        self.q_norm, self.k_norm = _norm(config, hd), _norm(config, hd)
        self.attn = RadixAttention(
            local_heads,
            hd,
            hd**-0.5,
            num_kv_heads=local_kv,
            layer_id=layer_id,
            prefix=add_prefix("attn", prefix),
        )
        self.sparse = sparse if sparse is not None and layer_id in sparse.ordinal_of else None
        if self.sparse is not None:
            idim, nidx = self.sparse.index_dim, self.sparse.num_index_heads
            self.index_q_proj = ReplicatedLinear(
                h,
                nidx * idim,
                bias=False,
                quant_config=quant_config,
                prefix=add_prefix("index_q_proj", prefix),
            )
            self.index_k_proj = ReplicatedLinear(
                h,
                idim,
                bias=False,
                quant_config=quant_config,
                prefix=add_prefix("index_k_proj", prefix),
            )
            self.index_q_norm, self.index_k_norm = _norm(config, idim), _norm(config, idim)

    def _heads(self, t: torch.Tensor, norm: nn.Module, dim: int) -> torch.Tensor:
        """[tokens, heads*dim] -> per-head norm -> [tokens, heads*dim]."""
        return norm(t.reshape(-1, dim)).reshape(t.shape[0], -1)

    def _index(self, x: torch.Tensor, positions: torch.Tensor):
        """index_q [tokens, index_heads, index_dim], index_k [tokens, index_dim]."""
        idim = self.sparse.index_dim
        iq = self._heads(self.index_q_proj(x)[0], self.index_q_norm, idim)
        ik = self._heads(self.index_k_proj(x)[0], self.index_k_norm, idim)
        iq, ik = self.rotary_emb(positions, iq, ik)
        return iq.reshape(x.shape[0], -1, idim), ik.reshape(x.shape[0], idim)

    def forward(self, positions, x: torch.Tensor, forward_batch) -> torch.Tensor:
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self._heads(q, self.q_norm, self.head_dim)
        k = self._heads(k, self.k_norm, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        if self.sparse is None:
            o = self.attn(q, k, v, forward_batch)
        else:
            index_q = index_k = None
            if self.sparse.scores(self.layer_id):
                index_q, index_k = self._index(x, positions)
            o = _backend(forward_batch).forward_sparse(
                q, k, v, index_q, index_k, self.attn, forward_batch
            )
        out, _ = self.o_proj(o)
        return out


class M3DecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        layer_id: int,
        sparse: SparseConfig | None,
        prefix: str = "",
        quant_config=None,
    ):
        super().__init__()
        h = config.hidden_size
        self.self_attn = M3Attention(
            config, layer_id, sparse, add_prefix("self_attn", prefix), quant_config
        )
        if config.moe_layer_freq[layer_id]:
            self.mlp = M3MoE(config, layer_id, add_prefix("mlp", prefix), quant_config)
        else:
            self.mlp = M3MLP(
                h, config.dense_intermediate_size, add_prefix("mlp", prefix), quant_config
            )
        self.input_layernorm = _norm(config, h)
        self.post_attention_layernorm = _norm(config, h)

    def forward(self, positions, h, residual, forward_batch, capture_output=None):
        """``capture_output``, when given, receives the residual stream entering this layer (the
        previous layer's output), borrowed (Llama's hook name: sgl_atom.speculative.dspark.pp_taps
        wraps it on earlier pipeline stages)."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm(h, residual)
        if capture_output is not None:
            capture_output(residual)
        x = self.self_attn(positions, x, forward_batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class StageTaps(dict):
    """The taps one forward of one pipeline stage captured: ``{HF layer id: [tokens, hidden]}``.

    The output of HF layer ``i`` is the residual stream entering layer ``i + 1``, so the stage
    holding layer ``i + 1`` captures it (a stage's first layer's input is the previous stage's
    output): every armed tap is captured on exactly one stage. A stage that is not the last
    leaves them in :attr:`MiniMaxM3SparseForCausalLM.stage_taps`; the last stage hands the
    LogitsProcessor, in HF order, its own and those given as ``carried_taps``, and only those
    (as SGLang's Llama: a relay such as sgl_atom.speculative.dspark.pp_taps puts the earlier stages'
    taps before them). Carrying taps between stages is not done here.
    """

    def capture_for(self, hf_layer: int):
        """A ``capture(hidden)`` callable that records a copy as HF layer ``hf_layer``'s output."""
        return partial(self._put, hf_layer)

    def _put(self, hf_layer: int, hidden: torch.Tensor) -> None:
        self[hf_layer] = hidden.clone()


class M3Model(nn.Module):
    # class-level defaults: whole model, no sparse layers (tests build the stack by hand)
    sparse: SparseConfig | None = None

    def __init__(self, config, sparse: SparseConfig | None, prefix: str = "", quant_config=None):
        super().__init__()
        pp = get_parallel().pp_group
        self.sparse = sparse
        self.embed_tokens = (
            VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, prefix=add_prefix("embed_tokens", prefix)
            )
            if pp.is_first_rank
            else PPMissingLayer()
        )
        self.layers, self.start_layer, self.end_layer = make_pp_layers(
            config.num_hidden_layers,
            lambda idx, prefix: M3DecoderLayer(config, idx, sparse, prefix, quant_config),
            prefix=add_prefix("layers", prefix),
        )
        self.norm = (
            _norm(config, config.hidden_size)
            if pp.is_last_rank
            else PPMissingLayer(return_tuple=True)
        )
        # layers whose input residual stream is captured (llama's convention: HF id + 1)
        self.layers_to_capture: list[int] = []

    @property
    def is_last_stage(self) -> bool:
        return self.end_layer == len(self.layers)

    def forward(
        self,
        input_ids,
        positions,
        forward_batch,
        input_embeds=None,
        aux=None,
        pp_proxy_tensors=None,
    ):
        """This stage's layers. ``aux``: an ``AuxHiddenStateList`` (taps appended in layer order)
        or a :class:`StageTaps` (keyed by HF layer id) receiving the residual stream entering
        each held layer of ``layers_to_capture``. Returns the final hidden states on the last
        stage, else ``PPProxyTensors`` for the next stage (see the module docstring)."""
        if self.start_layer == 0:
            h = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
            residual = None
        else:
            h, residual = pp_proxy_tensors["hidden_states"], pp_proxy_tensors["residual"]
            if self._reuses_selection():
                _backend(forward_batch).sparse.pp_import(pp_proxy_tensors.tensors)
        for i in range(self.start_layer, self.end_layer):
            capture = None
            if aux is not None and i in self.layers_to_capture:
                capture = aux.capture_for(i - 1) if isinstance(aux, StageTaps) else aux.capture
            h, residual = self.layers[i](
                positions, h, residual, forward_batch, capture_output=capture
            )
        if not self.is_last_stage:
            out = {"hidden_states": h, "residual": residual}
            if self._reuses_selection():
                out.update(_backend(forward_batch).sparse.pp_export())
            return PPProxyTensors(out)
        h, _ = self.norm(h, residual)
        return h

    def _reuses_selection(self) -> bool:
        """Whether sparse layers may reuse a selection scored on another stage."""
        return self.sparse is not None and self.sparse.use_index_cache


class MiniMaxM3SparseForCausalLM(nn.Module):
    # sparse layers run on the atom backend's forward_sparse: SGLang's MiniMax sparse
    # wrapper is not needed (sgl_atom.patches.m3_atom_unwrapped)
    SERVES_SPARSE_ON_ATOM = True
    stacked_params = (
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )

    stage_taps: StageTaps | None = None  # this stage's captures of the latest forward

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        check_quantization(quant_config)
        if quant_config is not None:
            logger.info(
                "sgl_atom MiniMax-M3: --quantization %s: attention, index and MLP projections "
                "and the routed and shared experts in %s; router, embedding and LM head bf16",
                quant_config.get_name(),
                quant_config.get_name(),
            )
        self.config = config
        self.sparse = SparseConfig.from_hf(config, config.num_key_value_heads, config.head_dim)
        if self.sparse is not None:
            self._check_sparse(config)
            check_atom_backend()
        self.model = M3Model(config, self.sparse, add_prefix("model", prefix), quant_config)
        self.lm_head = (
            ParallelLMHead(
                config.vocab_size, config.hidden_size, prefix=add_prefix("lm_head", prefix)
            )
            if self.model.is_last_stage
            else PPMissingLayer()
        )
        self.logits_processor = LogitsProcessor(config)
        self.capture_aux_hidden_states = False

    @staticmethod
    def _check_sparse(config) -> None:
        sc = config.sparse_attention_config
        disabled = list(sc.get("sparse_disable_index_value") or [])
        for i, f in enumerate(sc["sparse_attention_freq"]):
            if f and not (i < len(disabled) and disabled[i]):
                raise M3ServingError(
                    f"sparse_attention_config.sparse_disable_index_value[{i}] is off: sgl_atom's "
                    "sparse layers have no index value/output path; supported: index value "
                    "disabled on every sparse layer"
                )

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_embed_and_head(self):
        return self.model.embed_tokens.weight, self.lm_head.weight

    def set_dflash_layers_to_capture(self, layer_ids: list[int]) -> None:
        """Capture the outputs of HF layers ``layer_ids`` in every forward that asks for
        hidden states (SGLang's Llama convention: layer ``i``'s output is layer ``i + 1``'s
        input residual stream). Under PP every stage is armed with the same global ids and
        captures those it holds (:attr:`held_taps`)."""
        last = self.config.num_hidden_layers - 1
        if not layer_ids or any(not 0 <= i < last for i in layer_ids):
            raise ValueError(
                f"MiniMaxM3SparseForCausalLM taps {layer_ids}: give layer ids in [0, {last}); "
                f"the last layer's ({last}) output is not capturable"
            )
        self.capture_aux_hidden_states = True
        self.model.layers_to_capture = [i + 1 for i in layer_ids]

    @property
    def held_taps(self) -> list[int]:
        """The armed HF layer ids whose output this stage captures (it holds layer id + 1)."""
        m = self.model
        return [i - 1 for i in m.layers_to_capture if m.start_layer <= i < m.end_layer]

    @property
    def start_layer(self) -> int:
        return self.model.start_layer

    @property
    def end_layer(self) -> int:
        return self.model.end_layer

    def forward(
        self,
        input_ids,
        positions,
        forward_batch,
        input_embeds=None,
        pp_proxy_tensors: PPProxyTensors | None = None,
        carried_taps: Mapping[int, torch.Tensor] | None = None,
        **_,
    ):
        """Logits on the last stage, ``PPProxyTensors`` on the others.

        With armed taps and a batch that asks for hidden states, this stage's captures are left
        in :attr:`stage_taps` (:class:`StageTaps`, keyed by HF layer id; None otherwise). The
        last stage hands the LogitsProcessor, in HF order, its own taps and those of earlier
        stages given as ``carried_taps`` (same keys); taps held elsewhere and not carried are
        left out, as SGLang's Llama leaves them out on its last stage.
        """
        mode = getattr(forward_batch, "capture_hidden_mode", None)
        taps = None
        if self.capture_aux_hidden_states and mode is not None and mode.need_capture():
            taps = StageTaps()
        out = self.model(input_ids, positions, forward_batch, input_embeds, taps, pp_proxy_tensors)
        self.stage_taps = taps
        if not self.model.is_last_stage:
            return out
        aux = self._packed_taps(taps, carried_taps or {}) if taps is not None else None
        return self.logits_processor(input_ids, out, self.lm_head, forward_batch, aux or None)

    def _packed_taps(self, own: StageTaps, carried: Mapping[int, torch.Tensor]):
        """The armed taps captured here or carried here, in HF layer order."""
        aux = AuxHiddenStateList()
        for i in sorted(j - 1 for j in self.model.layers_to_capture):
            if i in own or i in carried:
                aux.capture(own[i] if i in own else carried[i], owned=True)
        return aux

    def _scales_made_at_load(self, names: set[str]) -> set[str]:
        """Of ``names``, the scale parameters that ``--quantization fp8`` over a bf16 checkpoint
        fills itself once the weights are in (SGLang's fp8 MoE method creates its expert scales
        as parameters either way; a bf16 checkpoint has none to give)."""
        modules = dict(self.named_modules())
        made = set()
        for name in names:
            owner, _, leaf = name.rpartition(".")
            method = getattr(modules.get(owner), "quant_method", None)
            config = getattr(method, "quant_config", None)
            if (
                leaf.endswith("_scale")
                and getattr(config, "is_checkpoint_fp8_serialized", True) is False
            ):
                made.add(name)
        return made

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the checkpoint under its own names (``block_sparse_moe`` is ``mlp`` here)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        dense_index: set[int] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            name = name.replace(".block_sparse_moe.", ".mlp.")
            if not self._on_this_stage(name):
                continue
            target, shard = self._stacked(name)
            if target not in params and ".self_attn.index_" in name:
                # a sparse checkpoint whose config serves this layer dense
                dense_index.add(int(name.split(".layers.", 1)[1].split(".", 1)[0]))
                continue
            if target not in params:
                raise KeyError(f"checkpoint weight {name!r} has no parameter ({target!r})")
            param = params[target]
            loader = getattr(param, "weight_loader", default_weight_loader)
            if isinstance(shard, tuple):
                loader(param, tensor, target, shard_id=shard[0], expert_id=shard[1])
            elif shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            loaded.add(target)
        unloaded = set(params) - loaded
        missing = unloaded - self._scales_made_at_load(unloaded)
        if missing:
            raise KeyError(f"parameters not in the checkpoint: {sorted(missing)[:8]}")
        if dense_index:
            logger.info(
                "layers %s attend dense (sparse_attention_freq 0): their index q/k "
                "projections in the checkpoint are not loaded",
                sorted(dense_index),
            )
        return loaded

    def _on_this_stage(self, name: str) -> bool:
        """Whether this pipeline stage holds the weight: its layers, and the embedding, final
        norm and LM head where it builds them."""
        if ".layers." in name:
            layer = int(name.split(".layers.", 1)[1].split(".", 1)[0])
            return self.start_layer <= layer < self.end_layer
        return not isinstance(self._owner(name), PPMissingLayer)

    def _owner(self, name: str) -> nn.Module | None:
        """The top-level module (embedding, norm, LM head) a non-layer weight belongs to."""
        for prefix, module in (
            ("model.embed_tokens.", self.model.embed_tokens),
            ("model.norm.", self.model.norm),
            ("lm_head.", self.lm_head),
        ):
            if name.startswith(prefix):
                return module
        return None

    def _stacked(self, name: str):
        """(parameter name, shard): shard is a QKV/gate-up index, (w1|w2|w3, expert) for a
        routed expert's tensor (into FusedMoE's w13_*/w2_*: the weight, and under fp8 its
        ``weight_scale``/``weight_scale_inv``/``input_scale``), or None."""
        if ".experts." in name:
            layer, rest = name.split(".experts.", 1)
            expert, w, kind = rest.split(".", 2)
            return f"{layer}.experts.{'w2' if w == 'w2' else 'w13'}_{kind}", (w, int(expert))
        for param_name, weight_name, shard in self.stacked_params:
            if weight_name in name:
                return name.replace(weight_name, param_name), shard
        return name, None


EntryClass = MiniMaxM3SparseForCausalLM
