"""The draft KV dtype option: rules, the family table against SGLang, the CLI, the budget."""

from __future__ import annotations

import dataclasses
import logging
import pickle
import sys
from types import SimpleNamespace

import pytest

from sgl_atom.speculative import draft_kv_budget as budget
from sgl_atom.speculative import draft_kv_dtype as dk
from sgl_atom.speculative.draft_kv_dtype import ALIAS_FLAG, SGLANG_FLAG, DraftKVDtypeError

_LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=256,
)
_MLA = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    hidden_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    intermediate_size=128,
    moe_intermediate_size=32,
    vocab_size=256,
)


def resolve(requested, target="bf16", algorithm="EAGLE3", tokens=3, family="mha"):
    return dk.resolve_draft_kv_dtype(requested, target, algorithm, tokens, family)


# --- resolution table ---------------------------------------------------------------------


@pytest.mark.parametrize("target", ["bf16", "fp8", "bfloat16", "fp8_e4m3", "auto", "fp32"])
@pytest.mark.parametrize("family", ["mha", "mla", "mtp", "none"])
def test_omitted_is_the_targets_dtype(target, family):
    assert resolve(None, target=target, family=family) == dk.canonical_target(target)
    assert resolve(None, target=target, algorithm=None, tokens=0, family=family)


@pytest.mark.parametrize("target", ["bf16", "fp8", "fp32"])
@pytest.mark.parametrize(
    "requested,settled",
    [("bf16", "bf16"), ("fp8", "fp8"), ("bfloat16", "bf16"), ("fp8_e4m3", "fp8")],
)
@pytest.mark.parametrize("algorithm", ["EAGLE3", "EAGLE", "STANDALONE", "DFLASH", "DSPARK"])
def test_own_pool_drafts_take_bf16_or_fp8(target, requested, settled, algorithm):
    assert resolve(requested, target=target, algorithm=algorithm) == settled


@pytest.mark.parametrize("family", ["mla", "mtp", "none"])
def test_shared_pool_draft_refuses_another_dtype(family):
    words = dk.FAMILY_WORDS[family]
    with pytest.raises(DraftKVDtypeError, match=f"needs a draft with its own KV pool; {words}"):
        resolve("fp8", target="bf16", family=family)
    assert resolve("fp8_e4m3", target="fp8", family=family) == "fp8"  # the same dtype is fine


@pytest.mark.parametrize("algorithm,tokens", [(None, 3), ("EAGLE3", 0), (None, 0), (None, None)])
def test_needs_an_algorithm_and_speculative_tokens(algorithm, tokens):
    with pytest.raises(DraftKVDtypeError) as e:
        resolve("fp8", algorithm=algorithm, tokens=tokens)
    msg = str(e.value)
    assert SGLANG_FLAG in msg and "--speculative-algorithm" in msg
    assert "non-zero number of speculative tokens" in msg


@pytest.mark.parametrize("value", ["int8", "fp8_e5m2", "auto", "fp4", "", "FP16"])
@pytest.mark.parametrize("family", ["mha", "mtp"])
def test_python_caller_value_outside_bf16_fp8_is_refused(value, family):
    with pytest.raises(DraftKVDtypeError, match="use bf16 or fp8"):
        resolve(value, family=family)
    with pytest.raises(DraftKVDtypeError, match=ALIAS_FLAG):
        dk.settle(None, value, "bf16", "EAGLE3", 3, family)


def test_alias_equal_is_accepted_and_different_names_both_flags():
    assert dk.merge_requests("fp8_e4m3", "fp8") == "fp8"
    assert dk.merge_requests(None, "bf16") == "bf16"
    assert dk.merge_requests("bfloat16", None) == "bf16"
    with pytest.raises(DraftKVDtypeError) as e:
        dk.merge_requests("bf16", "fp8")
    assert SGLANG_FLAG in str(e.value) and ALIAS_FLAG in str(e.value)


def test_requested_and_settled_are_kept_apart():
    omitted = dk.settle(None, None, "fp8_e4m3", "EAGLE3", 3, "mha")
    assert (omitted.requested, omitted.settled, omitted.target) == (None, "fp8", "fp8")
    asked = dk.settle(None, "fp8", "bf16", "DSPARK", 7, "mha")
    assert (asked.requested, asked.settled, asked.owns_pool, asked.family) == (
        "fp8",
        "fp8",
        True,
        "mha",
    )
    same = dk.settle("bf16", None, "bf16", "NEXTN", 3, "mtp")
    assert same.requested == "bf16" and not same.owns_pool and not same.differs
    with pytest.raises(dataclasses.FrozenInstanceError):
        asked.settled = "bf16"  # type: ignore[misc]
    assert dk.to_sglang_dtype(asked.settled) == "fp8_e4m3"


def test_key_suffix_only_when_the_draft_differs():
    assert dk.draft_key_suffix(None) == ""
    assert dk.draft_key_suffix(dk.settle(None, None, "bf16", "EAGLE3", 3, "mha")) == ""
    assert dk.draft_key_suffix(dk.settle("bf16", None, "bf16", "EAGLE3", 3, "mha")) == ""
    assert dk.draft_key_suffix(dk.settle(None, "fp8", "bf16", "EAGLE3", 3, "mha")) == (
        "draft_kv=fp8"
    )
    assert dk.draft_key_suffix(dk.settle(None, "bf16", "fp8", "EAGLE3", 3, "mha")) == (
        "draft_kv=bf16"
    )


def test_family_from_algorithm_and_checkpoint():
    assert dk.attention_family("FROZEN_KV_MTP", mla=False) == "mtp"
    assert dk.attention_family("NGRAM") == "none" and dk.attention_family("UNO") == "none"
    assert dk.attention_family("EAGLE", nextn=True) == "mtp"
    assert dk.attention_family("EAGLE", mtp_head=True, mla=True) == "mtp"
    assert dk.attention_family("EAGLE3", mla=True) == "mla"
    assert dk.attention_family("DSPARK") == "mha"
    assert dk.attention_family(None) == "none"
    with pytest.raises(KeyError, match="unknown draft attention family"):
        dk.owns_pool("gqa")


# --- the family table pinned to SGLang 0.5.23's pool builders -------------------------------


@pytest.fixture(scope="module")
def sglang_kernels_importable():
    """SGLang's worker modules import its CUDA kernel package, which needs a libcuda."""
    import ctypes
    import os

    from sgl_atom import cpu_mode

    if not cpu_mode.has_nvidia_driver():
        ctypes.CDLL(str(cpu_mode.build_shim() / cpu_mode.SHIM_NAME), mode=os.RTLD_GLOBAL)


class _Recorder:
    def __init__(self, calls):
        self.calls = calls

    def alloc_memory_pool(self, memory_pool_config=None, **kwargs):
        self.calls.append(memory_pool_config)


def _allocates_at_target_size(cls, monkeypatch) -> bool:
    """Run ``cls.alloc_memory_pool`` on a bare instance; True when a draft pool is built with
    the target's pool config (its own pool, one slot per target slot)."""
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig

    calls: list = []

    def tp_worker_alloc(worker, memory_pool_config=None, **kwargs):
        calls.append(memory_pool_config)

    monkeypatch.setattr(TpModelWorker, "alloc_memory_pool", tp_worker_alloc)
    monkeypatch.setattr(
        f"{cls.__module__}.get_spec",
        lambda: SimpleNamespace(speculative_use_rejection_sampling=False),
        raising=False,
    )
    inst = cls.__new__(cls)
    runner = SimpleNamespace(model=object(), max_running_requests=8)
    stubs = dict(
        draft_worker=_Recorder(calls),
        _draft_worker=_Recorder(calls),
        _hosts_draft=True,
        use_compact_draft_cache=False,
        draft_parallel_layout=SimpleNamespace(tp_group=None),
        model_runner=runner,
        _model_runner=runner,
        _target_worker=SimpleNamespace(get_memory_pool=lambda: (None, None)),
    )
    for name in (
        "init_token_map",
        "init_lm_head",
        "_init_boundary_kv_fix_state",
        "_init_preallocated_tensors",
        "_bind_kv_context",
    ):
        stubs[name] = lambda *a, **k: None
    for name, value in stubs.items():
        try:
            setattr(inst, name, value)
        except AttributeError:  # a read-only property of that worker (UNO's draft_worker)
            pass
    target = MemoryPoolConfig(max_total_num_tokens=4096, max_running_requests=8)
    cls.alloc_memory_pool(
        inst,
        memory_pool_config=target,
        req_to_token_pool=object(),
        token_to_kv_pool_allocator=object(),
    )
    return any(c is target for c in calls)


def _draft_pool_builder(worker_cls):
    """The class that allocates the draft's pool: the worker's own draft-worker class when its
    module defines one (EAGLE family), else the worker itself."""
    import inspect

    from sglang.srt.speculative.base_spec_worker import EagleDraftWorkerBase

    module = inspect.getmodule(worker_cls)
    drafts = [
        c
        for _, c in inspect.getmembers(module, inspect.isclass)
        if issubclass(c, EagleDraftWorkerBase) and c.__module__ == module.__name__
    ]
    assert len(drafts) <= 1, drafts
    return drafts[0] if drafts else worker_cls


def test_family_table_matches_sglang_pool_builders(sglang_kernels_importable, monkeypatch):
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    members = {m.name for m in SpeculativeAlgorithm} - {"NONE"}
    assert not (dk.ALGORITHMS_WITH_DRAFT_POOL & set(dk.FIXED_FAMILIES))
    assert members == dk.ALGORITHMS_WITH_DRAFT_POOL | set(dk.FIXED_FAMILIES), (
        "SGLang's speculative algorithms changed: place each in ALGORITHMS_WITH_DRAFT_POOL "
        "or FIXED_FAMILIES"
    )
    server_args = ServerArgs(model_path="unused")
    for name in sorted(members):
        worker = SpeculativeAlgorithm[name].create_worker(server_args)
        own = _allocates_at_target_size(_draft_pool_builder(worker), monkeypatch)
        assert own == (name in dk.ALGORITHMS_WITH_DRAFT_POOL), (name, worker)
        if own:  # the table then lets an MHA draft of that algorithm own its pool
            assert dk.owns_pool(dk.attention_family(name))
        else:
            assert not dk.owns_pool(dk.attention_family(name, mla=False))


# --- SGLang argparse round trip with the plugin's hooks -------------------------------------


@pytest.fixture
def hooked():
    """dk.register() and the option's patches applied to a clean HookRegistry; SGLang restored
    afterwards."""
    from sglang.srt import server_args as sa_mod
    from sglang.srt.arg_groups import resolution_hooks
    from sglang.srt.model_executor import pool_configurator
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sgl_atom import cli_flags
    from sgl_atom.patches import cli_args, pool_budget, prepare_server_args
    from sgl_atom.speculative import draft_kv_resolution

    originals = [
        (sa_mod.ServerArgs, "add_cli_args"),
        (sa_mod, "prepare_server_args"),
        (pool_configurator, "create_memory_pool_configurator"),
    ]
    saved = [(owner, name, owner.__dict__[name], getattr(owner, name)) for owner, name in originals]
    flags = dict(cli_flags.FLAGS)
    HookRegistry.reset()
    names = dk.register()
    assert dk.register() == names  # idempotent
    for patch in (cli_args, prepare_server_args, pool_budget):  # patches.install() installs them
        patch.install()
    HookRegistry.apply_hooks()
    yield sa_mod
    HookRegistry.reset()
    for owner, name, raw, plain in saved:
        wrapped = getattr(owner, name)
        setattr(owner, name, raw)
        for mod in list(sys.modules.values()):  # bindings the registry propagated
            try:
                stale = mod is not owner and vars(mod).get(name) is wrapped
            except TypeError:
                continue
            if stale:
                setattr(mod, name, plain)
    cli_flags.FLAGS.clear()
    cli_flags.FLAGS.update(flags)
    hooks = resolution_hooks._HOOKS.get(draft_kv_resolution.STEP, [])
    while draft_kv_resolution.settle_draft_kv in hooks:
        hooks.remove(draft_kv_resolution.settle_draft_kv)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Config-only checkpoints: a Llama (MHA) and a DeepSeek-V3 style (MLA) draft."""
    import json

    out = {}
    for name, config in (("llama", _LLAMA), ("mla", _MLA)):
        path = tmp_path_factory.mktemp(name)
        (path / "config.json").write_text(json.dumps(config))
        out[name] = str(path)
    return out


def _argv(ckpt, *extra):
    return ["--model-path", ckpt["llama"], "--kv-cache-dtype", "bf16", *extra]


def _eagle3(draft):
    return (
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        draft,
        "--speculative-num-steps",
        "3",
    )


def _resolve(server_args, final_algorithm=None):
    """Our hook around a stand-in for SGLang's step (which settles the algorithm name)."""
    from sglang.srt.arg_groups.overrides import declare_resolution

    from sgl_atom.speculative.draft_kv_resolution import draft_kv_config, settle_draft_kv

    def previous(sa):
        if final_algorithm:
            declare_resolution(sa, "test", speculative_algorithm=final_algorithm)

    server_args._input_frozen = True  # as during SGLang's resolution
    try:
        settle_draft_kv(server_args, previous)
    finally:
        server_args._input_frozen = False
    return draft_kv_config(server_args)


def test_alias_round_trip_settles_and_reaches_sglangs_field(hooked, ckpt):
    from sglang.srt.arg_groups.overrides import resolving_view

    sa = hooked.prepare_server_args(_argv(ckpt, *_eagle3(ckpt["llama"]), ALIAS_FLAG, "fp8"))
    assert sa._sgl_atom_cli == {dk.ALIAS_DEST: "fp8"}
    cfg = _resolve(sa)
    assert cfg == dk.DraftKVConfig("fp8", "fp8", "bf16", True, "mha")
    assert sa.speculative_draft_kv_cache_dtype is None  # the operator's input is untouched
    assert resolving_view(sa).speculative_draft_kv_cache_dtype == "fp8_e4m3"
    assert pickle.loads(pickle.dumps(sa))._sgl_atom_draft_kv == cfg  # reaches the schedulers


def test_round_trip_omitted_and_sglang_spelling(hooked, ckpt):
    from sglang.srt.arg_groups.overrides import resolving_view

    sa = hooked.prepare_server_args(_argv(ckpt, *_eagle3(ckpt["llama"])))
    assert sa._sgl_atom_cli == {}
    assert _resolve(sa) == dk.DraftKVConfig(None, "bf16", "bf16", True, "mha")
    assert resolving_view(sa).speculative_draft_kv_cache_dtype is None  # SGLang: follows target
    both = (SGLANG_FLAG, "fp8_e4m3", ALIAS_FLAG, "fp8")
    sa = hooked.prepare_server_args(_argv(ckpt, *_eagle3(ckpt["llama"]), *both))
    assert _resolve(sa).settled == "fp8"


def test_round_trip_refusals(hooked, ckpt):
    eagle3 = _eagle3(ckpt["llama"])
    sa = hooked.prepare_server_args(_argv(ckpt, *eagle3, SGLANG_FLAG, "bf16", ALIAS_FLAG, "fp8"))
    with pytest.raises(DraftKVDtypeError, match=f"{SGLANG_FLAG} bf16 and {ALIAS_FLAG} fp8"):
        _resolve(sa)
    sa = hooked.prepare_server_args(_argv(ckpt, ALIAS_FLAG, "fp8"))
    with pytest.raises(DraftKVDtypeError, match="speculative decoding is off"):
        _resolve(sa)
    sa = hooked.prepare_server_args(_argv(ckpt, *_eagle3(ckpt["mla"]), ALIAS_FLAG, "fp8"))
    with pytest.raises(DraftKVDtypeError, match="own KV pool; an MLA draft"):
        _resolve(sa)
    nextn = ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "1")
    sa = hooked.prepare_server_args(_argv(ckpt, *nextn, ALIAS_FLAG, "fp8"))
    with pytest.raises(DraftKVDtypeError, match="own KV pool; an MTP draft"):
        _resolve(sa, final_algorithm="EAGLE")
    with pytest.raises(SystemExit):  # argparse: the alias takes bf16/fp8 only
        hooked.prepare_server_args(_argv(ckpt, *eagle3, ALIAS_FLAG, "fp8_e5m2"))


def test_python_caller_building_server_args_is_refused(hooked, ckpt):
    sa = hooked.ServerArgs(
        model_path=ckpt["llama"],
        speculative_algorithm="EAGLE3",
        speculative_num_steps=3,
        speculative_draft_model_path=ckpt["llama"],
        speculative_draft_kv_cache_dtype="fp8_e5m2",
    )
    with pytest.raises(DraftKVDtypeError, match=f"{SGLANG_FLAG} 'fp8_e5m2'"):
        _resolve(sa)


# --- the draft pool budget -----------------------------------------------------------------


def test_fp8_draft_pool_is_about_half_of_bf16_plus_scales():
    geo = dict(kv_heads=8, head_dim=128, layers=1)
    bf16 = budget.kv_bytes_per_token("bf16", **geo)
    fp8 = budget.kv_bytes_per_token("fp8", **geo)
    assert bf16 == 8 * 256 * 2
    assert fp8 == 8 * 256 + 2 * 8 * 4  # one fp32 scale per (token, KV head) for K and V
    assert 0.5 < fp8 / bf16 < 0.52
    assert budget.kv_bytes_per_token("fp8", kv_heads=3, head_dim=64, layers=5) == 5 * (3 * 128 + 24)


def test_budget_gains_tokens_with_an_fp8_draft():
    target, draft_bf16 = 32 * 4096, 4096
    draft_fp8 = budget.kv_bytes_per_token("fp8", kv_heads=8, head_dim=128)
    b = budget.draft_budget(
        40 << 30,
        target_cell=target,
        draft_cell=draft_fp8,
        upstream_draft_cell=draft_bf16,
        page_size=64,
    )
    assert b.tokens % 64 == 0 and b.tokens_gained > 0
    assert b.tokens == (40 << 30) // (target + draft_fp8) // 64 * 64
    line = budget.budget_line(b, "fp8", "bf16")
    assert "2112 B/token" in line and "GiB" in line and f"+{b.tokens_gained}" in line
    assert "caps" not in line
    capped = budget.budget_line(b, "fp8", "bf16", cap=4096)
    assert capped.startswith(line)
    assert "--max-total-tokens caps the pool at 4096 tokens (8.25 MiB of draft KV)" in capped
    assert budget.budget_line(b, "fp8", "bf16", cap=b.tokens) == line, "a cap that bites nothing"


def test_budget_hook_reprices_an_eagle_draft(monkeypatch, caplog):
    import sglang.srt.runtime_context as rc
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sgl_atom.speculative import draft_kv_pricing as hook

    monkeypatch.setattr(rc, "get_memory", lambda: SimpleNamespace(enable_hisparse=False))
    layer = budget.kv_bytes_per_token("bf16", kv_heads=8, head_dim=128)
    geo = SimpleNamespace(
        get_num_kv_heads=lambda tp: 8,
        head_dim=128,
        v_head_dim=128,
        hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]),
    )
    settled = dk.settle(None, "fp8", "bf16", "EAGLE3", 3, "mha")
    kvc = SimpleNamespace(
        server_args=SimpleNamespace(_sgl_atom_draft_kv=settled),
        spec_algorithm=SpeculativeAlgorithm.EAGLE3,
        is_draft_worker=False,
        spec_aux_config=SimpleNamespace(eagle_draft_num_layers=1, draft_model_config=geo),
        fused_entry_bytes=lambda name: None,
        use_mla_backend=False,
        model_config=geo,
        mambaish_config=None,
        layer_info=SimpleNamespace(num_effective_layers=32),
        draft_attn_tp_size=1,
    )
    conf = DefaultPoolConfigurator.__new__(DefaultPoolConfigurator)
    conf._cell_size, conf._fixed_overhead_bytes = 33 * layer, 0  # upstream: draft at bf16
    conf._compute_cell_size = lambda kvc, n: n * layer
    assert hook.reprice_draft(conf, kvc) is conf
    assert conf._cell_size == 32 * layer + budget.kv_bytes_per_token(
        "fp8", kv_heads=8, head_dim=128
    )
    with caplog.at_level(logging.INFO, logger="sgl_atom"):
        logging.getLogger("sgl_atom").propagate = True
        try:
            config = conf.calculate_pool_sizes(1 << 30, 1)
        finally:
            logging.getLogger("sgl_atom").propagate = False
    assert config.max_total_num_tokens == (1 << 30) // conf._cell_size
    assert "draft KV pool at fp8 (target bf16)" in caplog.text
    same = dataclasses.replace(settled, settled="bf16")
    kvc.server_args._sgl_atom_draft_kv = same  # no difference, nothing to re-price
    assert hook.reprice_draft(conf, kvc) is None
