"""``AtomAttnBackend``: SGLang's attention-backend interface over sgl_atom's Triton kernels.

Per layer and step the backend (1) writes the new tokens' K/V into the pool with ``store_kv``
(fp8: bytes and per-(token, head) scales in one kernel), then (2) attends over the paged cache:
``decode_fwd`` (split-K), ``extend_fwd`` (causal over cached prefix + new tokens, which covers
prefill, chunked prefill and radix-cache hits) or ``verify_fwd`` (speculative target-verify).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.runtime_context import get_parallel

from .. import envs
from ..kernels.paged_attention import (
    MAX_SPLITS,
    PrefixDequant,
    decode_num_splits,
    decode_workspace,
    num_sms,
    plan_prefix_dequant,
    unsupported_reason,
)
from ..log import get_logger
from . import decode_tuning
from .kernel_ops import kernel_ops
from .kv_scales import scales_for_pool
from .m3_index_pool import atom_index_dtype
from .sparse import SparseAttention, SparseConfig

logger = get_logger("sgl_atom.attention")


class AtomConfigError(ValueError):
    """The model or server arguments ask for something the atom backend cannot serve."""


@dataclass
class ForwardMetadata:
    page_table: torch.Tensor  # [batch, max_pages] int32
    kv_lens: torch.Tensor  # [batch] int32: cached + new tokens after this step's write
    max_kv_len: int
    qo_indptr: torch.Tensor | None = None  # extend / verify: [batch + 1] int32
    max_qo_len: int = 1
    num_draft: int = 0  # verify: draft tokens per request
    num_splits: int = 1  # decode / verify
    prefix_plan: PrefixDequant | None = None  # fp8 extend: its bf16 workspace (None: in kernel)


def check_servable(head_dim: int, page_size: int, kv_dtype, q_dtype, q_heads: int, kv_heads):
    """Raise AtomConfigError naming the unsupported value and what is supported."""
    if q_heads % kv_heads:
        raise AtomConfigError(
            f"atom backend: {q_heads} query heads per rank are not a multiple "
            f"of {kv_heads} KV heads per rank"
        )
    reason = unsupported_reason(head_dim, page_size, kv_dtype, q_dtype, q_heads // kv_heads)
    if reason is not None:
        raise AtomConfigError(
            f"--attention-backend atom cannot serve this model: {reason}. "
            "Pick a supported --kv-cache-dtype (bf16/bfloat16, fp16 or fp8_e4m3), --page-size "
            "and --dtype (bfloat16/float16), or another --attention-backend."
        )


class AtomAttnBackend(AttentionBackend):
    def __init__(self, model_runner):
        super().__init__()
        cfg = model_runner.model_config
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.page_size = int(model_runner.page_size)
        tp = get_parallel().attn_tp_size
        self.q_heads = cfg.get_max_num_attention_heads() // tp
        self.kv_heads = cfg.get_num_kv_heads(tp)
        self.head_dim = cfg.head_dim
        self.data_type = model_runner.dtype
        self.kv_cache_dtype = model_runner.kv_cache_dtype
        if getattr(cfg, "is_encoder_decoder", False):
            raise AtomConfigError("atom backend: encoder-decoder models are not supported")
        check_servable(
            self.head_dim,
            self.page_size,
            self.kv_cache_dtype,
            self.data_type,
            self.q_heads,
            self.kv_heads,
        )
        self._check_interpreter()
        self.fp8 = self.kv_cache_dtype == torch.float8_e4m3fn
        self.per_tensor_fp8 = self.fp8 and envs.SGL_ATOM_FP8_SCALE.get() == "per_tensor"
        self.scales = scales_for_pool(self.token_to_kv_pool) if self.fp8 else None
        self.ops = kernel_ops(self.device)
        self.max_context_len = model_runner.model_config.context_len
        self.sparse = self._init_sparse(cfg)
        self._sms = num_sms(torch.device(self.device)) if not self.on_cpu else 1
        self.decode_tuning = self._load_decode_tuning("decode")
        self.verify_tuning = self._load_decode_tuning("verify")
        self.forward_metadata: ForwardMetadata | None = None
        self.graph_state: dict[str, torch.Tensor] | None = None
        logger.info(
            "atom attention: %d q / %d kv heads per rank, head_dim %d, page %d, KV %s%s",
            self.q_heads,
            self.kv_heads,
            self.head_dim,
            self.page_size,
            str(self.kv_cache_dtype).replace("torch.", ""),
            (
                " (per-tensor scale 1.0, upstream's fp8 store)"
                if self.per_tensor_fp8
                else " (per-token, per-head scales)"
            )
            if self.fp8
            else "",
        )

    def _load_decode_tuning(self, section: str) -> decode_tuning.DecodeTuning:
        """The decode (or target-verify) tiling and split plan for this device and KV dtype
        (defaults on CPU)."""
        if self.on_cpu:
            return decode_tuning.DecodeTuning()
        device = torch.device(self.device)
        tuning, line = decode_tuning.for_device(section, self.fp8, device, self.data_type)
        logger.info("atom %s %s", section, line)
        return tuning

    def _init_sparse(self, cfg):
        """The sparse path when the model carries a sparse_attention_config (else None)."""
        hf = getattr(cfg, "hf_config", None)
        total_kv = (
            cfg.get_total_num_kv_heads()
            if hasattr(cfg, "get_total_num_kv_heads")
            else self.kv_heads
        )
        sparse_cfg = SparseConfig.from_hf(hf, total_kv, self.head_dim) if hf else None
        if sparse_cfg is None:
            return None
        return SparseAttention(self, sparse_cfg, atom_index_dtype(self.fp8))

    def forward_sparse(self, q, k, v, index_q, index_k, layer, forward_batch, save_kv_cache=True):
        """A MiniMax-M3-style sparse layer (see :mod:`sgl_atom.attention.sparse`)."""
        if self.sparse is None:
            raise AtomConfigError(
                "atom backend: forward_sparse on a model without sparse_attention_config"
            )
        self._check_layer(layer)
        return self.sparse.forward(q, k, v, index_q, index_k, layer, forward_batch, save_kv_cache)

    @property
    def on_cpu(self) -> bool:
        return str(self.device).startswith("cpu")

    def _check_interpreter(self) -> None:
        if self.on_cpu:
            import os

            if os.environ.get("TRITON_INTERPRET") != "1":
                raise AtomConfigError(
                    "atom backend on CPU runs its Triton kernels in Triton's interpreter: set "
                    "TRITON_INTERPRET=1 for the server (python -m sgl_atom.launch_server does)"
                )

    # ---- metadata -------------------------------------------------------------------------

    def _page_table(self, req_pool_indices: torch.Tensor, max_kv_len: int) -> torch.Tensor:
        rows = self.req_to_token_pool.req_to_token[req_pool_indices]
        pages = -(-max_kv_len // self.page_size)
        first_slots = rows[:, : pages * self.page_size : self.page_size]
        return (first_slots // self.page_size).to(torch.int32).contiguous()

    def init_forward_metadata(self, forward_batch) -> None:
        mode = forward_batch.forward_mode
        if self.sparse is not None:
            self.sparse.begin_forward()
        if mode.is_idle():
            self.forward_metadata = None
            return
        seq_lens = forward_batch.seq_lens
        bs = seq_lens.shape[0]
        if mode.is_target_verify():
            num_draft = int(forward_batch.spec_info.draft_token_num)
            kv_lens = (seq_lens + num_draft).to(torch.int32)
            max_kv = self._max_len(forward_batch) + num_draft
            qo_indptr = torch.arange(
                0, (bs + 1) * num_draft, num_draft, dtype=torch.int32, device=seq_lens.device
            )
            meta = ForwardMetadata(
                self._page_table(forward_batch.req_pool_indices, max_kv),
                kv_lens,
                max_kv,
                qo_indptr,
                num_draft,
                num_draft,
            )
        elif mode.is_decode():
            kv_lens = seq_lens.to(torch.int32)
            max_kv = self._max_len(forward_batch)
            meta = ForwardMetadata(
                self._page_table(forward_batch.req_pool_indices, max_kv), kv_lens, max_kv
            )
        else:
            kv_lens = seq_lens.to(torch.int32)
            max_kv = self._max_len(forward_batch)
            ext = forward_batch.extend_seq_lens.to(torch.int32)
            qo_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=seq_lens.device)
            qo_indptr[1:] = torch.cumsum(ext, 0)
            max_qo = max(forward_batch.extend_seq_lens_cpu) if bs else 1
            meta = ForwardMetadata(
                self._page_table(forward_batch.req_pool_indices, max_kv),
                kv_lens,
                max_kv,
                qo_indptr,
                int(max_qo),
            )
            if self.fp8 and not self.per_tensor_fp8 and forward_batch.seq_lens_cpu is not None:
                meta.prefix_plan = self._prefix_plan(forward_batch, meta)
        if (mode.is_decode() or mode.is_target_verify()) and not self.on_cpu:
            # on CPU (Triton's interpreter) programs run one after another: splitting the
            # context only adds work
            meta.num_splits = self._num_splits(bs, max_kv, mode.is_decode())
        self.forward_metadata = meta

    def _max_len(self, forward_batch) -> int:
        """The batch's longest sequence as the host knows it, never read from the device (that
        would wait for the queued work): SGLang's host lengths, else, where a speculative
        decode under overlap scheduling keeps them on the device, the upper bound its worker
        sets in ``max_seq_len_host`` (ATOM_DSPARK: from the requests' allocated KV and host
        lengths), else the model's context length. A bound only widens the page table; the
        kernels read each sequence to its own length."""
        lens = forward_batch.seq_lens_cpu
        if lens is not None:
            return int(lens.max()) if lens.numel() else 0
        bound = getattr(forward_batch, "max_seq_len_host", None)
        return self.max_context_len if bound is None else int(bound)

    def _prefix_plan(self, forward_batch, meta: ForwardMetadata) -> PrefixDequant | None:
        """The bf16 workspace an fp8 extend dequantizes its cached prefixes into (with its new
        tokens' rows) before attending, or None over SGL_ATOM_EXTEND_DEQUANT_MB (the prefix is
        then converted in the kernel). One plan for every layer, from the host's lengths."""
        max_bytes = envs.SGL_ATOM_EXTEND_DEQUANT_MB.get() << 20
        if max_bytes <= 0:
            return None
        return plan_prefix_dequant(
            meta.kv_lens,
            self.kv_heads,
            self.head_dim,
            seq_lens_cpu=forward_batch.seq_lens_cpu.tolist(),
            max_bytes=max_bytes,
        )

    # ---- CUDA graphs: static buffers, metadata copied in before replay --------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        max_pages = -(-self.max_context_len // self.page_size)
        self.graph_state = {
            "page_table": torch.zeros(max_bs, max_pages, dtype=torch.int32, device=self.device),
            "kv_lens": torch.ones(max_bs, dtype=torch.int32, device=self.device),
            "qo_indptr": torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
        }
        self.graph_workspace = decode_workspace(
            max_num_tokens, self.q_heads, self.head_dim, MAX_SPLITS, self.device
        )

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        self.init_forward_metadata(forward_batch)
        meta = self.forward_metadata
        if self.graph_state is None or meta is None:
            return
        # Replays read the static buffers: copy this step's metadata into them. The split count
        # is fixed per captured batch size (the kernels adapt each sequence's chunk to its
        # length): enough programs to fill the GPU at that batch for the longest context, not
        # MAX_SPLITS, whose tiny chunks cost a partial write and a merge per 64 keys (at 64
        # requests x 4K context: 65536 programs and 134 MB of fp32 partials per layer).
        st = self.graph_state
        bs, pages = meta.page_table.shape
        pages = min(pages, st["page_table"].shape[1])  # the graph reads max_context_len keys
        st["page_table"][:bs, :pages].copy_(meta.page_table[:, :pages])
        st["kv_lens"][:bs].copy_(meta.kv_lens)
        meta.page_table = st["page_table"][:bs]
        meta.kv_lens = st["kv_lens"][:bs]
        if meta.qo_indptr is not None:
            st["qo_indptr"][: bs + 1].copy_(meta.qo_indptr)
            meta.qo_indptr = st["qo_indptr"][: bs + 1]
        meta.max_kv_len = self.max_context_len
        meta.num_splits = self._num_splits(bs, self.max_context_len, meta.num_draft == 0)

    def _num_splits(self, bs: int, max_kv: int, decode: bool) -> int:
        waves = (self.decode_tuning if decode else self.verify_tuning).waves
        return decode_num_splits(bs, self.kv_heads, max_kv, self._sms, waves)

    # ---- forward --------------------------------------------------------------------------

    def _cache(self, layer):
        pool = self.token_to_kv_pool
        kc, vc = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        ks, vs = self.scales.layer(layer.layer_id) if self.fp8 else (None, None)
        return kc, vc, ks, vs

    def _store(self, layer, forward_batch, k, v) -> None:
        loc = forward_batch.out_cache_loc
        k = k.view(-1, layer.tp_k_head_num, layer.qk_head_dim)
        v = v.view(-1, layer.tp_v_head_num, layer.v_head_dim)
        if self.per_tensor_fp8:
            # upstream's own fp8 store: one per-tensor scale (1.0)
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(loc, None), k, v)
            return
        kc, vc, ks, vs = self._cache(layer)
        self.ops.store(k, v, kc, vc, loc.to(torch.int64), ks, vs)

    def _check_layer(self, layer) -> None:
        if getattr(layer, "logit_cap", 0) and layer.logit_cap > 0:
            raise AtomConfigError(
                f"atom backend: logit soft-capping ({layer.logit_cap}) is not supported"
            )
        if getattr(layer, "sliding_window_size", -1) not in (None, -1):
            raise AtomConfigError("atom backend: sliding-window attention is not supported")
        if getattr(layer, "is_cross_attention", False):
            raise AtomConfigError("atom backend: cross-attention is not supported")

    def _forward(self, q, k, v, layer, forward_batch, save_kv_cache: bool):
        """Write this step's K/V, then attend with the kernel the forward mode needs."""
        self._check_layer(layer)
        if save_kv_cache and k is not None:
            self._store(layer, forward_batch, k, v)
        meta = self.forward_metadata
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o = torch.empty_like(q3)
        kc, vc, ks, vs = self._cache(layer)
        args = (q3, kc, vc, meta.page_table, meta.kv_lens)
        kw = dict(out=o, k_scale=ks, v_scale=vs)
        mode = forward_batch.forward_mode
        if mode.is_decode() or mode.is_target_verify():
            kw.update(num_splits=meta.num_splits, max_context=meta.max_kv_len)
            if self.graph_state is not None:
                kw["workspace"] = self.graph_workspace
        if mode.is_decode():
            if not self.on_cpu:
                kw.update(self.decode_tuning.kernel_kwargs())
            self.ops.decode(*args, self.page_size, layer.scaling, **kw)
        elif mode.is_target_verify():
            if not self.on_cpu:
                kw.update(self.verify_tuning.kernel_kwargs())
            self.ops.verify(*args, self.page_size, layer.scaling, meta.num_draft, **kw)
        else:
            if self.fp8 and k is not None and k.dtype == q3.dtype:
                # the new tokens attend to their own K/V as computed; fp8 is read for the
                # cached prefix only
                kw["k_new"] = k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim)
                kw["v_new"] = v.reshape(-1, layer.tp_v_head_num, layer.v_head_dim)
                kw["prefix_plan"] = meta.prefix_plan
                kw["prefix_dequant"] = "auto" if meta.prefix_plan is not None else "off"
            self.ops.extend(
                *args,
                meta.qo_indptr,
                self.page_size,
                layer.scaling,
                max_qo_len=meta.max_qo_len,
                **kw,
            )
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def can_run_prefill_cuda_graph(self, forward_batch) -> bool:
        """Whether SGLang's prefill CUDA graph may replay this extend. Not for a sparse
        (MiniMax-M3-style) model: its sparse layers call ``forward_sparse`` directly, not
        through ``RadixAttention``, whose eager section is where a breakable prefill graph
        leaves attention out; captured, their index writes and block selection would replay
        with the capture's sizes and buffers (an illegal memory access on the H200). Prefill
        of such a model runs eagerly; its decode steps still replay CUDA graphs."""
        return self.sparse is None

    def support_triton(self):
        return True
