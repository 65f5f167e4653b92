"""MiniMax-M3-style sparse attention on the atom backend: config, index cache, the sparse step.

A sparse layer writes one index key per token (one head, replicated on every TP rank) into its
own index cache, scores each 128-token block by the max over its causally visible positions of
``index_q · index_k``, keeps the top ``sparse_topk_blocks`` (init and local blocks forced in),
and attends over the selected blocks only. With ``use_index_cache``, sparse layers whose ordinal
does not hit ``index_topk_freq`` reuse the last selection of the same forward and write no
index key; a reuse with nothing to reuse is an error.

Pipeline parallelism: a stage holds sparse layers ``[start_layer, end_layer)`` (global ids) and
the index cache of those only. A stage whose first sparse layers reuse the selection of a layer on
an earlier stage receives it with the stage's hidden states: :meth:`SparseAttention.pp_export`
adds the forward's latest selection to the outgoing ``PPProxyTensors``,
:meth:`SparseAttention.pp_import` stores it on the next stage before its first layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..kernels.common import INT4_ZERO_BYTE, is_int4, scaled_index
from ..kernels.sparse_attention import SPARSE_BLOCK, TopkHolder, should_score
from ..log import get_logger
from ..parallel_layout import heads_of_rank
from ..pool_state import state_of

logger = get_logger("sgl_atom.attention")
SUPPORTED_SCORE_TYPES = ("max",)
SUPPORTED_HEAD_DIMS = (128,)
LOG_EVERY = 16  # forwards between two log lines of the skipped-block counts
# PPProxyTensors keys of the selection handed to the next pipeline stage
PP_SELECTED, PP_COUNT, PP_SCORED_BY = "sparse_selected", "sparse_count", "sparse_scored_by"


class SparseConfigError(ValueError):
    """A sparse_attention_config the atom kernels cannot serve; names the field and values."""


def _field(cfg, name: str, default=None):
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def kernel_problems(block: int, index_heads: int, kv_heads: int, head_dim: int, sc) -> list[str]:
    """Every field of a sparse config the atom kernels cannot serve, each named with the
    supported values (all of them at once, so one failed start shows every fix)."""
    problems = []
    if block != SPARSE_BLOCK:
        problems.append(
            f"sparse_attention_config.sparse_block_size={block} is not supported by the "
            f"atom sparse kernels; supported: {SPARSE_BLOCK}"
        )
    if index_heads != kv_heads:
        problems.append(
            f"sparse_attention_config.sparse_num_index_heads={index_heads} must equal the KV "
            f"heads ({kv_heads}): the kernels score one index query per KV head"
        )
    if head_dim not in SUPPORTED_HEAD_DIMS:
        problems.append(
            f"head_dim={head_dim} is not supported by the atom sparse kernels; "
            f"supported: {SUPPORTED_HEAD_DIMS}"
        )
    score = _field(sc, "sparse_score_type", "max")
    if score not in SUPPORTED_SCORE_TYPES:
        problems.append(
            f"sparse_attention_config.sparse_score_type={score!r} is not supported; "
            f"supported: {SUPPORTED_SCORE_TYPES}"
        )
    return problems


@dataclass(frozen=True)
class SparseConfig:
    sparse_layer_ids: tuple[int, ...]
    topk_blocks: int
    init_blocks: int
    local_blocks: int
    index_dim: int
    num_index_heads: int
    use_index_cache: bool = False
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 0
    ordinal_of: dict[int, int] = field(default_factory=dict, compare=False)

    @classmethod
    def from_hf(cls, hf_config, num_kv_heads: int, head_dim: int) -> SparseConfig | None:
        """Parse ``sparse_attention_config`` (None when the model has none); raise
        SparseConfigError naming the field and the supported values."""
        sc = _field(hf_config, "sparse_attention_config")
        if sc is None:
            return None

        def need(name):
            value = _field(sc, name)
            if value is None:
                raise SparseConfigError(f"sparse_attention_config.{name} is missing")
            return value

        block = int(need("sparse_block_size"))
        heads = int(need("sparse_num_index_heads"))
        problems = kernel_problems(block, heads, num_kv_heads, head_dim, sc)
        if len(problems) == 1:
            raise SparseConfigError(problems[0])
        if problems:
            raise SparseConfigError(f"{len(problems)} unsupported fields: " + " | ".join(problems))
        init = _field(sc, "sparse_init_block")
        if init is None:
            init = -(-int(need("sparse_init_tokens")) // block)
        local = _field(sc, "sparse_local_block")
        if local is None:
            local = -(-int(need("sparse_local_tokens")) // block) + 1
        topk = int(need("sparse_topk_blocks"))
        if init + local > topk:
            raise SparseConfigError(
                f"sparse_init_block ({init}) + sparse_local_block ({local}) exceed "
                f"sparse_topk_blocks ({topk})"
            )
        freq = list(need("sparse_attention_freq"))
        layer_ids = tuple(i for i, f in enumerate(freq) if f)
        freq_k = max(int(_field(hf_config, "index_topk_freq", 1) or 1), 1)
        return cls(
            sparse_layer_ids=layer_ids,
            topk_blocks=topk,
            init_blocks=int(init),
            local_blocks=int(local),
            index_dim=int(need("sparse_index_dim")),
            num_index_heads=heads,
            use_index_cache=bool(_field(hf_config, "use_index_cache", False)) and freq_k > 1,
            index_topk_freq=freq_k,
            index_skip_topk_offset=int(_field(hf_config, "index_skip_topk_offset", 0) or 0),
            ordinal_of={lid: o for o, lid in enumerate(layer_ids)},
        )

    def scores(self, layer_id: int) -> bool:
        """Whether sparse layer ``layer_id`` scores its own top-k (else it reuses)."""
        if not self.use_index_cache:
            return True
        return should_score(
            self.ordinal_of[layer_id], self.index_topk_freq, self.index_skip_topk_offset
        )

    def writers(self, layers: range) -> tuple[int, ...]:
        """The sparse layers among ``layers`` that score, i.e. write and hold index keys."""
        return tuple(lid for lid in self.sparse_layer_ids if lid in layers and self.scores(lid))


def index_row_width(index_dim: int, dtype: torch.dtype) -> int:
    """Elements per index-cache row: ``index_dim``, or half of it for packed 4-bit keys."""
    if not is_int4(dtype):
        return index_dim
    if index_dim % 2:
        raise ValueError(
            f"SGL_ATOM_M3_INDEX_DTYPE=int4 packs two index dims per byte; this model's "
            f"sparse_index_dim is {index_dim} (odd): use fp8 or bf16"
        )
    return index_dim // 2


@dataclass
class IndexCache:
    """Per index-writing sparse layer: index keys ``[slots, index_dim]`` (bf16, or fp8 with
    ``[slots]`` fp32 scales; packed 4-bit keys are ``[slots, index_dim / 2]`` uint8 with scales,
    kernels.common.INT4_DTYPE).

    ``writers``: the sparse layers that write index keys (score their own top-k). With
    ``use_index_cache`` the others reuse an earlier layer's selection and never read or write
    index keys, so they hold no buffer. The P/D transfer backend moves the writers' buffers
    (:mod:`sgl_atom.disagg.pool_regions`).
    """

    keys: dict[int, torch.Tensor]
    scales: dict[int, torch.Tensor | None]
    writers: tuple[int, ...] = ()

    @classmethod
    def for_pool(cls, pool, cfg: SparseConfig, dtype: torch.dtype) -> IndexCache:
        state = state_of(pool)
        if state.index_cache is not None:
            return state.index_cache
        start = getattr(pool, "start_layer", 0) or 0
        slots = pool.get_key_buffer(start).shape[0]
        device = pool.get_key_buffer(start).device
        held = [lid for lid in cfg.sparse_layer_ids if start <= lid < start + pool.layer_num]
        writers = cfg.writers(range(start, start + pool.layer_num))
        scaled, width = scaled_index(dtype), index_row_width(cfg.index_dim, dtype)
        zero = INT4_ZERO_BYTE if is_int4(dtype) else 0
        keys = {
            lid: torch.full((slots, width), zero, dtype=dtype, device=device) for lid in writers
        }
        scales = {
            lid: torch.ones(slots, dtype=torch.float32, device=device) if scaled else None
            for lid in writers
        }
        cache = state.index_cache = cls(keys, scales, writers)
        nbytes = sum(t.numel() * t.element_size() for t in (*keys.values(), *scales.values())
                     if t is not None)  # fmt: skip
        logger.info(
            "sparse index cache: %d layers, layers %s write index keys: [%d slots, %d] %s each "
            "= %.2f MB (the others reuse a selection and hold none)",
            len(held),
            list(writers),
            slots,
            width,
            "int4 (packed)" if is_int4(dtype) else str(dtype).replace("torch.", ""),
            nbytes / 2**20,
        )
        return cache


class SparseStats:
    """Sparse layer steps and (token, KV head) blocks visible vs attended, summed on the device:
    no host sync per layer, so the counting runs inside captured CUDA graphs too (padded graph
    rows included). Reading a figure syncs; the backend reads them only to log."""

    def __init__(self, device: torch.device | str):
        self.counters = torch.zeros(3, dtype=torch.int64, device=device)

    def read(self) -> tuple[int, int, int]:
        steps, visible, attended = self.counters.tolist()
        return steps, visible, attended

    @property
    def steps(self) -> int:
        return self.read()[0]

    @property
    def visible_blocks(self) -> int:
        return self.read()[1]

    @property
    def attended_blocks(self) -> int:
        return self.read()[2]

    @property
    def skipped_blocks(self) -> int:
        _, visible, attended = self.read()
        return visible - attended


class SparseAttention:
    """The sparse step of one atom backend (its metadata, pool and scales)."""

    def __init__(self, backend, cfg: SparseConfig, index_dtype: torch.dtype):
        self.backend = backend
        self.cfg = cfg
        self.index = IndexCache.for_pool(backend.token_to_kv_pool, cfg, index_dtype)
        self.holder = TopkHolder()
        self.stats = SparseStats(backend.device)
        self.forwards = 0
        # (ordinal, selected, count) last stored in the holder in this forward
        self.latest: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def begin_forward(self) -> None:
        self.holder.clear()
        self.latest = None
        self.forwards += 1
        if self.forwards % LOG_EVERY == 0 and not _capturing():
            steps, visible, attended = self.stats.read()
            logger.info(
                "sparse attention: %d layer steps, %d of %d visible (token, head) blocks "
                "attended, %d skipped",
                steps,
                attended,
                visible,
                visible - attended,
            )

    def _keep(self, ordinal: int, selected: torch.Tensor, count: torch.Tensor) -> None:
        self.holder.store(ordinal, selected, count)
        self.latest = (ordinal, selected, count)

    def pp_export(self) -> dict[str, torch.Tensor]:
        """This forward's latest selection for the next pipeline stage: ``sparse_selected``
        [tokens, kv_heads, topk] int32, ``sparse_count`` [tokens, kv_heads] int32,
        ``sparse_scored_by`` [1] int64 (the sparse ordinal that scored it); empty without
        ``use_index_cache`` (no layer reuses) or when no layer of this stage scored."""
        if not self.cfg.use_index_cache or self.latest is None:
            return {}
        ordinal, selected, count = self.latest
        scored_by = torch.tensor([ordinal], dtype=torch.int64, device=selected.device)
        return {PP_SELECTED: selected, PP_COUNT: count, PP_SCORED_BY: scored_by}

    def pp_import(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Store the previous stage's selection (``pp_export``'s keys), if it sent one, so this
        stage's first sparse layers can reuse it."""
        if PP_SELECTED in tensors:
            ordinal = int(tensors[PP_SCORED_BY][0])
            self._keep(ordinal, tensors[PP_SELECTED], tensors[PP_COUNT])

    def forward(self, q, k, v, index_q, index_k, layer, forward_batch, save_kv_cache=True):
        """q [tokens, q_heads*d]; index_q [tokens, kv_heads, index_dim]; index_k [tokens,
        index_dim] (ignored on layers that reuse the selection)."""
        be, cfg, lid = self.backend, self.cfg, layer.layer_id
        meta = be.forward_metadata
        if save_kv_cache and k is not None:
            be._store(layer, forward_batch, k, v)
        decode = forward_batch.forward_mode.is_decode()
        qo = None if decode else meta.qo_indptr
        ntok = q.shape[0]
        ordinal = cfg.ordinal_of[lid]

        def score():
            if save_kv_cache:
                be.ops.index_write(
                    index_k,
                    self.index.keys[lid],
                    forward_batch.out_cache_loc,
                    self.index.scales[lid],
                )
            return be.ops.select_blocks(
                index_q,
                self.index.keys[lid],
                meta.page_table,
                meta.kv_lens,
                be.page_size,
                index_q.shape[-1] ** -0.5,
                cfg.topk_blocks,
                cfg.init_blocks,
                cfg.local_blocks,
                qo_indptr=qo,
                max_qo_len=meta.max_qo_len,
                max_seq_len=meta.max_kv_len,
                index_scale=self.index.scales[lid],
            )

        if cfg.scores(lid):
            selected, count = score()
            self._keep(ordinal, selected, count)
        else:
            selected, count = self.holder.reuse(ordinal, ntok)
        self._count(meta, count, decode)
        selected, count = _rank_heads(selected, count, layer.tp_k_head_num)
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        kc, vc, ks, vs = be._cache(layer)
        o = be.ops.sparse_attn(
            q3,
            kc,
            vc,
            meta.page_table,
            meta.kv_lens,
            selected,
            count,
            be.page_size,
            layer.scaling,
            qo_indptr=qo,
            max_qo_len=meta.max_qo_len,
            k_scale=ks,
            v_scale=vs,
        )
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    def _count(self, meta, count: torch.Tensor, decode: bool) -> None:
        """Blocks visible vs attended, per (token, KV head), for the log and the tests: one
        launch per layer step."""
        qo = None if decode else meta.qo_indptr
        self.backend.ops.block_counts(meta.kv_lens, count, self.stats.counters, qo)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _rank_heads(selected: torch.Tensor, count: torch.Tensor, local_kv_heads: int):
    """The selection rows of this TP rank's KV heads.

    Every rank scores all KV heads (the index projections are replicated, one index query per
    KV head), so the selection is the same on every rank; under ``--tp-size`` > 1 a rank
    attends only with its own KV heads, cut as SGLang cuts them.
    """
    total = int(selected.shape[1])
    if total == local_kv_heads:
        return selected, count
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    start, n = heads_of_rank(total, par.tp_size, par.tp_rank)
    return selected[:, start : start + n].contiguous(), count[:, start : start + n].contiguous()
