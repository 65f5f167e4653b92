"""CPU mode: let the atom backend serve ``--kv-cache-dtype fp8_e4m3``.

SGLang 0.5.23 refuses fp8 KV on CPU unless the host has Intel AMX and every attention backend
is ``intel_amx``, because only its CPU kernels read fp8 there. The atom backend reads fp8 KV
with its own kernels (Triton's interpreter on CPU), so when every configured attention backend
is ``atom`` the check is answered for it; any other combination is checked by SGLang as before.
Ledger: ``sgl_atom.patches.LEDGER``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import register_once

TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.configure"
_MODULE = "sglang.srt.mem_cache.kv_cache_configurator"


def only_atom_backends(backends) -> bool:
    names = {b for b in backends if b is not None}
    return bool(names) and names <= {"atom"}


def configure_with_atom_fp8(original: Callable[..., Any], self, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook: pass SGLang's CPU fp8 gate when the atom backend serves every mode."""
    import importlib

    mod = importlib.import_module(_MODULE)
    backends = mod.attention_backends
    if not only_atom_backends(backends()):
        return original(self, *args, **kwargs)
    saved = mod.cpu_has_amx_support, mod.attention_backends
    mod.cpu_has_amx_support = lambda: True
    mod.attention_backends = lambda: ["intel_amx" if b == "atom" else b for b in backends()]
    try:
        return original(self, *args, **kwargs)
    finally:
        mod.cpu_has_amx_support, mod.attention_backends = saved


def install() -> None:
    register_once(TARGET, configure_with_atom_fp8, "around")
