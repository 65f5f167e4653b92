"""Monkey-patches of SGLang internals, one module per target, each with a ledger entry.

We register through SGLang's own APIs first; a module here exists only where SGLang offers no
API. Every patch is applied through SGLang's ``HookRegistry`` (so it is idempotent and keeps the
original), is listed in :data:`LEDGER`, and has a test in ``tests/unit/test_patches.py``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LedgerEntry:
    module: str  # sgl_atom.patches.<module>
    target: str  # dotted path of what is patched in SGLang
    why: str
    upstream: str  # where upstream the behaviour lives
    remove_when: str


LEDGER: tuple[LedgerEntry, ...] = (
    LedgerEntry(
        module="sgl_atom.patches.cpu_gloo_groups",
        target="sglang.srt.distributed.parallel_state.init_model_parallel_group",
        why=(
            "On CPU (gloo backend) SGLang still turns PyNccl on for model-parallel groups, so "
            "--tp/--pp-size > 1 fails with 'Expected a cuda device, but got: cpu'. The hook "
            "passes use_pynccl=False when the group's backend is gloo; applied in CPU mode only."
        ),
        upstream="sglang 0.5.23 srt/distributed/parallel_state.py init_model_parallel_group",
        remove_when="SGLang stops enabling PyNccl for gloo groups",
    ),
    LedgerEntry(
        module="sgl_atom.patches.cpu_fp8_kv",
        target="sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.configure",
        why=(
            "SGLang refuses fp8 KV on CPU unless Intel AMX and the intel_amx backend serve it. "
            "When every attention backend is atom (which reads fp8 with its own kernels) the "
            "gate is answered for it during configure(); applied in CPU mode only."
        ),
        upstream="sglang 0.5.23 srt/mem_cache/kv_cache_configurator.py configure()",
        remove_when="SGLang asks the attention backend whether it reads fp8 KV on CPU",
    ),
)
