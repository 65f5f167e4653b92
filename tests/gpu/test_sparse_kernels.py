"""sparse_attention on the GPU at serving shapes (head_dim 128, index_dim 128, GQA 8:1), against the
float64 references. On the GPU machine: `python -m pytest -q tests/gpu/test_sparse_kernels.py`."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

UNIT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "unit", "kernels")
sys.path.insert(0, UNIT)


def _unit_module(name: str):
    """The CPU test module of the same family, under another name (the file names collide)."""
    spec = importlib.util.spec_from_file_location(f"unit_{name}", os.path.join(UNIT, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_u = _unit_module("test_sparse_attention")
make_case, ref_select, run_attention, run_select, sa = (
    _u.make_case,
    _u.ref_select,
    _u.run_attention,
    _u.run_select,
    _u.sa,
)
assert_close_rel = _u.assert_close_rel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPE = dict(kv_heads=8, group=8, head_dim=128, index_dim=128)
MODES = {
    "decode": ([3000, 4097, 128, 1], [1, 1, 1, 1]),
    "extend": ([1500, 2100], [300, 77]),
    "verify": ([2900, 1031, 700], [4, 4, 4]),
}


def case(mode, page_size, **kw):
    seqs, qo = MODES[mode]
    return make_case(seqs, qo, page_size, decode=mode == "decode", dev="cuda", **SHAPE, **kw)


def test_gpu_index_write_int4():
    """The packed 4-bit index write on the GPU: the CPU test's checks (bytes and scales equal the
    reference writer's, half a step at most, slots outside loc untouched)."""
    _u.test_index_write_int4()


def _int4_dots(index: str, monkeypatch) -> dict:
    """make_case flags for `index`; "int4": the 4-bit cache scored as the library does (integer
    MMAs), "int4-f16": by fp16 dots."""
    monkeypatch.setattr(sa.block_select, "INT4_DOT", "f16" if index == "int4-f16" else "i8")
    return dict(index_fp8=index == "fp8", index_int4=index.startswith("int4"))


@pytest.mark.parametrize("index", ["bf16", "fp8", "int4", "int4-f16"])
@pytest.mark.parametrize("page_size", [1, 16, 64, 128], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("mode", list(MODES))
def test_gpu_scores(mode, page_size, index, monkeypatch):
    kw = _int4_dots(index, monkeypatch)
    c = case(mode, page_size, dtype=torch.bfloat16, seed=page_size, **kw)
    scores = sa.block_scores(
        c.iq,
        c.ik,
        c.page_table,
        c.seq_lens,
        c.page_size,
        0.09,
        c.qo_indptr,
        c.max_qo_len,
        index_scale=c.iks,
    )
    ref = sa.reference_block_scores(
        c.iq, c.ik, c.page_table, c.seq_lens, c.indptr, c.page_size, 0.09, c.iks
    )
    pos = torch.cat(
        [
            n - (hi - lo) + torch.arange(hi - lo)
            for n, lo, hi in zip(
                c.seq_lens.tolist(), c.indptr[:-1].tolist(), c.indptr[1:].tolist(), strict=True
            )
        ]
    )
    vis = (torch.arange(ref.shape[2])[None, None, :] <= (pos // 128)[:, None, None]).expand_as(ref)
    assert_close_rel(scores.cpu()[..., : ref.shape[2]][vis], ref[vis], 1e-5, "block scores")


@pytest.mark.parametrize("index", ["fp8", "int4", "int4-f16"])
@pytest.mark.parametrize("magnitude", [1e-7, 1e7], ids=lambda m: f"q{m:g}")
@pytest.mark.parametrize("nb", [1, 4])
def test_gpu_scores_scaled_q_magnitude(nb, magnitude, index, monkeypatch):
    """fp16 or integer dots for an fp8 or 4-bit cache: q far outside fp16's range still scores
    exactly (as the reference rounds it for the 4-bit cache)."""
    kw = _int4_dots(index, monkeypatch)
    c = case("decode", 128, dtype=torch.bfloat16, seed=5, **kw)
    c.iq.mul_(magnitude)
    c.iq[-1, -1] = 0.0
    scores = sa.block_scores(
        c.iq, c.ik, c.page_table, c.seq_lens, 128, 0.09, index_scale=c.iks, blocks_per_program=nb
    )
    ref = sa.reference_block_scores(
        c.iq, c.ik, c.page_table, c.seq_lens, c.indptr, 128, 0.09, c.iks
    )
    vis = (
        torch.arange(ref.shape[2])[None, None, :] <= ((c.seq_lens.cpu() - 1) // 128)[:, None, None]
    )
    vis = vis.expand_as(ref)
    assert_close_rel(scores.cpu()[..., : ref.shape[2]][vis], ref[vis], 1e-5, "block scores")


@pytest.mark.parametrize("mode", list(MODES))
def test_gpu_selection_exact(mode):
    c = case(mode, 16, dtype=torch.float32, seed=3)
    sel, cnt = run_select(c, 16, 1, 2)
    ref_sel, ref_cnt = ref_select(c, 16, 1, 2)
    assert torch.equal(cnt.cpu(), ref_cnt) and torch.equal(sel.cpu(), ref_sel)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("page_size", [1, 16, 128], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("mode", list(MODES))
def test_gpu_sparse_attention(mode, page_size, kv):
    c = case(mode, page_size, dtype=torch.bfloat16, kv_fp8=kv == "fp8", seed=7)
    sel, cnt = run_select(c, 8, 1, 1)
    ref = sa.reference_sparse_attention(
        c.q, c.k, c.v, c.page_table, c.seq_lens, c.indptr, sel, c.page_size, 0.2, c.ks, c.vs
    )
    for splits in (None, 3):
        assert_close_rel(
            run_attention(c, sel, cnt, splits), ref, 1e-2, f"sparse attention splits={splits}"
        )


@pytest.mark.parametrize("mode", list(MODES))
def test_gpu_all_blocks_equals_dense(mode):
    c = case(mode, 64, dtype=torch.bfloat16, seed=9)
    sel, cnt = run_select(c, 40, 1, 1)  # 4097 tokens = 33 blocks
    dense = sa.reference_dense_attention(
        c.q, c.k, c.v, c.page_table, c.seq_lens, c.indptr, c.page_size, 0.2
    )
    assert_close_rel(run_attention(c, sel, cnt), dense, 1e-2, "sparse with all blocks vs dense")


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "extend"])
@pytest.mark.parametrize("batch", [16, 1100])
def test_gpu_block_counts(decode, batch):
    """The sparse layers' one-launch block counters on the device, as on CPU."""
    _u.test_block_counts_add_one_layer_step(decode, batch)
