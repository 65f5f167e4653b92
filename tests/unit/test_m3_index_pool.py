"""One M3 index cache: SGLang's index-key pools are not built when sgl_atom's M3 model serves its
sparse layers on the atom backend, and the budget prices the atom index cache in their place."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_atom.attention import m3_index_pool as mip
from sgl_atom.attention.sparse import SparseConfig, index_row_width
from sgl_atom.cpu_mode import cache_dir
from sgl_atom.patches import m3_index_pool, m3_index_pool_build
from sgl_atom.testing import tiny


@pytest.fixture(scope="module")
def hf_config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny.build(cache_dir() / "tiny" / "m3", "m3", log=print))


def _kvc(hf, served_on_atom=True, kv_dtype=torch.bfloat16, draft=False):
    return SimpleNamespace(
        model=SimpleNamespace(SERVES_SPARSE_ON_ATOM=served_on_atom),
        model_config=SimpleNamespace(
            hf_config=hf, head_dim=128, get_total_num_kv_heads=lambda: hf.num_key_value_heads
        ),
        layer_info=SimpleNamespace(start_layer=0, end_layer=hf.num_hidden_layers),
        kv_cache_dtype=kv_dtype,
        is_draft_worker=draft,
    )


@pytest.fixture
def atom_backends(monkeypatch):
    import sglang.srt.runtime_context as rc

    def set_backends(*names):
        monkeypatch.setattr(rc, "attention_backends", lambda: names)

    monkeypatch.setattr(rc, "get_memory", lambda: SimpleNamespace(enable_hisparse=False))
    set_backends("atom", "atom")
    return set_backends


def test_index_pools_are_skipped_only_for_the_atom_served_model(hf_config, atom_backends):
    assert mip.skips_sglang_index_pools(_kvc(hf_config)) is None
    assert "not served by the atom backend" in mip.skips_sglang_index_pools(
        _kvc(hf_config, served_on_atom=False)
    )
    atom_backends("atom", "torch_native")
    assert "not served by the atom backend" in mip.skips_sglang_index_pools(_kvc(hf_config))


def _pool_kwargs(hf):
    return dict(
        size=256,
        page_size=16,
        dtype=torch.bfloat16,
        head_num=hf.num_key_value_heads,
        head_dim=128,
        idx_head_dim=128,
        dense_layer_ids=[0],
        sparse_layer_ids=[1, 2, 3],
        disable_value_sparse_layer_ids=[1, 2, 3],
        device="cpu",
        start_layer=0,
        end_layer=4,
    )


@pytest.mark.parametrize("marked", [True, False], ids=["atom-build", "upstream-build"])
def test_a_marked_build_allocates_no_index_pool(hf_config, marked):
    from sglang.srt.mem_cache.memory_pool import MiniMaxSparseKVPool

    pool = MiniMaxSparseKVPool.__new__(MiniMaxSparseKVPool)
    token = mip.SKIP_SGLANG_INDEX_POOLS.set(marked)
    try:
        m3_index_pool.pool_without_index_pools(
            MiniMaxSparseKVPool.__init__, pool, **_pool_kwargs(hf_config)
        )
    finally:
        mip.SKIP_SGLANG_INDEX_POOLS.reset(token)
    assert pool.main_pool.layer_num == 4 and pool.index_kv_pool is None
    assert (pool.index_k_pool is None) == marked
    k_bytes, v_bytes = pool.get_kv_size_bytes()  # SGLang's own accounting copes with None
    assert k_bytes > 0 and v_bytes > 0


def test_the_builder_hook_marks_only_its_own_build(hf_config, atom_backends):
    seen = []
    build, mark = m3_index_pool_build.build_without_index_pools, mip.SKIP_SGLANG_INDEX_POOLS
    build(lambda kvc: seen.append(mark.get()), _kvc(hf_config))
    build(lambda kvc: seen.append(mark.get()), _kvc(hf_config, served_on_atom=False))
    assert seen == [True, False] and mark.get() is False


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_budget_prices_the_atom_cache_instead(hf_config, atom_backends, monkeypatch, fp8):
    """The tiny m3 has sparse layers 1-3 with index_topk_freq 2: layers 1 and 3 score and hold
    keys (128 x 2 bytes in bf16; 128 x 1 + a 4-byte scale in fp8), layer 2 reuses."""
    cfg = SparseConfig.from_hf(hf_config, hf_config.num_key_value_heads, 128)
    assert [lid for lid in cfg.sparse_layer_ids if cfg.scores(lid)] == [1, 3]
    monkeypatch.setattr(mip, "_sglang_index_bytes_per_token", lambda kvc: 3 * 128 * 2)
    kv = torch.float8_e4m3fn if fp8 else torch.bfloat16
    conf = SimpleNamespace(_cell_size=10_000)
    assert mip.price_atom_index_cache(conf, _kvc(hf_config, kv_dtype=kv)) is conf
    ours = 2 * (128 + 4) if fp8 else 2 * 128 * 2
    assert conf._cell_size == 10_000 - 3 * 128 * 2 + ours
    untouched = SimpleNamespace(_cell_size=10_000)
    assert mip.price_atom_index_cache(untouched, _kvc(hf_config, served_on_atom=False)) is None
    assert mip.price_atom_index_cache(untouched, _kvc(hf_config, draft=True)) is None
    assert untouched._cell_size == 10_000


@pytest.mark.parametrize("kv_fp8", [False, True], ids=["bf16-kv", "fp8-kv"])
@pytest.mark.parametrize("choice", ["auto", "bf16", "fp8", "FP8", "int4"])
def test_index_dtype_choice_is_priced(hf_config, atom_backends, monkeypatch, kv_fp8, choice):
    """SGL_ATOM_M3_INDEX_DTYPE picks the index keys' dtype whatever the KV dtype (auto follows
    it), and the pool budget prices what the backend will allocate."""
    monkeypatch.setenv("SGL_ATOM_M3_INDEX_DTYPE", choice)
    want_fp8 = kv_fp8 if choice == "auto" else choice.lower() == "fp8"
    want = torch.float8_e4m3fn if want_fp8 else torch.bfloat16
    if choice == "int4":
        want = torch.uint8  # packed: 64 bytes + a 4-byte scale per scoring layer
    assert mip.atom_index_dtype(kv_fp8) == want
    monkeypatch.setattr(mip, "_sglang_index_bytes_per_token", lambda kvc: 0)
    conf = SimpleNamespace(_cell_size=1_000)
    kv = torch.float8_e4m3fn if kv_fp8 else torch.bfloat16
    assert mip.price_atom_index_cache(conf, _kvc(hf_config, kv_dtype=kv)) is conf
    per_layer = 64 + 4 if choice == "int4" else 128 + 4 if want_fp8 else 128 * 2
    assert conf._cell_size == 1_000 + 2 * per_layer


def test_an_unknown_index_dtype_is_refused(monkeypatch):
    monkeypatch.setenv("SGL_ATOM_M3_INDEX_DTYPE", "fp16")
    want = "SGL_ATOM_M3_INDEX_DTYPE='fp16': use auto, bf16, fp8 or int4"
    with pytest.raises(ValueError, match=want):
        mip.atom_index_dtype(False)


def test_index_values_or_hisparse_keep_sglang_pools(hf_config, atom_backends, monkeypatch):
    import copy

    import sglang.srt.runtime_context as rc

    with_value = copy.deepcopy(hf_config)
    with_value.sparse_attention_config["sparse_disable_index_value"] = [0, 1, 0, 1]
    assert "index value" in mip.skips_sglang_index_pools(_kvc(with_value))
    monkeypatch.setattr(rc, "get_memory", lambda: SimpleNamespace(enable_hisparse=True))
    assert mip.skips_sglang_index_pools(_kvc(hf_config)) == "HiSparse"


def test_int4_index_keys_need_an_even_index_dim():
    """Packed 4-bit keys hold two dims per byte: an odd sparse_index_dim is refused by name."""
    assert index_row_width(128, torch.uint8) == 64
    assert index_row_width(127, torch.float8_e4m3fn) == 127
    with pytest.raises(ValueError, match="sparse_index_dim is 127 .odd.: use fp8 or bf16"):
        index_row_width(127, torch.uint8)
