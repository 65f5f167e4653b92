"""AtomAttnBackend over a real SGLang token pool: page tables, chunked prefill, decode, fp8
scales following reused slots, and the static-buffer (CUDA-graph) metadata path.

The expected output is causal attention over the request's whole K/V history in float64.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

HEADS, KV_HEADS, DIM = 4, 2, 64


@pytest.fixture(autouse=True)
def _parallel():
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_tp_size=1):
        yield


def _runner(page_size: int, kv_dtype: torch.dtype, slots: int = 512):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(slots, page_size, kv_dtype, KV_HEADS, DIM, 1, "cpu", False)
    cfg = SimpleNamespace(
        get_max_num_attention_heads=lambda: HEADS,
        get_num_kv_heads=lambda tp: KV_HEADS,
        head_dim=DIM,
        context_len=256,
        is_encoder_decoder=False,
    )
    req_to_token = torch.zeros(4, 256, dtype=torch.int32)
    return SimpleNamespace(
        model_config=cfg,
        device="cpu",
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        token_to_kv_pool=pool,
        page_size=page_size,
        dtype=torch.bfloat16,
        kv_cache_dtype=kv_dtype,
    )


LAYER = SimpleNamespace(
    tp_q_head_num=HEADS,
    tp_k_head_num=KV_HEADS,
    tp_v_head_num=KV_HEADS,
    qk_head_dim=DIM,
    v_head_dim=DIM,
    scaling=DIM**-0.5,
    layer_id=0,
    logit_cap=0,
    sliding_window_size=-1,
    is_cross_attention=False,
)


def _assign_pages(runner, req: int, length: int, pages: list[int]) -> None:
    ps = runner.page_size
    slots = torch.tensor([pages[i // ps] * ps + i % ps for i in range(length)], dtype=torch.int32)
    runner.req_to_token_pool.req_to_token[req, :length] = slots


def _batch(runner, mode, reqs, prefix, new):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    rtt = runner.req_to_token_pool.req_to_token
    locs = torch.cat([rtt[r, p : p + n] for r, p, n in zip(reqs, prefix, new, strict=True)])
    seq = torch.tensor([p + n for p, n in zip(prefix, new, strict=True)], dtype=torch.int64)
    return SimpleNamespace(
        forward_mode=getattr(ForwardMode, mode),
        seq_lens=seq,
        seq_lens_cpu=seq,
        req_pool_indices=torch.tensor(reqs),
        extend_seq_lens=torch.tensor(new),
        extend_seq_lens_cpu=list(new),
        out_cache_loc=locs.to(torch.int64),
        spec_info=None,
    )


def _expected(q, k_hist, v_hist, positions):
    """q [n, H, D] at absolute positions over history [L, KV, D]; float64 causal attention."""
    g = HEADS // KV_HEADS
    k = k_hist.double().repeat_interleave(g, 1)
    v = v_hist.double().repeat_interleave(g, 1)
    out = []
    for i, pos in enumerate(positions):
        s = torch.einsum("hd,lhd->hl", q[i].double(), k[: pos + 1]) * DIM**-0.5
        out.append(torch.einsum("hl,lhd->hd", s.softmax(-1), v[: pos + 1]))
    return torch.stack(out)


def _run(backend, runner, mode, reqs, prefix, new, hist):
    fb = _batch(runner, mode, reqs, prefix, new)
    backend.init_forward_metadata(fb)
    q = torch.randn(sum(new), HEADS, DIM, dtype=torch.bfloat16)
    k = torch.cat([hist[r][0][p : p + n] for r, p, n in zip(reqs, prefix, new, strict=True)])
    v = torch.cat([hist[r][1][p : p + n] for r, p, n in zip(reqs, prefix, new, strict=True)])
    fwd = backend.forward_decode if mode == "DECODE" else backend.forward_extend
    out = fwd(q.view(-1, HEADS * DIM), k, v, LAYER, fb).view(-1, HEADS, DIM)
    expect, row = [], 0
    for r, p, n in zip(reqs, prefix, new, strict=True):
        expect.append(_expected(q[row : row + n], *hist[r], list(range(p, p + n))))
        row += n
    return out, torch.cat(expect)


def _rel(out, ref):
    assert not torch.isnan(out).any()
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill_then_decode(kv_dtype, page_size):
    from sgl_atom.attention.backend import AtomAttnBackend

    torch.manual_seed(0)
    runner = _runner(page_size, kv_dtype)
    backend = AtomAttnBackend(runner)
    lens = {0: 40, 1: 23}
    hist = {
        r: (
            torch.randn(n, KV_HEADS, DIM, dtype=torch.bfloat16) * 3,
            torch.randn(n, KV_HEADS, DIM, dtype=torch.bfloat16),
        )
        for r, n in lens.items()
    }
    # scrambled, non-contiguous pages for both requests (page 0 is the pool's padding page)
    perm = (torch.randperm(512 // page_size - 1) + 1).tolist()
    n0, n1 = -(-lens[0] // page_size), -(-lens[1] // page_size)
    pages = {0: perm[:n0], 1: perm[n0 : n0 + n1]}
    for r in lens:
        _assign_pages(runner, r, lens[r], pages[r])
    tol = 2e-2 if kv_dtype == torch.bfloat16 else 8e-2
    # prefill in two chunks (the second attends to a cached prefix), then two decode steps;
    # a fresh prompt's tokens attend to their own K/V as computed, so with fp8 KV the first
    # chunk reads nothing quantized and is held to the bf16 bound
    out, ref = _run(backend, runner, "EXTEND", [0, 1], [0, 0], [17, 9], hist)
    assert _rel(out, ref) < 2e-2
    out, ref = _run(backend, runner, "EXTEND", [0, 1], [17, 9], [21, 12], hist)
    assert _rel(out, ref) < tol
    for step in range(2):
        out, ref = _run(backend, runner, "DECODE", [0, 1], [38 + step, 21 + step], [1, 1], hist)
        assert _rel(out, ref) < tol


@pytest.mark.parametrize("dequant_mb", [256, 0], ids=["workspace", "in-kernel"])
def test_fp8_chunked_prefill_prefix_dequant(monkeypatch, dequant_mb):
    """An fp8 extend dequantizes its batch's cached prefixes, with its new rows, into a bf16
    workspace planned once per forward from the host's lengths; SGL_ATOM_EXTEND_DEQUANT_MB=0
    keeps the conversion in the kernel. Both within the fp8 bound of float64 attention, and
    the fresh first chunk within bf16's."""
    from sgl_atom.attention.backend import AtomAttnBackend

    monkeypatch.setenv("SGL_ATOM_EXTEND_DEQUANT_MB", str(dequant_mb))
    torch.manual_seed(1)
    runner = _runner(16, torch.float8_e4m3fn)
    backend = AtomAttnBackend(runner)
    lens = {0: 48, 1: 30}
    hist = {
        r: (torch.randn(n, KV_HEADS, DIM, dtype=torch.bfloat16) * 3,
            torch.randn(n, KV_HEADS, DIM, dtype=torch.bfloat16))
        for r, n in lens.items()
    }  # fmt: skip
    perm = (torch.randperm(512 // 16 - 1) + 1).tolist()
    _assign_pages(runner, 0, 48, perm[:3])
    _assign_pages(runner, 1, 30, perm[3:5])
    out, ref = _run(backend, runner, "EXTEND", [0, 1], [0, 0], [20, 11], hist)
    assert _rel(out, ref) < 2e-2
    out, ref = _run(backend, runner, "EXTEND", [0, 1], [20, 11], [28, 19], hist)
    plan = backend.forward_metadata.prefix_plan
    if dequant_mb:
        assert (plan.tokens, plan.max_seq_len, plan.offsets.tolist()) == (80, 48, [0, 48])
    else:
        assert plan is None
    assert _rel(out, ref) < 8e-2


def test_fp8_scales_follow_reused_slots():
    """A slot freed by one request and reused by another carries the new request's scale."""
    from sgl_atom.attention.backend import AtomAttnBackend

    torch.manual_seed(1)
    runner = _runner(16, torch.float8_e4m3fn)
    backend = AtomAttnBackend(runner)
    big = (
        torch.randn(32, KV_HEADS, DIM, dtype=torch.bfloat16) * 200,
        torch.randn(32, KV_HEADS, DIM, dtype=torch.bfloat16) * 200,
    )
    _assign_pages(runner, 0, 32, [4, 9])
    _run(backend, runner, "EXTEND", [0], [0], [32], {0: big})
    small = (
        torch.randn(32, KV_HEADS, DIM, dtype=torch.bfloat16) * 1e-3,
        torch.randn(32, KV_HEADS, DIM, dtype=torch.bfloat16) * 1e-3,
    )
    _assign_pages(runner, 1, 32, [9, 4])  # the same pages, in another order
    out, ref = _run(backend, runner, "EXTEND", [1], [0], [32], {1: small})
    assert _rel(out, ref) < 8e-2
    k_scale = backend.scales.layer(0)[0]
    assert k_scale[9 * 16 : 10 * 16].max() < 1e-3  # rewritten for the small values


def test_static_buffer_metadata_matches_eager():
    from sgl_atom.attention.backend import AtomAttnBackend

    torch.manual_seed(2)
    runner = _runner(16, torch.bfloat16)
    backend = AtomAttnBackend(runner)
    hist = {
        0: (
            torch.randn(30, KV_HEADS, DIM, dtype=torch.bfloat16),
            torch.randn(30, KV_HEADS, DIM, dtype=torch.bfloat16),
        )
    }
    _assign_pages(runner, 0, 30, [3, 8])
    _run(backend, runner, "EXTEND", [0], [0], [29], hist)
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    fb = _batch(runner, "DECODE", [0], [29], [1])
    backend.init_forward_metadata_out_graph(fb, in_capture=True)
    meta = backend.forward_metadata
    assert meta.page_table.data_ptr() == backend.graph_state["page_table"].data_ptr()
    q = torch.randn(1, HEADS * DIM, dtype=torch.bfloat16)
    k, v = hist[0][0][29:30], hist[0][1][29:30]
    graph_out = backend.forward_decode(q, k, v, LAYER, fb).clone()
    backend.graph_state = None
    backend.init_forward_metadata(fb)
    eager_out = backend.forward_decode(q, k, v, LAYER, fb)
    torch.testing.assert_close(graph_out, eager_out, rtol=1e-2, atol=1e-2)


def test_unsupported_head_dim_is_named():
    from sgl_atom.attention.backend import AtomAttnBackend, AtomConfigError

    runner = _runner(16, torch.bfloat16)
    runner.model_config.head_dim = 96
    with pytest.raises(AtomConfigError, match=r"head_dim 96 is not supported.*\(64, 128, 256\)"):
        AtomAttnBackend(runner)


def test_unsupported_fp8_dtype_is_named():
    from sgl_atom.attention.backend import AtomAttnBackend, AtomConfigError

    runner = _runner(16, torch.bfloat16)
    runner.kv_cache_dtype = torch.float8_e5m2
    with pytest.raises(AtomConfigError, match=r"float8_e5m2 is not supported.*float8_e4m3fn"):
        AtomAttnBackend(runner)


def _verify_history(backend, runner) -> dict:
    """Two requests of 34 tokens on scrambled pages, the first 30 prefilled through ``backend``
    (the last 4 are a verify window's): request -> (K, V) history."""
    hist = {
        r: (
            torch.randn(34, KV_HEADS, DIM, dtype=torch.bfloat16),
            torch.randn(34, KV_HEADS, DIM, dtype=torch.bfloat16),
        )
        for r in (0, 1)
    }
    _assign_pages(runner, 0, 34, [5, 2, 11])
    _assign_pages(runner, 1, 34, [7, 9, 3])
    _run(backend, runner, "EXTEND", [0, 1], [0, 0], [30, 30], hist)
    return hist


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_target_verify_is_causal_among_draft_tokens(kv_dtype):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sgl_atom.attention.backend import AtomAttnBackend

    torch.manual_seed(3)
    runner = _runner(16, kv_dtype)
    backend = AtomAttnBackend(runner)
    hist = _verify_history(backend, runner)
    # verify 4 draft tokens per request: seq_lens holds the committed length (30)
    fb = _batch(runner, "EXTEND", [0, 1], [30, 30], [4, 4])
    fb.forward_mode = ForwardMode.TARGET_VERIFY
    fb.seq_lens = fb.seq_lens_cpu = torch.tensor([30, 30])
    fb.spec_info = SimpleNamespace(draft_token_num=4)
    backend.init_forward_metadata(fb)
    q = torch.randn(8, HEADS, DIM, dtype=torch.bfloat16)
    k = torch.cat([hist[r][0][30:34] for r in (0, 1)])
    v = torch.cat([hist[r][1][30:34] for r in (0, 1)])
    out = backend.forward_extend(q.view(8, -1), k, v, LAYER, fb).view(8, HEADS, DIM)
    ref = torch.cat([_expected(q[4 * r : 4 * r + 4], *hist[r], [30, 31, 32, 33]) for r in (0, 1)])
    assert _rel(out, ref) < (2e-2 if kv_dtype == torch.bfloat16 else 8e-2)


class _HostOnly(torch.Tensor):
    """Sequence lengths as the device holds them: reading a value on the host is a failure
    (on a GPU it would wait for the queued work)."""

    def __int__(self):
        raise AssertionError("the backend read a device length on the host")

    def max(self, *args, **kwargs):
        if not args and not kwargs:
            raise AssertionError("the backend took the max of the device lengths")
        return super().max(*args, **kwargs)

    def item(self):
        raise AssertionError("the backend read a device length on the host")

    def tolist(self):
        raise AssertionError("the backend read the device lengths on the host")


@pytest.mark.parametrize("bound", [None, 40, 300], ids=["no-bound", "bound", "past-the-row"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static-buffers"])
def test_verify_with_the_lengths_on_the_device_only(bound, graphs):
    """A speculative decode under overlap scheduling without SGLang's host lengths
    (``seq_lens_cpu`` None): the page table is sized from the worker's host bound
    (``max_seq_len_host``), or the context length without one, never from the device, and the
    verify attends as with the host lengths; a bound past the ``req_to_token`` row (wider than
    the context) fits the static buffers."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sgl_atom.attention.backend import AtomAttnBackend

    torch.manual_seed(5)
    runner = _runner(16, torch.bfloat16)
    runner.req_to_token_pool.req_to_token = torch.zeros(4, 256 + 16, dtype=torch.int32)
    backend = AtomAttnBackend(runner)
    hist = _verify_history(backend, runner)
    if graphs:
        backend.init_cuda_graph_state(max_bs=4, max_num_tokens=16)
    q = torch.randn(8, HEADS, DIM, dtype=torch.bfloat16)
    k = torch.cat([hist[r][0][30:34] for r in (0, 1)])
    v = torch.cat([hist[r][1][30:34] for r in (0, 1)])
    outs = []
    for host in (True, False):
        fb = _batch(runner, "EXTEND", [0, 1], [30, 30], [4, 4])
        fb.forward_mode = ForwardMode.TARGET_VERIFY
        fb.seq_lens = torch.tensor([30, 30])
        fb.seq_lens_cpu = fb.seq_lens.clone() if host else None
        if not host:
            fb.seq_lens = fb.seq_lens.as_subclass(_HostOnly)
            fb.max_seq_len_host = bound
        fb.spec_info = SimpleNamespace(draft_token_num=4)
        if graphs:
            backend.init_forward_metadata_out_graph(fb, in_capture=True)
        else:
            backend.init_forward_metadata(fb)
        if not host and not graphs:
            assert backend.forward_metadata.max_kv_len == (bound or 256) + 4
        out = backend.forward_extend(q.view(8, -1), k, v, LAYER, fb).view(8, HEADS, DIM)
        outs.append(out.clone())
    ref = torch.cat([_expected(q[4 * r : 4 * r + 4], *hist[r], [30, 31, 32, 33]) for r in (0, 1)])
    assert _rel(outs[0], ref) < 2e-2
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    "backends, kv_dtype, grows",
    [
        (["atom"], torch.float8_e4m3fn, True),
        (["atom", "torch_native"], torch.float8_e4m3fn, False),
        (["atom"], torch.bfloat16, False),
    ],
    ids=["atom-fp8", "mixed-backends", "atom-bf16"],
)
def test_fp8_scales_are_priced_into_the_pool_budget(monkeypatch, backends, kv_dtype, grows):
    import sglang.srt.runtime_context as rc

    from sgl_atom.attention.kv_scales import add_atom_fp8_scales

    monkeypatch.setattr(rc, "attention_backends", lambda: backends)
    kvc = SimpleNamespace(
        kv_cache_dtype=kv_dtype,
        use_mla_backend=False,
        mambaish_config=None,
        layer_info=SimpleNamespace(num_effective_layers=3),
        model_config=SimpleNamespace(get_num_kv_heads=lambda tp: KV_HEADS),
    )
    conf = SimpleNamespace(_cell_size=1000)
    add_atom_fp8_scales(conf, kvc)
    # K and V, 4 bytes each, per KV head and layer
    assert conf._cell_size == (1000 + 2 * 4 * KV_HEADS * 3 if grows else 1000)
