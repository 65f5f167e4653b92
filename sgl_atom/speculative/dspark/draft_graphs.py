"""CUDA graphs of the DSpark draft's decode-step work, per decode batch size: its propose pass,
and its context write of the rows a verify committed.

SGLang captures the target's decode and verify steps in CUDA graphs at start-up. The draft's
pass (the embedding gather; per layer the projections, norms, RoPE, the block K/V store, the
atom block attention and the MLP; then the final norm, the LM head and the Markov refinement)
is some 40 kernels a layer, launched eagerly at every step: on the H200 that made one
draft+verify step cost about 3 plain decode steps at batch 1.

:class:`DraftPass` runs that pass over static buffers: a fixed number of batch rows (the batch
padded with rows of empty context) and a fixed page-table width (a whole ``req_to_token`` row),
so every shape, the attention's split plan and every host-side bound (the RoPE table length)
are the same at every step of one batch size. A step only copies the previous step's accepted
tokens and their counts (each anchor is worked out inside the pass, :func:`anchors_of`), the
context lengths and the ``req_to_token`` row indices into the buffers; the pass returns the
whole verify block, anchors first. :class:`DraftGraphs` captures the pass once
per batch size and replays the smallest graph that holds a batch; a batch larger than every
graph, or a server without graphs (CPU, ``--disable-cuda-graph``,
``SGL_ATOM_DSPARK_DRAFT_GRAPHS=0``, a capture that failed), drafts eagerly as before.

A padded row has context length 0 (its anchor and table row are whatever an earlier step left,
valid ids): its block attends to its own scratch rows only (every batch row of the graph has its
own, ``DraftKVPool.scratch_rows``), and its tokens are dropped.

The context write after a verify (the tap projection, per layer the K/V projections, norm, RoPE
and the pool store: some 15 kernels a layer) has fixed shapes too, ``bs x (k + 1)`` rows of the
verify window, the rows not committed going to SGLang's padding slot 0. It is captured the same
way (:meth:`DraftPass.write_context`): a step copies the verify's taps, its accept index and
lengths, the requests' lengths and the window's slots into static buffers, and one graph replays
the rest, from :func:`verify_context_rows` (which rows are committed, their positions and slots)
on; the rows past the batch go to slot 0.
"""

from __future__ import annotations

import bisect
import time
from typing import Any

import torch

from ...log import get_logger
from .pool import block_page_table, write_context_kv

logger = get_logger("sgl_atom.speculative")


def verify_context_rows(
    accept_index: torch.Tensor,
    accept_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    window_slots: torch.Tensor,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(taps rows, positions, slots) of a chain verify's context write, one per row of every
    request's window (``window`` = k + 1): row j of request i is committed when j <
    ``accept_lens[i]``; it reads taps row ``accept_index[i, j]`` and goes to position
    ``seq_lens[i] + j`` at slot ``window_slots[i * window + j]`` (the verify's
    ``out_cache_loc``). A row not committed reads taps row 0 and goes to slot 0, SGLang's
    padding slot, which no token holds: fixed shapes, nothing waits for the verify to know how
    many rows there are (a boolean selection would)."""
    cols = torch.arange(window, device=accept_lens.device)[None, :]
    keep = cols < accept_lens[:, None]
    rows = accept_index.reshape(-1).long().clamp(min=0)  # -1: a row not committed
    positions = (seq_lens.long()[:, None] + cols).reshape(-1)
    slots = torch.where(keep, window_slots.view(-1, window).long(), 0).reshape(-1)
    return rows, positions, slots


def anchors_of(accept_tokens: torch.Tensor, accept_lens: torch.Tensor, window: int) -> torch.Tensor:
    """Each request's last committed token, int64 [bs]: the last of the first ``accept_lens``
    tokens of its window in ``accept_tokens`` ([bs * window], what the worker returns after a
    verify, or after an extend with the sampled token first and ``accept_lens`` 1)."""
    last = (accept_lens.long() - 1).clamp(min=0)
    return accept_tokens.view(-1, window).gather(1, last[:, None]).squeeze(1).long()


class DraftPass:
    """The draft's propose pass over static inputs of up to ``max_bs`` rows."""

    def __init__(
        self,
        draft: Any,
        pool: Any,
        embed: torch.Tensor,
        lm_head: Any,  # [vocab, hidden], or its fp8 rows (fp8_weights.Fp8Rows)
        req_to_token: torch.Tensor,
        max_bs: int,
        window: int,
    ) -> None:
        if max_bs > pool.max_batch:
            raise ValueError(
                f"draft pass of {max_bs} rows, but the draft pool has scratch rows for "
                f"{pool.max_batch}"
            )
        device = req_to_token.device
        self.draft, self.pool, self.embed, self.lm_head = draft, pool, embed, lm_head
        self.req_to_token = req_to_token
        self.width = int(req_to_token.shape[1])  # the longest context a request can have
        self.max_bs = max_bs
        self.accepted = torch.zeros(max_bs * window, dtype=torch.int64, device=device)
        self.accept_lens = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.rows = torch.zeros(max_bs, dtype=torch.int64, device=device)
        # RoPE tables as long as any block position, grown now and never inside a graph
        self.max_position = self.width + draft.dspark.query_len - 1
        draft.cover_positions(self.max_position + 1)
        # the context write's inputs: the verify window's rows (``window`` = k + 1 per request)
        # and per request its accepted length and sequence length
        cfg, rows = draft.dspark, max_bs * window
        self.window = window
        self.ctx_taps = torch.zeros(
            rows, cfg.num_taps * cfg.tap_hidden_size, dtype=draft.dtype, device=device
        )
        self.ctx_index = torch.zeros(rows, dtype=torch.int64, device=device)
        self.ctx_slots = torch.zeros(rows, dtype=torch.int64, device=device)
        self.ctx_accept = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.ctx_lens = torch.zeros(max_bs, dtype=torch.int64, device=device)

    def load(
        self,
        accept_tokens: torch.Tensor,
        accept_lens: torch.Tensor,
        lens: torch.Tensor,
        rows: torch.Tensor,
    ) -> None:
        """One step's inputs into rows 0..bs-1: the previous step's accepted tokens and their
        counts (the anchors are worked out in the pass, :func:`anchors_of`), the context
        lengths and ``req_to_token`` rows. The rows past them get an empty context; their
        anchors and table rows, whatever an earlier step left, are valid ids whose tokens are
        dropped."""
        bs = lens.shape[0]
        if bs > self.max_bs:
            raise ValueError(f"draft pass of {bs} rows, buffers hold {self.max_bs}")
        self.accepted[: bs * self.window].copy_(accept_tokens.reshape(-1))
        self.accept_lens[:bs].copy_(accept_lens)
        self.lens[:bs].copy_(lens)
        self.rows[:bs].copy_(rows)
        self.lens[bs:].zero_()

    def load_context(
        self,
        taps: torch.Tensor,
        accept_index: torch.Tensor,
        accept_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        window_slots: torch.Tensor,
    ) -> None:
        """One verify's inputs of :func:`verify_context_rows` into the first requests' rows
        of the buffers; the requests past them commit nothing (their rows go to slot 0)."""
        bs = accept_lens.shape[0]
        n = bs * self.window
        if n > self.ctx_slots.numel():
            raise ValueError(f"context write of {n} rows, buffers hold {self.ctx_slots.numel()}")
        self.ctx_taps[:n].copy_(taps)
        self.ctx_index[:n].copy_(accept_index.reshape(-1))
        self.ctx_slots[:n].copy_(window_slots.reshape(-1))
        self.ctx_accept[:bs].copy_(accept_lens)
        self.ctx_lens[:bs].copy_(seq_lens)
        self.ctx_accept[bs:].zero_()

    def write_context(self, bs: int) -> None:
        """The draft's context K/V of the committed rows of requests 0..bs-1 into the pool at
        their slots (fixed shapes for a given ``bs``)."""
        n = bs * self.window
        rows, positions, slots = verify_context_rows(
            self.ctx_index[:n], self.ctx_accept[:bs], self.ctx_lens[:bs], self.ctx_slots[:n],
            self.window,
        )  # fmt: skip
        write_context_kv(
            self.draft, self.pool, self.ctx_taps[rows], positions, slots, self.max_position
        )

    def run(self, bs: int) -> torch.Tensor:
        """The verify block [bs, k + 1] of rows 0..bs-1, each row's anchor then its k draft
        tokens (fixed shapes for a given ``bs``)."""
        lens = self.lens[:bs]
        anchors = anchors_of(self.accepted[: bs * self.window], self.accept_lens[:bs], self.window)
        table = block_page_table(
            self.req_to_token[self.rows[:bs]], lens, self.pool.scratch_rows(bs)
        )
        drafts = self.draft.propose(
            anchors=anchors,
            context_lens=lens,
            page_table=table,
            pool=self.pool,
            embed=self.embed,
            lm_head=self.lm_head,
            max_context=self.width,
        )
        return torch.cat([anchors[:, None], drafts.to(anchors.dtype)], dim=1)


class DraftGraphs:
    """Per batch size, one CUDA graph of :class:`DraftPass`'s propose pass and one of its
    context write (captured at construction)."""

    def __init__(self, dpass: DraftPass, batch_sizes: list[int]) -> None:
        self.dpass = dpass
        self.sizes = sorted({b for b in batch_sizes if 0 < b <= dpass.max_bs})
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.writes: dict[int, torch.cuda.CUDAGraph] = {}
        self.out: dict[int, torch.Tensor] = {}
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for bs in reversed(self.sizes):  # the largest first: the smaller reuse its memory
            for _ in range(2):  # Triton compiles and first-call work stay out of the graph
                dpass.run(bs)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.out[bs] = dpass.run(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        try:  # the context writes apart: a failure there leaves the propose graphs replaying
            for bs in reversed(self.sizes):
                for _ in range(2):
                    dpass.write_context(bs)  # zeroed buffers: padding slot 0 only
                torch.cuda.synchronize()
                write = torch.cuda.CUDAGraph()
                with torch.cuda.graph(write, pool=pool, stream=stream):
                    dpass.write_context(bs)
                self.writes[bs] = write
            torch.cuda.synchronize()
        except Exception as e:
            self.writes.clear()
            logger.warning(
                "ATOM_DSPARK draft CUDA graphs: the context write could not be captured (%s: "
                "%s); it runs eagerly, the propose pass from its graphs",
                type(e).__name__,
                e,
                exc_info=True,
            )
        self.capture_s = time.perf_counter() - t0

    def size_for(self, bs: int) -> int | None:
        """The smallest captured batch size that holds ``bs`` rows, or None."""
        i = bisect.bisect_left(self.sizes, bs)
        return self.sizes[i] if i < len(self.sizes) else None

    def propose(
        self,
        accept_tokens: torch.Tensor,
        accept_lens: torch.Tensor,
        lens: torch.Tensor,
        rows: torch.Tensor,
    ) -> torch.Tensor | None:
        """The verify block [bs, k + 1] (anchors, then the draft tokens) by replaying a graph
        (:meth:`DraftPass.load` has the arguments), or None when no graph holds ``bs``."""
        bs = lens.shape[0]
        size = self.size_for(bs)
        if size is None:
            return None
        self.dpass.load(accept_tokens, accept_lens, lens, rows)
        self.graphs[size].replay()
        return self.out[size][:bs]

    def write_context(
        self,
        taps: torch.Tensor,
        accept_index: torch.Tensor,
        accept_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        window_slots: torch.Tensor,
    ) -> bool:
        """A verify's context write (:func:`verify_context_rows` of these) by replaying a
        graph; False when no graph holds the batch."""
        size = self.size_for(accept_lens.shape[0])
        if size is None or size not in self.writes:
            return False
        self.dpass.load_context(taps, accept_index, accept_lens, seq_lens, window_slots)
        self.writes[size].replay()
        return True


def capture_sizes(device: str | torch.device, target_bs, max_batch: int) -> list[int]:
    """The batch sizes to capture the draft at: those of the target's decode graphs
    (``target_bs``; empty when SGLang captured none) that the draft pool's scratch rows hold;
    none off CUDA. ``device`` as SGLang's runtime context holds it (a string) or a device."""
    if torch.device(device).type != "cuda":
        return []
    return sorted({int(b) for b in target_bs if 0 < int(b) <= max_batch})


def capture(dpass: DraftPass, batch_sizes: list[int]) -> DraftGraphs | None:
    """:class:`DraftGraphs` of ``dpass``, or None (logged) when capture fails: the draft then
    runs eagerly and the server keeps serving."""
    try:
        graphs = DraftGraphs(dpass, batch_sizes)
    except Exception as e:  # a draft that cannot be captured still drafts, eagerly
        logger.warning(
            "ATOM_DSPARK draft CUDA graphs: capture failed (%s: %s); the draft runs eagerly",
            type(e).__name__,
            e,
            exc_info=True,
        )
        return None
    logger.info(
        "ATOM_DSPARK draft CUDA graphs: captured %d batch sizes %s in %.1f s (table width %d; "
        "context writes: %s)",
        len(graphs.sizes),
        graphs.sizes,
        graphs.capture_s,
        dpass.width,
        "captured" if graphs.writes else "eager",
    )
    return graphs
