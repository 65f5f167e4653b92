"""The ``ATOM_DSPARK`` speculative worker: DSpark drafting over SGLang's chain verify.

Per scheduler step (with SGLang's overlap scheduling, its default, or synchronously under
``--disable-overlap-schedule``):

* **extend** (prefill, every chunked-prefill chunk): the target runs with its tap layers
  captured; the draft writes its context K/V for every token of the chunk into its own pool.
* **decode**: the draft proposes k tokens per request in one non-causal pass over
  ``[anchor, MASK x (k-1)]`` (on CUDA a replayed graph, :mod:`.draft_graphs`); the target
  verifies ``[anchor, d_0 .. d_{k-1}]`` as a chain through SGLang's tree-verify path (the
  NGRAM worker's, with a lower-triangular mask); the longest matching prefix plus the target's
  own next token is committed, and the draft writes the context K/V of the committed rows from
  the verify pass's taps (on CUDA a replayed graph too). The verify input is built on the
  device from the draft's tokens: nothing waits for the draft pass between its launch and the
  verify's (the n-gram path reads its drafts on the host; it still serves a batch with a
  grammar, whose mask is built there).

With ``--atom-dspark-forced-accept N`` (benchmarking only, :mod:`.forced_accept`) every verify
commits N drafts plus one target token per request, whatever the drafts were.

Under overlap scheduling the scheduler prepares step t + 1 while step t runs, and processes
step t's results while step t + 1 runs: ``req.output_ids`` lag one step behind. So nothing here
reads them. A step's anchors come from the previous step's accepted tokens on the device (the
``NgramVerifyInput`` SGLang relays through its FutureMap, or installs directly when
synchronous), the committed rows' slots from the verify's own ``out_cache_loc``, and the
acceptance counts from ``on_verify_complete_cpu``, which the result processor calls with them
already on the host. The new sequence lengths are published (``on_publish``) as soon as the
verify is sampled, before the draft's context write, so the host's next preparation overlaps
that write. Under ``--pp-size`` > 1 (a P/D prefill) overlap is off, as SGLang has it for PP.

Writing context is separate from proposing: a step that never proposes (a P/D producer) still
keeps the draft's context complete. Acceptance and tokens per forward go to the log every
``LOG_EVERY`` verify steps and to SGLang's own speculative metrics through ``accept_lens``.

A P/D producer (``--disaggregation-mode prefill``) only runs extends: the target forward, the
draft's context K/V write and the target step's result. It never proposes, so it does not
gather the target's embedding and LM head.

Under ``--pp-size`` > 1 (P/D prefill only, see ``algorithm.check_pipeline_parallel``) SGLang
builds this worker on every stage. Only the last stage loads the draft and its pool; an earlier
stage runs the target step alone and sends its taps on with the pipeline payload
(:mod:`sgl_atom.speculative.dspark.pp_taps`); the last stage puts them before its own. No stage
runs a draft warm-up or an idle forward of its own (a producer never proposes, so it captures
no draft graph, and a prefill server has no DP attention), so every stage runs exactly the
forwards the scheduler gives the last stage: SGLang's warm-up request and real batches, on the
same rows.
"""

from __future__ import annotations

import numpy as np
import torch
from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
from sglang.kernels.ops.speculative.reconstruct_tree import reconstruct_indices_from_tree_mask_func
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.runtime_context import get_device, get_disagg, get_parallel, get_schedule, get_spec
from sglang.srt.speculative import ngram_worker
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.eagle_utils import eagle_sample
from sglang.srt.speculative.ngram_info import NgramVerifyInput
from sglang.srt.speculative.ngram_worker import NGRAMWorker
from sglang.srt.speculative.spec_utils import (
    GrammarTree,
    build_grammar_vocab_mask,
    prepare_mamba_track_for_verify,
)
from sglang.srt.utils.common import async_h2d

from ... import envs
from ...log import get_logger
from ...pool_state import state_of
from ..draft_kv_resolution import draft_kv_config
from .accept import SpecStats
from .algorithm import host_seq_lens
from .draft_graphs import (
    DraftGraphs,
    DraftPass,
    anchors_of,
    capture,
    capture_sizes,
    verify_context_rows,
)
from .forced_accept import FLAG, WARNING, adjusts_logits, forced_accept, forced_acceptance
from .fp8_weights import Fp8Rows, draft_quantization
from .loader import load_draft, relay_stage_taps
from .pool import DraftKVPool, block_page_table, check_block_attention, write_context_kv
from .pp_taps import assemble_taps, stage_layers, taps_on_stage

logger = get_logger("sgl_atom.speculative")
LOG_EVERY = 32  # verify steps between two acceptance log lines


def _whole_vocab(w: torch.Tensor, vocab: int) -> torch.Tensor:
    """The target's [vocab, hidden] embedding or LM head, whole on this rank.

    Under TP SGLang shards both by vocabulary rows (padded to a multiple per rank); the draft
    runs whole on every rank, so the shards are gathered once here and the padding dropped.
    """
    from sglang.srt.distributed import get_tp_group

    group = get_tp_group()
    if group.world_size > 1:
        w = group.all_gather(w.contiguous(), dim=0)
    if w.shape[0] < vocab:
        raise ValueError(
            f"ATOM_DSPARK: the target's embedding/LM head has {w.shape[0]} rows after gathering "
            f"the TP shards, fewer than its vocab_size {vocab}"
        )
    return w[:vocab]


class AtomDSparkWorker(NGRAMWorker):
    """Drafts with an ``AtomDSparkDraftModel``; verification, KV moves and the scheduler relay
    are SGLang's chain/tree verify (inherited from its NGRAM worker, whose n-gram corpus is
    not used)."""

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker) -> None:
        BaseSpecWorker.__init__(self)
        self.server_args = server_args
        self.enable_overlap = not get_schedule().disable_overlap_schedule
        self._target_worker = target_worker
        self.model_runner = target_worker.model_runner
        self.page_size = get_schedule().page_size
        self.device = get_device().device
        self.draft_token_num = get_spec().speculative_num_draft_tokens
        self.speculative_num_draft_tokens = self.draft_token_num
        self.topk, self.speculative_num_steps = 1, self.draft_token_num - 1
        self.adaptive_controller = None
        self.grammar_tree_host = None
        self.max_trie_depth = 0
        target = self.model_runner.model
        path, pp = get_spec().speculative_draft_model_path, get_parallel()
        self.pool: DraftKVPool | None = None
        self.graphs: DraftGraphs | None = None
        # draft passes and context writes since the last log line
        self.passes = {"replayed": 0, "eager": 0, "writes replayed": 0, "writes eager": 0}
        self.forced_accept = forced_accept(server_args)
        self.forced_plans: dict = {}  # forced acceptance's accept lengths and index per shape
        if self.forced_accept is not None:
            logger.warning(WARNING, FLAG, self.forced_accept, self.forced_accept)
        self.producer = get_disagg().disaggregation_mode == "prefill"
        self.holds_draft = pp.pp_group.is_last_rank
        if not self.holds_draft:  # an earlier PP stage: the target step and its taps only
            self.draft, self.relay = None, relay_stage_taps(path, target, pp.pp_size)
            return
        quantization = draft_quantization(server_args)
        self.draft = load_draft(path, target, self.device, pp.pp_size, quantization)
        self.stage_start = stage_layers(target)[0]
        cfg = self.draft.dspark
        num_layers = int(target.config.num_hidden_layers)
        self._local_taps = bool(taps_on_stage(cfg.target_layer_ids, self.stage_start, num_layers))
        if self.draft_token_num != cfg.block_size + 1:
            raise ValueError(
                f"--speculative-num-draft-tokens {self.draft_token_num} does not match the "
                f"draft's block size k={cfg.block_size} (verify window k + 1 = "
                f"{cfg.block_size + 1}): drop the flag or set it to {cfg.block_size + 1}"
            )
        self.embed = self.lm_head = None  # a producer never proposes
        if not self.producer:
            vocab = int(target.config.vocab_size)
            self.embed, self.lm_head = (_whole_vocab(w, vocab) for w in target.get_embed_and_head())
            if quantization == "fp8":  # the draft's own copy; the target keeps its head
                self.lm_head = Fp8Rows.of(self.lm_head, "the target's LM head")
                logger.info(
                    "ATOM_DSPARK draft LM head: an fp8 copy of the target's (%.2f MiB)",
                    self.lm_head.nbytes / 2**20,
                )
        self.stats = SpecStats(cfg.block_size)
        self.total = SpecStats(cfg.block_size)
        self.propose_enabled = not self.producer
        self.stale_context = envs.SGL_ATOM_DSPARK_FAULT.get() == "stale-context"
        if self.stale_context:
            name = envs.SGL_ATOM_DSPARK_FAULT.name
            logger.warning("%s=stale-context: decoded tokens get no draft context", name)
        if not self.enable_overlap:
            overlap = "off (--disable-overlap-schedule or --pp-size > 1)"
        elif host_seq_lens():
            overlap = "on, each step's lengths copied to the host (the next step waits for them)"
        else:
            overlap = "on, each step's lengths kept on the device"
        logger.info("ATOM_DSPARK: overlap scheduling %s", overlap)

    # ------------------------------------------------------------------ pools

    def alloc_memory_pool(self, **kwargs) -> None:
        super().alloc_memory_pool(**kwargs)
        # every batch size's mask buffer is a prefix of this one: the chain mask, once
        chain = self._chain_mask(self.max_batch_size)
        self.tree_mask.copy_(torch.from_numpy(chain))
        if not self.holds_draft:
            return
        cfg = self.draft.dspark
        dk = draft_kv_config(self.server_args)
        settled = dk.settled if dk is not None else "auto"
        kv_pool = self.model_runner.token_to_kv_pool
        slots = int(kv_pool.size) + self.page_size
        max_batch = 0 if self.producer else int(self.model_runner.max_running_requests)
        self.pool = DraftKVPool(
            slots=slots,
            layers=cfg.num_hidden_layers,
            kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            dtype=settled,
            device=self.device,
            compute_dtype=self.draft.dtype,
            max_batch=max_batch,  # scratch rows for the block K/V of each batch row's pass
            block_len=cfg.query_len,
        )
        if not self.producer:
            check_block_attention(cfg, self.pool)
        # RoPE rows for every position of the longest request and its block, now: a draft whose
        # scaling fixes its table shorter is refused at start-up, not at a request
        width = int(self.model_runner.req_to_token_pool.req_to_token.shape[1])
        self.draft.cover_positions(width + cfg.query_len)
        # the atom P/D backend moves the draft pool with the target's KV
        state_of(kv_pool).draft_pool = self.pool
        at_bf16 = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
        logger.info(
            "ATOM_DSPARK draft KV pool: %s (%s), %d slots x %d layers, %d B/token (at bf16: %d "
            "B/token), %.2f MiB; %d x %d scratch rows for the draft's blocks, %.2f MiB",
            settled,
            self.pool.k[0].dtype,
            slots,
            cfg.num_hidden_layers,
            self.pool.bytes_per_token,
            at_bf16,
            self.pool.nbytes / 2**20,
            max_batch,
            cfg.query_len,
            self.pool.scratch_nbytes / 2**20,
        )

    @torch.no_grad()
    def init_cuda_graphs(self) -> None:
        """SGLang's graph phase (after the target's graphs): the draft's propose pass is
        captured once per batch size of the target's decode graphs (:mod:`.draft_graphs`);
        none without CUDA, without target graphs (--disable-cuda-graph) or with
        SGL_ATOM_DSPARK_DRAFT_GRAPHS=0, and a capture that fails is logged and left eager."""
        super().init_cuda_graphs()
        if self.pool is None or self.producer:
            return
        target_bs = getattr(self.model_runner, "decode_cuda_graph_capture_bs", [])
        sizes = capture_sizes(self.device, target_bs, self.pool.max_batch)
        if not sizes:
            return
        if not envs.SGL_ATOM_DSPARK_DRAFT_GRAPHS.get():
            logger.info("%s=0: the draft runs eagerly", envs.SGL_ATOM_DSPARK_DRAFT_GRAPHS.name)
            return
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        dpass = DraftPass(
            self.draft, self.pool, self.embed, self.lm_head, req_to_token, max(sizes),
            self.draft_token_num,
        )  # fmt: skip
        self.graphs = capture(dpass, sizes)

    def clear_cache_pool(self) -> None:
        """Nothing to drop: the draft's rows are rewritten whenever their slot is reused."""

    def _update_ngram_corpus(self, batch: ScheduleBatch) -> None:
        """No n-gram corpus here."""

    # ---------------------------------------------------------------- context

    def write_context(
        self,
        taps: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        max_position: int | None = None,
    ) -> None:
        """Draft context K/V of tokens at ``positions`` (``max_position``: their bound, known
        on the host) into the draft pool at ``slots``."""
        write_context_kv(self.draft, self.pool, taps, positions, slots, max_position)

    def _write_extend_context(self, batch: ScheduleBatch, taps: torch.Tensor) -> None:
        """The chunk's rows from the host's lengths, copied through pinned memory: a copy from
        pageable memory would first wait for the stream's queued work."""
        total = sum(batch.extend_lens)
        lens = async_h2d(batch.extend_lens, dtype=torch.int64, device=self.device)
        starts = async_h2d(batch.prefix_lens, dtype=torch.int64, device=self.device)
        offsets = torch.arange(total, device=self.device)
        first = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens, output_size=total)
        positions = torch.repeat_interleave(starts, lens, output_size=total) + offsets - first
        ends = [p + n for p, n in zip(batch.prefix_lens, batch.extend_lens, strict=True)]
        bound = max(ends, default=1) - 1
        self.write_context(taps, positions, batch.out_cache_loc, bound)

    def _write_verify_context(
        self,
        batch: ScheduleBatch,
        taps: torch.Tensor,
        accept_index: torch.Tensor,
        accept_lens: torch.Tensor,
        window_slots: torch.Tensor,
    ) -> None:
        """Draft context K/V of each request's committed rows (a chain's: the first
        ``accept_lens`` of its verify window) at their slots: ``window_slots``, the verify's
        own ``out_cache_loc`` (read here rather than ``req_to_token``, which the host may
        already be rewriting for the next step under overlap). Every row of the window is
        computed, the rows not committed going to SGLang's padding slot
        (:func:`.draft_graphs.verify_context_rows`); with the draft's graphs that arithmetic
        replays inside the write's graph, and the host only copies its inputs."""
        if self.stale_context:
            return
        args = (taps, accept_index, accept_lens, batch.seq_lens, window_slots)
        if self.graphs is not None and self.graphs.write_context(*args):
            self.passes["writes replayed"] += 1
            return
        self.passes["writes eager"] += 1
        n = self.draft_token_num
        rows, positions, slots = verify_context_rows(*args[1:], n)
        bound = self._max_seq_len(batch) + n - 1
        self.write_context(taps[rows], positions, slots, bound)

    # ---------------------------------------------------------------- propose

    def _accepted(self, batch: ScheduleBatch):
        """The previous step's accepted tokens and their counts (the extend's sampled token
        after a prefill), on the device: the draft input SGLang relays (overlap) or installs
        (synchronous). Each request's anchor is the last of them (:func:`.anchors_of`);
        ``req.output_ids`` would be one step behind under overlap, and reading them means a
        copy from the host every step."""
        spec = batch.spec_info
        if spec is None or spec.accept_tokens is None or spec.accept_lens is None:
            raise RuntimeError(
                "ATOM_DSPARK: a decode batch without the previous step's accepted tokens "
                f"(spec_info {type(spec).__name__}); the scheduler relays them from every "
                "extend and verify result"
            )
        return spec.accept_tokens, spec.accept_lens

    def _verify_block(self, batch: ScheduleBatch) -> torch.Tensor:
        """[bs, k + 1] on the device: each request's anchor and its k draft tokens. With the
        draft's graphs, one replay works out the anchors and drafts the block."""
        tokens, lens = self._accepted(batch)
        if self.propose_enabled and self.graphs is not None:
            block = self.graphs.propose(tokens, lens, batch.seq_lens, batch.req_pool_indices)
            self.passes["replayed" if block is not None else "eager"] += 1
            if block is not None:
                return block
        anchors = anchors_of(tokens, lens, self.draft_token_num)
        if self.propose_enabled:
            drafts = self._propose(batch, anchors)
        else:
            drafts = anchors[:, None].expand(-1, self.draft_token_num - 1)
        return torch.cat([anchors[:, None], drafts], dim=1)

    def _chain_mask(self, bs: int) -> np.ndarray:
        n = self.draft_token_num
        return np.tile(np.tril(np.ones((n, n), dtype=bool)).reshape(-1), bs)

    def _prepare_draft_tokens(self, batch: ScheduleBatch) -> tuple[np.ndarray, np.ndarray]:
        """The n-gram path's hook (a batch with a grammar): the block and its chain mask on
        the host."""
        tokens = self._verify_block(batch)
        return tokens.reshape(-1).cpu().numpy(), self._chain_mask(len(batch.reqs))

    def _prepare_for_speculative_decoding(self, batch: ScheduleBatch) -> None:
        """The verify input of a chain, as SGLang's n-gram path builds it (the same buffers,
        kernels and ``NgramVerifyInput``), with the block's tokens copied on the device
        instead of read back to the host, and no full verify mask.

        The n-gram path reads its drafts on the host (``_prepare_draft_tokens`` returns numpy,
        copied back to the device): for the DSpark draft that is a wait for the draft pass,
        after which the GPU idles while the host prepares the verify. Here the host goes on
        to the verify while the draft runs. The chain mask is the same at every step; it is in
        the mask buffer from ``alloc_memory_pool`` on. A batch with a grammar takes the n-gram
        path: SGLang builds its grammar mask from the host drafts.

        On CUDA the n-gram path also builds a [k + 1, context + k + 1] mask per request
        (``USE_FULL_MASK``) for the attention backends that read one; the atom backend, which
        ATOM_DSPARK requires, reads none (a chain verify is causal), so neither path builds it
        (the module global is off around the n-gram call; the scheduler is one thread)."""
        if not batch.forward_mode.is_decode():
            return
        self._bound_lengths(batch)
        if batch.has_grammar:
            full = ngram_worker.USE_FULL_MASK
            ngram_worker.USE_FULL_MASK = False
            try:
                super()._prepare_for_speculative_decoding(batch)
            finally:
                ngram_worker.USE_FULL_MASK = full
            return
        bs, n = len(batch.reqs), self.draft_token_num
        draft_tokens = self.draft_tokens_batch[bs]
        draft_tokens.copy_(self._verify_block(batch).reshape(-1))
        tree_mask, positions = self.tree_mask_batch[bs], self.positions_batch[bs]
        retrieve = (
            self.retrieve_indexes_batch[bs],
            self.retrieve_next_token_batch[bs],
            self.retrieve_next_sibling_batch[bs],
        )
        self.grammar_tree_host = None
        reconstruct_indices_from_tree_mask_func(
            tree_mask, batch.seq_lens, positions, *retrieve, bs, n
        )
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.input_ids = draft_tokens
        batch.out_cache_loc = assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices,
            req_to_token=batch.req_to_token_pool.req_to_token,
            start_offset=batch.seq_lens,
            end_offset=batch.seq_lens + n,
            batch_size=bs,
            draft_token_num=n,
            device=self.device,
        )
        prepare_mamba_track_for_verify(batch)
        batch.spec_info = NgramVerifyInput(
            draft_token=draft_tokens,
            custom_mask=tree_mask,
            positions=positions,
            retrieve_index=retrieve[0],
            retrieve_next_token=retrieve[1],
            retrieve_next_sibling=retrieve[2],
            draft_token_num=n,
        )

    def _max_seq_len(self, batch: ScheduleBatch) -> int:
        """The batch's longest sequence as the host knows it (never read from the device):
        SGLang's host lengths, else the bound of :meth:`_bound_lengths`."""
        lens = batch.seq_lens_cpu
        if lens is not None:
            return int(lens.max()) if lens.numel() else 0
        return self._bound_lengths(batch)

    def _bound_lengths(self, batch: ScheduleBatch) -> int:
        """An upper bound of every length this decode step reads, known on the host: per
        request, the KV SGLang allocated it for this step (``kv_allocated_len``: its committed
        tokens plus a reserve of two verify windows) or its host length plus two windows (the
        host's tokens are at most one step, one window, behind the device's under overlap),
        whichever is larger; at most a ``req_to_token`` row. Set as the batch's
        ``max_seq_len_host``, which SGLang's ForwardBatch carries to the attention backend:
        under overlap scheduling the lengths stay on the device
        (:func:`..algorithm.host_seq_lens`), and the atom backend sizes its page table from
        this bound instead."""
        width = int(batch.req_to_token_pool.req_to_token.shape[1])
        ahead = 2 * self.draft_token_num
        bound = max(
            (max(int(r.kv.kv_allocated_len), int(r.seqlen) + ahead) for r in batch.reqs),
            default=0,
        )
        batch.max_seq_len_host = min(bound, width)
        return batch.max_seq_len_host

    def _propose(self, batch: ScheduleBatch, anchors: torch.Tensor) -> torch.Tensor:
        """One draft pass for the whole batch: each request's block attends, through the
        pool's page-size-1 table, to its own context rows (SGLang's ``req_to_token`` row) and
        its block's scratch rows; nothing is gathered out of the pool. Eager: a batch no
        graph holds, or a server without the draft's graphs."""
        seq_lens, n = batch.seq_lens, self._max_seq_len(batch)
        context = batch.req_to_token_pool.req_to_token[batch.req_pool_indices, :n]
        table = block_page_table(context, seq_lens, self.pool.scratch_rows(len(batch.reqs)))
        return self.draft.propose(
            anchors=anchors,
            context_lens=seq_lens,
            page_table=table,
            pool=self.pool,
            embed=self.embed,
            lm_head=self.lm_head,
            max_context=n,
        )

    # ---------------------------------------------------------------- one step

    def forward_batch_generation(
        self, batch: ScheduleBatch, on_publish=None, pp_proxy_tensors=None
    ) -> GenerationBatchResult:
        if batch.forward_mode.is_decode():
            return self._decode_step(batch, on_publish, pp_proxy_tensors)
        result = self.target_worker.forward_batch_generation(
            batch, pp_proxy_tensors=pp_proxy_tensors, capture_hidden_mode=CaptureHiddenMode.FULL
        )
        if not self.holds_draft:  # the payload, with this stage's taps, goes to the next stage
            return result
        new_seq_lens = batch.seq_lens.clone()
        if on_publish is not None:  # before the draft's write: the host's next step overlaps it
            on_publish(new_seq_lens)
        if batch.forward_mode.is_extend() and result.logits_output is not None:
            self._write_extend_context(batch, self._taps(result, pp_proxy_tensors))
        bs = len(batch.reqs)
        accept_tokens = torch.zeros(bs, self.draft_token_num, dtype=torch.int32, device=self.device)
        if bs:
            accept_tokens[:, 0] = result.next_token_ids
        out = self._result(result, result.next_token_ids, accept_tokens, None, new_seq_lens)
        if get_parallel().pp_size > 1:
            # Under PP every stage rebuilds the batch result from the relayed outputs, with no
            # draft input for an algorithm SGLang does not know; the prefill result processor
            # asserts the batch's spec_info is that one. A producer never drafts from it.
            out.next_draft_input = None
        return out

    def _taps(self, result, pp_proxy_tensors) -> torch.Tensor:
        """[tokens, num_taps * hidden] in draft-config order: relayed taps, then this stage's."""
        cfg = self.draft.dspark
        if get_parallel().pp_size == 1:
            return result.logits_output.hidden_states
        local = result.logits_output.hidden_states if self._local_taps else None
        return assemble_taps(
            cfg.target_layer_ids, self.stage_start, cfg.tap_hidden_size, pp_proxy_tensors, local
        )

    def _decode_step(self, batch, on_publish, pp_proxy_tensors) -> GenerationBatchResult:
        self._prepare_for_speculative_decoding(batch)
        verify_input: NgramVerifyInput = batch.spec_info
        result = self.target_worker.forward_batch_generation(
            batch,
            pp_proxy_tensors=pp_proxy_tensors,
            is_verify=True,
            capture_hidden_mode=CaptureHiddenMode.FULL,
        )
        logits_output = result.logits_output
        window_slots = batch.out_cache_loc
        grammar_mask = self._grammar_mask(batch, verify_input) if batch.has_grammar else None
        forced = self.forced_accept is not None
        if not forced or adjusts_logits(batch.sampling_info, grammar_mask):
            predict, accept_lens, accept_index = eagle_sample(
                verify_input, batch, logits_output, grammar_mask, watermark_state=None
            )
        if forced:  # benchmarking: N drafts committed, whatever they are
            predict, accept_lens, accept_index = forced_acceptance(
                logits_output.next_token_logits,
                len(batch.reqs),
                self.draft_token_num,
                verify_input.max_tree_depth,
                self.forced_accept,
                self.forced_plans,
            )
        new_seq_lens = batch.seq_lens + accept_lens
        if on_publish is not None:  # the host's next step may start preparing from here
            on_publish(new_seq_lens)
        # No KV move (SGLang's move_accept_tokens_to_target_kvcache): in a chain the accepted
        # rows are the front of each verify window, where that move would put them, so it is
        # the identity; and the M3 target's MiniMaxSparseKVPool does not implement it.
        self._write_verify_context(
            batch, logits_output.hidden_states, accept_index, accept_lens, window_slots
        )
        accept_tokens = predict[accept_index].flatten()
        if batch.return_logprob:
            from sglang.srt.layers.logprob_processor import compute_spec_logprobs

            compute_spec_logprobs(batch, logits_output, predict, accept_index=accept_index)
        batch.forward_mode = ForwardMode.DECODE
        return self._result(result, accept_tokens, accept_tokens, accept_lens, new_seq_lens)

    def _grammar_mask(self, batch: ScheduleBatch, verify_input: NgramVerifyInput):
        """The grammar's vocabulary mask over the verify window of a batch with a grammar, as
        SGLang's n-gram worker builds it: from the chain mask and the drafts its host path
        (``_prepare_draft_tokens``) staged, so verify keeps only tokens the grammar allows."""
        mask, drafts = self.grammar_tree_host
        bs = len(batch.reqs)
        next_token, next_sibling = ngram_worker._derive_tree_links(mask, bs, self.draft_token_num)
        tokens = torch.from_numpy(drafts).to(torch.int64).view(bs, -1)
        return build_grammar_vocab_mask(
            reqs=batch.reqs,
            tree=GrammarTree.from_host(next_token, next_sibling, tokens),
            sampling_info=batch.sampling_info,
            device=verify_input.retrieve_next_token.device,
            barrier=None,
        )

    def _result(self, result, next_token_ids, accept_tokens, accept_lens, new_seq_lens):
        bs = new_seq_lens.shape[0]
        if accept_lens is None:
            accept_lens = torch.ones(bs, dtype=torch.int32, device=self.device)
        next_draft_input = NgramVerifyInput(
            draft_token_num=self.draft_token_num,
            new_seq_lens=new_seq_lens,
            accept_tokens=accept_tokens.flatten(),
            accept_lens=accept_lens,
        )
        return GenerationBatchResult(
            logits_output=result.logits_output,
            next_token_ids=next_token_ids,
            can_run_cuda_graph=result.can_run_cuda_graph,
            accept_lens=accept_lens,
            new_seq_lens=new_seq_lens,
            next_draft_input=next_draft_input,
            speculative_num_draft_tokens=self.speculative_num_draft_tokens,
        )

    def on_verify_complete_cpu(
        self, num_correct_drafts_per_req: list[int], batch_size: int = 0
    ) -> None:
        """SGLang's result processor, with each request's accepted drafts of a verify step on
        the host (in overlap mode one step later): the acceptance statistics and their log
        line, with no copy from the device of our own."""
        if self.holds_draft:
            self._count(num_correct_drafts_per_req)

    def _count(self, accepted: list[int]) -> None:
        self.stats.update(accepted)
        self.total.update(accepted)
        if self.stats.steps >= LOG_EVERY:
            graphs = ""
            if self.graphs is not None:
                graphs = (
                    "; draft passes: {replayed} replayed, {eager} eager; context writes: "
                    "{writes replayed} replayed, {writes eager} eager"
                ).format(**self.passes)
                self.passes = dict.fromkeys(self.passes, 0)
            logger.info(
                "%s (total: %s)%s", self.stats.as_log_line(), self.total.as_log_line(), graphs
            )
            self.stats = SpecStats(self.stats.block_size)
