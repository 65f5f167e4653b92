"""The entry point, register(), and the patch ledger."""

from __future__ import annotations

import importlib
import pkgutil
from importlib.metadata import entry_points

import pytest

import sgl_atom.patches as patches_pkg
from sgl_atom import plugin


def test_entry_point_resolves_to_register():
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "sgl_atom"]
    assert len(eps) == 1, "sgl_atom must be installed with exactly one sglang.srt.plugins entry"
    assert eps[0].load() is plugin.register


def test_register_twice_is_a_no_op(fresh_registry):
    first = plugin.register()
    hooks_after_first = {k: list(v) for k, v in fresh_registry._hooks.items()}
    second = plugin.register()
    assert first == second and "patch:cpu_gloo_groups" in first
    assert {k: list(v) for k, v in fresh_registry._hooks.items()} == hooks_after_first


def test_register_applies_no_cpu_patch_with_a_gpu(fresh_registry, monkeypatch):
    monkeypatch.setenv("SGL_ATOM_CPU_MODE", "off")
    names = plugin.register()
    assert "patch:cpu_gloo_groups" not in names and "patch:cpu_fp8_kv" not in names
    from sgl_atom.patches import cpu_fp8_kv, cpu_gloo_groups

    assert cpu_gloo_groups.TARGET not in fresh_registry._hooks
    assert cpu_fp8_kv.TARGET not in fresh_registry._hooks


def _patch_modules() -> set[str]:
    return {f"{patches_pkg.__name__}.{m.name}" for m in pkgutil.iter_modules(patches_pkg.__path__)}


def test_every_patch_module_has_a_ledger_entry():
    ledger = {e.module for e in patches_pkg.LEDGER}
    assert _patch_modules() == ledger
    for entry in patches_pkg.LEDGER:
        mod = importlib.import_module(entry.module)
        assert mod.TARGET == entry.target
        assert entry.why and entry.upstream and entry.remove_when
        # the target still exists in the pinned SGLang
        owner, attr = entry.target.rsplit(".", 1)
        assert hasattr(pkgutil.resolve_name(owner), attr), entry.target


@pytest.mark.parametrize("entry", patches_pkg.LEDGER, ids=lambda e: e.module.rsplit(".", 1)[1])
def test_every_patch_wraps_and_keeps_its_original(fresh_registry, resolve_target, entry):
    owner, attr, _ = resolve_target(entry.target)
    original = getattr(owner, attr)
    plugin.register()
    fresh_registry.apply_hooks()
    fresh_registry.apply_hooks()  # a second apply must not wrap twice
    patched = getattr(owner, attr)
    assert patched is not original, f"{entry.target} was not patched"
    # one wrapper per registered hook, whatever the number of applies, ending at the original
    inner = patched
    for _ in fresh_registry._hooks[entry.target]:
        inner = inner.__wrapped__
    # a method reached through its class (Enum._missing_) is a fresh bound method per lookup
    same = getattr(inner, "__func__", inner) is getattr(original, "__func__", original)
    assert same, f"{entry.target} lost its original or was wrapped twice"


def test_gloo_hook_forces_pynccl_off_for_gloo_only():
    from sgl_atom.patches.cpu_gloo_groups import gloo_groups_without_pynccl

    def fake(group_ranks, local_rank, backend, use_pynccl=None, group_name=None):
        return backend, use_pynccl, group_name

    assert gloo_groups_without_pynccl(fake, [[0, 1]], 0, "gloo") == ("gloo", False, None)
    assert gloo_groups_without_pynccl(fake, [[0]], 0, backend="gloo", group_name="tp") == (
        "gloo",
        False,
        "tp",
    )
    assert gloo_groups_without_pynccl(fake, [[0]], 0, "nccl") == ("nccl", None, None)
    assert gloo_groups_without_pynccl(fake, [[0]], 0, "nccl", True) == ("nccl", True, None)
