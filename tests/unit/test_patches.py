"""The patch machinery: one install(), register_once(), the applied-hooks check, the ledger's
cited tests and README table, and the private SGLang names the code relies on."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import pickle
import pkgutil
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import sgl_atom.patches as patches
from sgl_atom import plugin

ROOT = Path(__file__).resolve().parents[2]


def _ours(registry, target):
    return [h for _, h, _ in registry._hooks.get(target, [])]


def test_register_once_registers_a_hook_once(fresh_registry):
    from sgl_atom.patches import request_checks

    for _ in range(3):
        patches.register_once(request_checks.TARGET, request_checks.validate_before, "before")
    assert _ours(fresh_registry, request_checks.TARGET) == [request_checks.validate_before]
    with pytest.raises(AssertionError, match="hook kind"):
        patches.register_once(request_checks.TARGET, request_checks.validate_before, "BEFORE")


@pytest.mark.parametrize("cpu_mode", ["on", "off"])
def test_plain_register_installs_the_fp8_pool_budget_hook(fresh_registry, monkeypatch, cpu_mode):
    from sgl_atom.patches import pool_budget

    monkeypatch.setenv("SGL_ATOM_CPU_MODE", cpu_mode)
    plugin.register()
    assert _ours(fresh_registry, pool_budget.TARGET) == [pool_budget.price_sgl_atom_pools]


def test_pool_budget_hook_prices_atom_fp8_scales_without_speculation(monkeypatch):
    import sglang.srt.runtime_context as rc

    from sgl_atom.patches import pool_budget

    monkeypatch.setattr(rc, "attention_backends", lambda: ["atom"])
    monkeypatch.setattr(rc, "get_parallel", lambda: SimpleNamespace(attn_tp_size=1))
    kvc = SimpleNamespace(
        kv_cache_dtype=torch.float8_e4m3fn,
        use_mla_backend=False,
        mambaish_config=None,
        layer_info=SimpleNamespace(num_effective_layers=3),
        model_config=SimpleNamespace(get_num_kv_heads=lambda tp: 2),
        server_args=SimpleNamespace(),  # no draft KV dtype settled: no speculation
        spec_algorithm=SimpleNamespace(name=None),
        is_draft_worker=False,
    )
    conf = SimpleNamespace(_cell_size=1000)
    assert pool_budget.price_sgl_atom_pools(conf, kvc) is None  # the result is unchanged
    assert conf._cell_size == 1000 + 2 * 4 * 2 * 3  # K and V fp32 scales per head and layer


def test_install_is_the_only_place_that_registers_hooks():
    src = ROOT / "sgl_atom"
    offenders = [
        str(p.relative_to(ROOT))
        for p in src.rglob("*.py")
        if "HookRegistry.register(" in p.read_text() and p != src / "patches" / "__init__.py"
    ]
    assert offenders == []
    callers = [
        str(p.relative_to(ROOT))
        for p in src.rglob("*.py")
        if re.search(r"\bpatches\.install\(\)|\b[a-z_]+\.install\(\)", p.read_text())
        and "patches" not in p.parts
    ]
    # the plugin calls patches.install(); the others install no HookRegistry hook
    assert sorted(callers) == ["sgl_atom/plugin.py", "sgl_atom/speculative/draft_kv_dtype.py"]


# --- hooks SGLang did not apply fail start-up -----------------------------------------------


def test_every_registered_hook_is_verified_after_apply(fresh_registry):
    plugin.register()
    fresh_registry.apply_hooks()
    targets = patches.verify_applied()
    registered = {e.target for e in patches.LEDGER if patches.applies(e)}
    assert set(targets) == registered


def test_a_hook_sglang_failed_to_apply_fails_start_up_naming_it(fresh_registry):
    from sgl_atom.patches import hooks_applied, pool_budget

    plugin.register()
    bogus = "sglang.srt.no_such_module.create_memory_pool_configurator"
    patches.register_once(bogus, pool_budget.price_sgl_atom_pools, "after")
    fresh_registry.apply_hooks()  # SGLang logs the failure and carries on
    with pytest.raises(patches.HooksNotApplied, match=re.escape(bogus)) as e:
        hooks_applied.check_hooks_applied(None, role="scheduler")
    assert pool_budget.TARGET not in str(e.value)


def test_unapplied_ledger_target_is_named_with_its_module(fresh_registry):
    from sgl_atom.patches import request_checks

    request_checks.install()  # registered, never applied
    with pytest.raises(patches.HooksNotApplied, match="sgl_atom.patches.request_checks"):
        patches.verify_applied()


def test_publish_follows_load_plugins_in_every_sglang_process():
    """The check runs in a BEFORE hook on publish(): every process that loads the plugin
    must call publish() after load_plugins()."""
    from sglang.srt.entrypoints import engine
    from sglang.srt.managers import data_parallel_controller, detokenizer_manager, scheduler

    for fn in (
        scheduler.run_scheduler_process,
        detokenizer_manager.run_detokenizer_process,
        data_parallel_controller.run_data_parallel_controller_process,
        engine.Engine._launch_subprocesses,
    ):
        src = inspect.getsource(fn)
        assert "load_plugins()" in src and "publish(" in src, fn.__qualname__
        assert src.index("load_plugins()") < src.index("publish("), fn.__qualname__


# --- the ledger ----------------------------------------------------------------------------


@pytest.mark.parametrize("entry", patches.LEDGER, ids=lambda e: e.module.rsplit(".", 1)[1])
def test_ledger_entry_is_complete_and_cites_tests_that_exist(entry):
    assert entry.upstream_change and entry.remove_when and entry.why and entry.upstream
    assert entry.applies in (patches.ALWAYS, patches.CPU_MODE, patches.REQUEST_CHECKS)
    assert entry.tests, f"{entry.module} cites no test"
    for path in entry.tests:
        assert (ROOT / path).is_file(), f"{entry.module} cites {path}, which does not exist"


def test_readme_ledger_lists_every_patch():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Monkey-patch ledger", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z0-9_]+)` \|", section, flags=re.M)
    assert sorted(rows) == sorted(e.module.rsplit(".", 1)[1] for e in patches.LEDGER)
    for entry in patches.LEDGER:
        assert entry.target in section, entry.target


# --- private SGLang names --------------------------------------------------------------------


def _class_source(dotted: str) -> str:
    """The source of an SGLang class, read from its file without importing it (importing
    ``sglang.srt.speculative.ngram_worker`` needs a CUDA driver)."""
    module, name = dotted.rsplit(".", 1)
    text = Path(importlib.util.find_spec(module).origin).read_text()
    tree = ast.parse(text)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    return ast.get_source_segment(text, node)


@pytest.mark.parametrize("p", patches.PRIVATE_NAMES, ids=lambda p: p.name.split(".", 3)[-1])
def test_private_name_is_where_the_code_expects_it(p):
    owner, attr = p.name.rsplit(".", 1)
    if p.kind == "class attribute":
        assert hasattr(pkgutil.resolve_name(owner), attr), f"{p.name} moved (used by {p.used_by})"
    elif p.kind == "module global":
        try:
            found = hasattr(importlib.import_module(owner), attr)
        except ImportError:  # a module that needs a CUDA driver: its top-level assignment
            text = Path(importlib.util.find_spec(owner).origin).read_text()  # or function
            name = re.escape(attr)
            found = bool(re.search(rf"^({name}\s*(:[^=\n]*)?=[^=]|def {name}\()", text, re.M))
        assert found, f"{p.name} moved (used by {p.used_by})"
    elif p.kind == "method":
        assert f"def {attr}(" in _class_source(owner), f"{p.name} moved (used by {p.used_by})"
    elif p.kind == "instance attribute":
        assigned = re.compile(rf"self\.{re.escape(attr)}\s*(:[^=\n]*)?=[^=]")
        assert assigned.search(_class_source(owner)), f"{p.name} is no longer set ({p.used_by})"
    else:
        assert p.kind == "set by sgl_atom", p.kind
        cls = pkgutil.resolve_name(owner)
        assert not hasattr(cls, attr), f"SGLang now defines {p.name} itself"
        assert attr not in Path(inspect.getfile(cls)).read_text(), f"SGLang now uses {attr}"


def test_ngram_verify_builds_its_full_mask_only_under_the_global_the_worker_turns_off():
    """The DSpark worker skips the n-gram path's per-request CUDA mask by clearing
    ``USE_FULL_MASK`` around ``_prepare_for_speculative_decoding``: that only works while the
    method reads the global at call time to decide."""
    src = _class_source("sglang.srt.speculative.ngram_worker.NGRAMWorker")
    verify = src[src.index("def _prepare_for_speculative_decoding(") :].split("\n    def ", 1)[0]
    gates = re.findall(r"if USE_FULL_MASK and not _is_cpu:", verify)
    assert len(gates) == 2, "the n-gram verify no longer gates its full mask on USE_FULL_MASK"
    worker = Path(importlib.util.find_spec("sgl_atom.speculative.dspark.worker").origin)
    assert "ngram_worker.USE_FULL_MASK = False" in worker.read_text()


def test_ngram_verify_calls_the_overridden_draft_token_hook():
    src = _class_source("sglang.srt.speculative.ngram_worker.NGRAMWorker")
    verify = src[src.index("def _prepare_for_speculative_decoding(") :]
    assert "self._prepare_draft_tokens(batch)" in verify.split("\n    def ", 1)[0]


def test_underscore_attributes_on_server_args_survive_the_pickle_to_schedulers():
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path="/nonexistent")
    names = [p.name.rsplit(".", 1)[1] for p in patches.PRIVATE_NAMES if ".ServerArgs._" in p.name]
    assert names
    for i, name in enumerate(names):
        setattr(sa, name, {"value": i})
    copy = pickle.loads(pickle.dumps(sa))
    assert [getattr(copy, n) for n in names] == [{"value": i} for i in range(len(names))]
