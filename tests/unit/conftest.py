"""Unit tests run on CPU; Triton kernels run in Triton's interpreter when no CUDA device exists.

TRITON_INTERPRET must be set before triton is first imported (sglang imports it too), and
SGLang's CPU engine before sglang is, so both are set up here, before any unit test module is
collected.
"""

import os
import pkgutil
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    # SGLang runs here as in the CPU servers (its layers built in-process, the DSpark draft's,
    # take the CPU as their device): the CPU engine (read when sglang is first imported), the
    # no-device libcuda its kernel package links against, loaded before anything imports it,
    # and the speculative ops CPU mode adds
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    import ctypes

    from sgl_atom import cpu_spec_ops
    from sgl_atom.cpu_mode import SHIM_NAME, build_shim

    ctypes.CDLL(str(build_shim() / SHIM_NAME), mode=ctypes.RTLD_GLOBAL)
    cpu_spec_ops.install()


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for the module (float64 reference loops: steadier on a shared host)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def owner_and_raw(target: str):
    """The owner of a dotted target, the attribute name, and the raw (undescribed) value."""
    owner_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    raw = owner.__dict__[attr] if attr in getattr(owner, "__dict__", {}) else getattr(owner, attr)
    return owner, attr, raw


@pytest.fixture
def fresh_registry(monkeypatch):
    """A clean HookRegistry and a not-yet-registered plugin; every ledger target of SGLang is
    restored afterwards (also where HookRegistry propagated a patch into other modules)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    import sgl_atom.patches as patches_pkg
    from sgl_atom import plugin

    saved = [owner_and_raw(e.target) for e in patches_pkg.LEDGER]
    before = [getattr(owner, attr) for owner, attr, _ in saved]
    HookRegistry.reset()
    monkeypatch.setattr(plugin, "_registered", None)
    monkeypatch.setenv("SGL_ATOM_CPU_MODE", "on")
    yield HookRegistry
    HookRegistry.reset()
    for (owner, attr, raw), original in zip(saved, before, strict=True):
        patched = getattr(owner, attr)
        setattr(owner, attr, raw)
        if patched is not original:
            for mod in list(sys.modules.values()):
                for name, value in list(getattr(mod, "__dict__", {}).items()):
                    if value is patched:
                        setattr(mod, name, original)


@pytest.fixture
def resolve_target():
    """:func:`owner_and_raw` for tests: ``(owner, attr, raw value)`` of a dotted target."""
    return owner_and_raw
