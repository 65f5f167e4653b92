"""P/D run layout of the DSpark draft pool: a page-16 pool declared as one run per page is
refused at handshake, and the test below shows what the bytes would have done without the check.

The producer (TP1, 2 draft KV heads) stores 128-token pages as 8 page-16 runs `[heads, 16, dim]`.
Declared as 1 run, head h of a page is read as 128 rows at byte `h * 128 * unit`: 16-row chunks
`8h .. 8h + 7` of the real page, i.e. runs `4h .. 4h + 3` with both heads interleaved. The
consumer (TP2, one head per rank) so gets, at rank 0, head 1's tokens 0-15 at tokens 16-31 and
head 0's 16-31 at 32-47; rank 1 gets tokens 64-127 of both heads. Every span stays inside its
region: nothing fails, the draft reads a scrambled context and acceptance drops.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from sgl_atom.kernels.kv_transfer import (
    RunLayout,
    logical_view,
    reference_pack_heads,
    reference_unpack_heads,
)

from dspark_training import distill
from dspark_training.anchors import accept_walk
from dspark_training.llama_target import LlamaTarget
from sgl_atom.disagg import HandshakeError, RegionDesc, build_rank_regions, plan_transfer
from sgl_atom.speculative.dspark import reference as ref
from sgl_atom.speculative.dspark.accept import SpecStats
from sgl_atom.speculative.dspark.markov import markov_refine
from sgl_atom.testing import ASSETS, DSPARK_CHAIN

PAGE, RUNS = 128, 8  # the producer's real layout: 128-token pages of 8 page-16 runs
C_TP = 2  # decode ranks; the producer runs TP1
K, MAX_NEW, N_PROMPTS = 4, 16, 16
MIN_TPF = 4.9  # the chain draft reaches 5.00 tokens/forward at k=4
MIN_FIRST_STEP_DROP = 1.0  # the verify drafting from the moved context alone
MIN_LOOP_DROP = 0.3  # MAX_NEW tokens; later blocks also read the decode side's own rows


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------- pools in the run layout


def _regions(cfg, tp_rank: int, tp_size: int, runs: int) -> list[RegionDesc]:
    """Draft regions only (draft_k, draft_v per draft layer), bf16 like a serving draft pool."""
    return build_rank_regions(
        layers=(),
        tp_rank=tp_rank,
        tp_size=tp_size,
        kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        dtype="bf16",
        page_size=PAGE,
        draft_layers=cfg.num_hidden_layers,
        draft_runs_per_page=runs,
    )


def _layout(buf: torch.Tensor) -> RunLayout:
    return RunLayout.of(buf, PAGE, RUNS)  # what the bytes really are, whatever is declared


def _slots(pages: list[int], n: int) -> torch.Tensor:
    return torch.tensor([pages[t // PAGE] * PAGE + t % PAGE for t in range(n)])


def _store(buf: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Write rows [n, heads, dim] at `slots` of `buf` in its run layout."""
    lay = _layout(buf)
    runs = buf.view(-1).view(torch.uint8)
    runs = runs.view(-1, lay.runs_per_page, lay.heads, lay.run_tokens, lay.unit_bytes)
    page, t = slots // PAGE, slots % PAGE
    runs[page, t // lay.run_tokens, :, t % lay.run_tokens] = rows.view(torch.uint8)


def _load(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows [n, heads, dim] at `slots`, read through the real run layout."""
    return logical_view(buf, _layout(buf))[slots].view(buf.dtype)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _copy(src: torch.Tensor, dst: torch.Tensor, spans) -> None:
    s, d = _as_bytes(src), dst.view(-1).view(torch.uint8)
    for so, do, n in spans:
        d[do : do + n] = s[so : so + n]


def _offset(r: RegionDesc, pages: list[int], tok: int, head: int) -> int:
    """Byte of (token, local head) where region r's declaration puts it."""
    page, t = divmod(tok, r.tokens_per_page)
    run, rt = divmod(t, r.run_tokens)
    row = (run * r.heads_per_rank + head) * r.run_tokens + rt
    return pages[page] * r.page_bytes + row * r.unit_bytes


def declared_spans(p: RegionDesc, c: RegionDesc, pair, src_pages, dst_pages) -> list:
    """Test-only bypass of the handshake check: spans that take every (token, head) from where
    the producer declares it and put it where the consumer declares it, whole pages. With the
    true declarations they write exactly the planner's bytes (checked below)."""
    g = math.gcd(p.run_tokens, c.run_tokens)
    out = []
    for t0 in range(0, len(dst_pages) * c.tokens_per_page, g):
        for h in range(pair.num_heads):
            src = _offset(p, src_pages, t0, pair.src_head_start + h)
            out.append((src, _offset(c, dst_pages, t0, pair.dst_head_start + h), g * p.unit_bytes))
    return out


# ---------------------------------------------------------------- the DSpark reference loop


class _Drafts:
    """The draft block at anchor `plen + a`, computed when the acceptance walk reads it: the
    step-by-step reference loop (reference_propose with the context K/V given)."""

    def __init__(self, w, cfg, target, seq, plen, kv):
        self.w, self.cfg, self.target, self.seq, self.plen, self.kv = w, cfg, target, seq, plen, kv

    def __getitem__(self, a: int) -> list[int]:
        n, w = self.plen + a, self.w
        block = ref.block_input_ids(self.seq[n : n + 1], self.cfg)[0]
        base = ref.reference_base_logits(
            w,
            self.cfg,
            context_kv=self.kv,
            context_len=n,
            block_embeds=self.target.embed[block],
            lm_head=self.target.lm_head,
        )
        w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
        return markov_refine(base[None], block[:1], w1, w2)[0].tolist()


@torch.no_grad()
def speculate(setup, prompt_kv) -> dict:
    """Tokens/forward of greedy speculative decoding, the draft reading `prompt_kv[i]` (per draft
    layer (K, V) [plen, heads, dim]) for prompt i's positions and the decode side's own rows after
    them; `first`: the first verify, whose draft reads the prompt's context alone."""
    target, cfg, w = setup["target"], setup["cfg"], setup["w"]
    loop, first, counts = SpecStats(block_size=K), SpecStats(block_size=K), []
    for seq, plen, own, pkv in zip(
        setup["seqs"], setup["plens"], setup["own_kv"], prompt_kv, strict=True
    ):
        kv = [
            tuple(torch.cat([p, o[plen:]]).float() for p, o in zip(pl, ol, strict=True))
            for pl, ol in zip(pkv, own, strict=True)
        ]
        drafts = _Drafts(w, cfg, target, seq, plen, kv)
        c = accept_walk(seq.tolist(), drafts, plen, k=K, max_new=MAX_NEW)
        loop.update(c)
        first.update(c[:1])
        counts.append(c)
    return {"tpf": loop.tokens_per_forward, "first": first.tokens_per_forward, "counts": counts}


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def setup():
    """Held-out prompts, their greedy continuations, the draft's context K/V from the chain
    target's taps (reference code), and the producer's pool holding each prompt's rows."""
    target = LlamaTarget.load(ASSETS / "llama-chain-target")
    cfg, w = distill.load_draft(DSPARK_CHAIN)
    toks = target.encode_batch(distill.held_out_word_prompts(N_PROMPTS))
    assert max(map(len, toks)) <= PAGE  # one page per prompt
    seqs = target.greedy_sequences(toks, MAX_NEW + K + 1)
    own_kv = []  # per sequence, per draft layer (K, V) [tokens, heads, dim] bf16
    for seq in seqs:
        _, taps = target.forward(seq[None], cfg.target_layer_ids)
        kv = ref.reference_context_kv(w, cfg, taps[0], torch.arange(len(seq)))
        own_kv.append([(k.bfloat16(), v.bfloat16()) for k, v in kv])
    num_pages = N_PROMPTS + 3
    src_pages, dst_pages = list(range(num_pages)), list(range(num_pages))
    random.Random(0).shuffle(src_pages)  # page ids are not positions
    random.Random(1).shuffle(dst_pages)
    out = dict(target=target, cfg=cfg, w=w, seqs=seqs, plens=list(map(len, toks)))
    out.update(own_kv=own_kv, prod=_regions(cfg, 0, 1, RUNS), num_pages=num_pages)
    out.update(src_pages=[[p] for p in src_pages[:N_PROMPTS]])
    out.update(dst_pages=[[p] for p in dst_pages[:N_PROMPTS]])
    out["prod_bufs"] = _producer_pool(out)
    return out


def _producer_pool(setup) -> list[torch.Tensor]:
    """One bf16 buffer per producer region, zeros (a fresh pool) but for the prompts' rows."""
    cfg = setup["cfg"]
    shape = (setup["num_pages"] * PAGE, cfg.num_key_value_heads, cfg.head_dim)
    bufs = [torch.zeros(shape, dtype=torch.bfloat16) for _ in setup["prod"]]
    for kv, n, pages in zip(setup["own_kv"], setup["plens"], setup["src_pages"], strict=True):
        rows = [x[:n] for pair in kv for x in pair]  # region order: draft_k, draft_v per layer
        for buf, r in zip(bufs, rows, strict=True):
            _store(buf, _slots(pages, n), r)
    return bufs


def _consumer_bufs(setup, c_rank):
    cfg = setup["cfg"]
    heads = cfg.num_key_value_heads // C_TP
    n = len(_regions(cfg, c_rank, C_TP, RUNS))
    shape = (setup["num_pages"] * PAGE, heads, cfg.head_dim)
    return [torch.full(shape, float("nan"), dtype=torch.bfloat16) for _ in range(n)]


def _move(setup, declared: list[RegionDesc] | None):
    """Every prompt's draft rows to the TP2 consumer: through the planner's spans (declared
    None), or through declared_spans from the producer regions `declared`, bypassing the check
    (pairs and head cuts still come from the planner: runs do not change them)."""
    cfg, out = setup["cfg"], []
    for c in range(C_TP):
        cons, bufs = _regions(cfg, c, C_TP, RUNS), _consumer_bufs(setup, c)
        for pair in plan_transfer(setup["prod"], 0, 1, cons, c, C_TP).pairs:
            src, dst = setup["prod_bufs"][pair.producer_index], bufs[pair.consumer_index]
            for sp, dp in zip(setup["src_pages"], setup["dst_pages"], strict=True):
                if declared is None:
                    spans = pair.spans(sp, dp)
                else:
                    p, cr = declared[pair.producer_index], cons[pair.consumer_index]
                    spans = declared_spans(p, cr, pair, sp, dp)
                _copy(src, dst, spans)
        out.append(bufs)
    return out


def _context(setup, consumer=None) -> list:
    """Per prompt, per draft layer (K, V) [plen, heads, dim]: the producer's, or with `consumer`
    (buffers per rank) the consumer's, its ranks' heads side by side."""
    out = []
    for i, n in enumerate(setup["plens"]):
        if consumer is None:
            rows = [_load(b, _slots(setup["src_pages"][i], n)) for b in setup["prod_bufs"]]
        else:
            slots = _slots(setup["dst_pages"][i], n)
            per_rank = [[_load(b, slots) for b in bufs] for bufs in consumer]
            rows = [torch.cat(r, dim=1) for r in zip(*per_rank, strict=True)]
        out.append(list(zip(rows[0::2], rows[1::2], strict=True)))
    return out


@pytest.fixture(scope="module")
def original(setup):
    ctx = _context(setup)
    return ctx, speculate(setup, ctx)


# ---------------------------------------------------------------- tests


def test_correct_plan_moves_the_draft_context_exactly(setup, original):
    ctx, spec = original
    for i, layers in enumerate(ctx):  # the pool holds the reference rows, bf16
        for (k, v), (ok, ov) in zip(layers, setup["own_kv"][i], strict=True):
            assert torch.equal(k, ok[: len(k)]) and torch.equal(v, ov[: len(v)])
    moved = _context(setup, _move(setup, None))
    for a, b in zip(ctx, moved, strict=True):
        for (k, v), (mk, mv) in zip(a, b, strict=True):
            assert torch.equal(_as_bytes(k), _as_bytes(mk)) and torch.equal(
                _as_bytes(v), _as_bytes(mv)
            )
    after = speculate(setup, moved)
    print(
        f"\n[run layout] {N_PROMPTS} held-out prompts x {MAX_NEW} tokens, k={K}: "
        f"tokens/forward original {spec['tpf']:.3f}, moved {after['tpf']:.3f}"
    )
    assert after["counts"] == spec["counts"]
    assert spec["tpf"] >= MIN_TPF, spec


def test_page16_declared_as_one_run_is_refused():
    cfg = distill.load_draft(DSPARK_CHAIN)[0]
    wrong = _regions(cfg, 0, 1, 1)  # the pool really is 8 runs per page
    for c in range(C_TP):
        with pytest.raises(HandshakeError) as e:
            plan_transfer(wrong, 0, 1, _regions(cfg, c, C_TP, RUNS), c, C_TP)
        names = [f"{kind} draft layer {i}" for i in range(2) for kind in ("draft_k", "draft_v")]
        assert len(e.value.problems) == len(names)
        for name, problem in zip(names, e.value.problems, strict=True):
            assert problem.startswith(f"{name}: runs_per_page producer 1, consumer 8 at 128-token")


def test_bypassed_check_scrambles_the_context_and_drops_acceptance(setup, original):
    ctx, spec = original
    # the bypass path is faithful: with the true declarations it writes the planner's bytes
    for a, b in zip(_move(setup, setup["prod"]), _move(setup, None), strict=True):
        assert all(torch.equal(_as_bytes(x), _as_bytes(y)) for x, y in zip(a, b, strict=True))
    wrong = _regions(setup["cfg"], 0, 1, 1)
    bufs = _move(setup, wrong)
    _check_pack_path_agrees(setup, wrong, bufs)
    damaged = _context(setup, bufs)
    i = max(range(N_PROMPTS), key=lambda j: setup["plens"][j])
    n = setup["plens"][i]
    assert 32 < n <= 64, n
    k_true, k_got = ctx[i][0][0], damaged[i][0][0]  # draft layer 0's K [n, heads, dim]
    assert torch.equal(k_got[:16, 0], k_true[:16, 0])  # run 0 of head 0: in place
    assert torch.equal(k_got[16:32, 0], k_true[:16, 1])  # head 1's tokens 0-15
    assert torch.equal(k_got[32:n, 0], k_true[16 : n - 16, 0])  # head 0's tokens from 16
    assert not k_got[:, 1].any()  # rank 1 got runs 4-7: slots past the prompt, still zero
    for a, b in zip(ctx, damaged, strict=True):
        assert all(
            not torch.equal(x, y)
            for pa, pb in zip(a, b, strict=True)
            for x, y in zip(pa, pb, strict=True)
        )
    bad = speculate(setup, damaged)
    print(
        f"\n[run layout] page-16 pool declared as 1 run, check bypassed: tokens/forward "
        f"{spec['tpf']:.3f} -> {bad['tpf']:.3f} over {MAX_NEW} tokens; first verify after the "
        f"hand-over {spec['first']:.3f} -> {bad['first']:.3f}"
    )
    assert spec["first"] - bad["first"] >= MIN_FIRST_STEP_DROP, (spec["first"], bad["first"])
    assert spec["tpf"] - bad["tpf"] >= MIN_LOOP_DROP, (spec["tpf"], bad["tpf"])


def _check_pack_path_agrees(setup, wrong, bufs):
    """Staged head cuts land the same bytes: pack under the declared layout, unpack under the
    consumer's (the damage does not depend on how the bytes travel)."""
    pages = torch.tensor([p[0] for p in setup["src_pages"]])
    dst_pages = torch.tensor([p[0] for p in setup["dst_pages"]])
    for c in range(C_TP):
        for j, (src, r) in enumerate(zip(setup["prod_bufs"], wrong, strict=True)):
            declared = RunLayout.of(src, PAGE, r.runs_per_page)
            staged = reference_pack_heads(src, pages, c, 1, declared)
            dst = _consumer_bufs(setup, c)[j]
            out = reference_unpack_heads(staged, dst, dst_pages, 0, 1, _layout(dst))
            slots = torch.cat([_slots(p, PAGE) for p in setup["dst_pages"]])
            assert torch.equal(_as_bytes(out[slots]), _as_bytes(bufs[c][j][slots]))
