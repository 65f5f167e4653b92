"""The ATOM_DSPARK worker's decode step around the verify, on random batches:

* its verify input, built on the device, equals the one SGLang's n-gram path builds from the
  same draft tokens on the host (its path for a batch with a grammar): tokens, positions, cache
  slots, the chain mask and the retrieve indices;
* each request's anchor is the last accepted token of the previous step, from the draft input
  SGLang relays (under overlap scheduling ``req.output_ids`` are a step behind: here they hold
  other tokens, so reading them fails the check);
* the draft context written after the verify (fixed shapes, no boolean selection) lands at the
  slot of every committed row with that row's K/V, and nowhere else but SGLang's padding slot 0;
  the slots come from the verify's ``out_cache_loc`` (the batch here has no ``req_to_token``).

The worker module imports SGLang's n-gram worker, which needs a CUDA driver: the check runs in
a child process with the CPU-mode shim and sgl_atom's CPU speculative ops, as a CPU server
does."""

from __future__ import annotations

import subprocess
import sys

from sgl_atom import cpu_mode

CHECK = r"""
import random, sys, types
import torch
from sgl_atom import cpu_spec_ops
cpu_spec_ops.install()
from sglang.srt.speculative import ngram_worker
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sgl_atom.speculative.dspark import worker as dspark_worker
from sgl_atom.speculative.dspark.worker import AtomDSparkWorker

# no mamba state here (both paths call it)
ngram_worker.prepare_mamba_track_for_verify = lambda batch: None
dspark_worker.prepare_mamba_track_for_verify = lambda batch: None
FIELDS = ("input_ids", "loc", "draft", "mask", "pos", "ri", "rn", "rs")


def worker(n, max_bs):
    w = AtomDSparkWorker.__new__(AtomDSparkWorker)
    w.device, w.draft_token_num, w.holds_draft = "cpu", n, False
    w.propose_enabled, w.grammar_tree_host = True, None
    w.graphs = None  # no CUDA graphs here: the eager draft pass (stubbed below)
    w._target_worker = types.SimpleNamespace(get_memory_pool=lambda: (None, None))
    w.model_runner = types.SimpleNamespace(max_running_requests=max_bs)
    w.alloc_memory_pool()  # SGLang's buffers, then the chain mask
    return w


def build(w, case, grammar, host_lens=True):
    bs, reqs, seq_lens, pool_idx, req_to_token, drafts, relayed = case
    w._propose = lambda b, anchors: drafts
    for buf in (w.draft_tokens, w.positions, w.retrieve_indexes, w.retrieve_next_token,
                w.retrieve_next_sibling):
        buf.fill_(-99)  # poisoned: every value read must be written by this step
    b = types.SimpleNamespace(
        forward_mode=ForwardMode.DECODE, reqs=reqs, seq_lens=seq_lens.clone(),
        seq_lens_cpu=seq_lens.clone() if host_lens else None, req_pool_indices=pool_idx.clone(),
        req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token),
        has_grammar=grammar, spec_info=relayed, input_ids=None, out_cache_loc=None)
    w._prepare_for_speculative_decoding(b)
    assert b.forward_mode == ForwardMode.TARGET_VERIFY
    s = b.spec_info
    assert s.draft_token_num == w.draft_token_num
    got = (b.input_ids, b.out_cache_loc, s.draft_token, s.custom_mask, s.positions,
           s.retrieve_index, s.retrieve_next_token, s.retrieve_next_sibling)
    # the host bound the atom backend sizes its page table from when the lengths stay on the
    # device: each request's allocated KV, at most a req_to_token row
    bound = max(max(r.kv.kv_allocated_len, r.seqlen + 2 * w.draft_token_num) for r in reqs)
    assert b.max_seq_len_host == min(bound, req_to_token.shape[1]), b.max_seq_len_host
    assert b.max_seq_len_host >= min(int(seq_lens.max()) + w.draft_token_num, req_to_token.shape[1])
    return {k: t.clone() for k, t in zip(FIELDS, got)}


rng = random.Random(int(sys.argv[1]))
for _ in range(int(sys.argv[2])):
    n, max_bs, width = rng.choice([2, 5, 8]), rng.randint(1, 12), 96
    bs = rng.randint(1, max_bs)
    seq_lens = torch.tensor([rng.randint(1, width - n - 1) for _ in range(bs)])
    pool_idx = torch.tensor(rng.sample(range(2 * max_bs), bs))
    req_to_token = torch.randperm(2 * max_bs * width).reshape(2 * max_bs, width)
    # a step behind, as under overlap: ids the anchors must not come from
    # SGLang allocates each request its window and a reserve (here up to past the row); the
    # host's length is up to one window behind the device's
    allocated = [rng.choice([0, s + n + rng.randint(0, 2 * n)]) for s in seq_lens.tolist()]
    reqs = [types.SimpleNamespace(output_ids=[1000 + rng.randrange(1000)] * rng.randint(0, 2),
                                  origin_input_ids=[1000 + rng.randrange(1000)],
                                  seqlen=max(1, s - rng.randint(0, n)),
                                  kv=types.SimpleNamespace(kv_allocated_len=a))
            for s, a in zip(seq_lens.tolist(), allocated)]
    drafts = torch.randint(0, 1000, (bs, n - 1))
    # the previous step's accepted tokens as relayed: past each accept length, other tokens
    accept_lens = torch.tensor([rng.randint(1, n) for _ in range(bs)], dtype=torch.int32)
    accepted = torch.randint(0, 1000, (bs, n), dtype=torch.int32)
    anchors = accepted[torch.arange(bs), accept_lens.long() - 1].long()
    relayed = types.SimpleNamespace(accept_tokens=accepted.flatten(), accept_lens=accept_lens)
    case = (bs, reqs, seq_lens, pool_idx, req_to_token, drafts, relayed)
    w = worker(n, max_bs)
    dev, host = build(w, case, False), build(worker(n, max_bs), case, True)
    device_lens = build(worker(n, max_bs), case, False, host_lens=False)  # overlap, no host copy
    for k in FIELDS:
        assert torch.equal(dev[k], host[k]), (k, dev[k], host[k])
        assert torch.equal(device_lens[k], dev[k]), (k, device_lens[k], dev[k])
    cols = torch.arange(n)
    assert torch.equal(dev["input_ids"].view(bs, n), torch.cat([anchors[:, None], drafts], 1))
    assert torch.equal(dev["pos"].view(bs, n), seq_lens[:, None] + cols)
    slots = req_to_token[pool_idx[:, None], seq_lens[:, None] + cols]
    assert torch.equal(dev["loc"].view(bs, n), slots)
    if n > 2:  # the device path reads the chain mask alloc_memory_pool wrote: without it, not
        w.tree_mask.fill_(False)
        assert not torch.equal(build(w, case, False)["rn"], host["rn"])
    no_relay = (bs, reqs, seq_lens, pool_idx, req_to_token, drafts, None)
    try:
        build(worker(n, max_bs), no_relay, False)
        raise AssertionError("a decode batch without the relayed tokens was drafted")
    except RuntimeError as e:
        assert "previous step's accepted tokens" in str(e), e
print("verify inputs equal")


class Pool:
    def __init__(self, slots):
        self.k = torch.full((slots, 4), -7.0)

    def write(self, layer, loc, k, v):
        assert layer == 0 and k.shape == v.shape == (loc.numel(), 4)
        self.k[loc] = k


def context_kv(taps, positions, max_position):
    assert int(positions.max()) <= max_position
    return [(taps[:, :4] + positions[:, None], taps[:, 4:] - positions[:, None])]


for _ in range(int(sys.argv[2])):
    n, bs, width = rng.choice([2, 5, 8]), rng.randint(1, 9), 64
    slots = 2 * bs * width + 1
    w = AtomDSparkWorker.__new__(AtomDSparkWorker)
    w.device, w.draft_token_num, w.stale_context = "cpu", n, False
    w.graphs, w.passes = None, {"writes eager": 0}  # no CUDA graphs here: the eager write
    w.draft, w.pool = types.SimpleNamespace(context_kv=context_kv), Pool(slots)
    seq_lens = torch.tensor([rng.randint(1, width - n) for _ in range(bs)])
    pool_idx = torch.tensor(rng.sample(range(2 * bs), bs))
    req_to_token = (torch.randperm(slots - 1) + 1)[: 2 * bs * width].reshape(2 * bs, width)
    b = types.SimpleNamespace(
        reqs=[None] * bs, seq_lens=seq_lens, seq_lens_cpu=seq_lens, req_pool_indices=pool_idx)
    accept_lens = torch.tensor([rng.randint(1, n) for _ in range(bs)], dtype=torch.int32)
    cols = torch.arange(n)
    chain = torch.arange(bs)[:, None] * n + cols
    accept_index = torch.where(cols < accept_lens[:, None], chain, -1)
    taps = torch.randn(bs * n, 8)
    window = req_to_token[pool_idx[:, None], seq_lens[:, None] + cols].flatten()  # out_cache_loc
    w._write_verify_context(b, taps, accept_index.to(torch.int32), accept_lens, window)
    assert w.passes == {"writes eager": 1}
    want = torch.full((slots, 4), -7.0)
    for r in range(bs):
        for i in range(int(accept_lens[r])):
            pos = int(seq_lens[r]) + i
            want[req_to_token[pool_idx[r], pos]] = taps[r * n + i, :4] + pos
    touched = (w.pool.k != want).any(1).nonzero().flatten().tolist()
    assert touched in ([], [0]), touched  # only the padding slot holds anything else
    assert (want[0] == -7.0).all()
print("context rows written")

# the acceptance counts come through SGLang's hook, already on the host: same parameters
import inspect
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
ours = inspect.signature(AtomDSparkWorker.on_verify_complete_cpu).parameters
assert ours.keys() == inspect.signature(BaseSpecWorker.on_verify_complete_cpu).parameters.keys()
w = AtomDSparkWorker.__new__(AtomDSparkWorker)
w.holds_draft, w.graphs = True, None
from sgl_atom.speculative.dspark.accept import SpecStats
w.stats, w.total = SpecStats(4), SpecStats(4)
w.on_verify_complete_cpu([3, 0, 4], batch_size=3)
assert (w.total.steps, w.total.accepted, w.stats.accepted) == (3, 7, 7)
print("acceptance counted from the host")
"""


def test_device_verify_input_and_context_write_on_random_batches():
    env = cpu_mode.server_env(1)
    proc = subprocess.run(
        [sys.executable, "-c", CHECK, str(__import__("random").randrange(1 << 30)), "12"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "verify inputs equal" in proc.stdout and "context rows written" in proc.stdout
    assert "acceptance counted from the host" in proc.stdout
