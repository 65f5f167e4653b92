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
    LedgerEntry(
        module="sgl_atom.patches.cpu_kv_move",
        target="sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._init_kv_copy_and_warmup",
        why=(
            "With speculative decoding the MHA pool warms up sgl_kernel's CPU all-layer KV "
            "copy, an op the CPU sgl_kernel paired with SGLang 0.5.23 lacks, so no speculative "
            "server starts on CPU. The hook switches a CPU pool to SGLang's native torch move "
            "(SGLANG_NATIVE_MOVE_KV_CACHE) and skips the warm-up; applied in CPU mode only."
        ),
        upstream="sglang 0.5.23 srt/mem_cache/memory_pool.py MHATokenToKVPool.__init__",
        remove_when="the CPU sgl_kernel ships copy_all_layer_kv_cache_cpu",
    ),
    LedgerEntry(
        module="sgl_atom.patches.cli_args",
        target="sglang.srt.server_args.ServerArgs.add_cli_args",
        why=(
            "SGLang builds its parser from ServerArgs fields and has no API for a plugin's own "
            "flags. The AFTER hook adds the flags declared with cli_args.add_flag (today "
            "--spec-decode-kv-cache-dtype, the alias of --speculative-draft-kv-cache-dtype)."
        ),
        upstream="sglang 0.5.23 srt/server_args.py ServerArgs.add_cli_args",
        remove_when="SGLang offers an API for plugin CLI flags",
    ),
    LedgerEntry(
        module="sgl_atom.patches.prepare_server_args",
        target="sglang.srt.server_args.prepare_server_args",
        why=(
            "ServerArgs.from_cli_args copies known fields only, so the values of sgl_atom's "
            "flags are dropped. The AFTER hook re-reads them from argv into "
            "server_args._sgl_atom_cli, which survives the pickle to the schedulers."
        ),
        upstream="sglang 0.5.23 srt/server_args.py prepare_server_args / from_cli_args",
        remove_when="SGLang carries plugin flags on ServerArgs",
    ),
    LedgerEntry(
        module="sgl_atom.patches.pool_budget",
        target="sglang.srt.model_executor.pool_configurator.create_memory_pool_configurator",
        why=(
            "The atom backend's fp8 KV keeps fp32 scales per token and KV head that SGLang's "
            "cell size does not count: the first AFTER hook adds them, so the pool fits the "
            "memory budget. "
            "DefaultPoolConfigurator reserves an EAGLE/STANDALONE draft's layers at the "
            "target's bytes per token whatever the draft's KV dtype, so an fp8 draft under a "
            "bf16 target gets fewer KV tokens than fit. The AFTER hook re-prices the draft term "
            "at the settled draft dtype and logs the draft pool's bytes and tokens gained."
        ),
        upstream=(
            "sglang 0.5.23 srt/model_executor/pool_configurator.py DefaultPoolConfigurator."
            "__init__ (EAGLE/STANDALONE draft_kv_size); HybridSWAPoolConfigurator ~736-810"
        ),
        remove_when="SGLang prices EAGLE/STANDALONE drafts with the draft's KV dtype",
    ),
    LedgerEntry(
        module="sgl_atom.patches.disagg_backend_enum",
        target="sglang.srt.disaggregation.utils.TransferBackend._missing_",
        why=(
            "--disaggregation-transfer-backend values become TransferBackend(value), a closed "
            "Enum with no registration API. The AROUND hook on Enum's lookup of last resort "
            "answers 'atom' with one pseudo-member and leaves every other value to the original."
        ),
        upstream="sglang 0.5.23 srt/disaggregation/utils.py TransferBackend",
        remove_when="SGLang lets a plugin register a transfer backend value",
    ),
    LedgerEntry(
        module="sgl_atom.patches.disagg_kv_class",
        target="sglang.srt.disaggregation.utils.get_kv_class",
        why=(
            "SGLang picks a backend's KV manager/sender/receiver/bootstrap server in an if/elif "
            "chain. The AROUND hook answers the atom backend's classes and passes every other "
            "backend (and KVARGS) to the original."
        ),
        upstream="sglang 0.5.23 srt/disaggregation/utils.py get_kv_class",
        remove_when="SGLang offers a transfer-backend class registry",
    ),
    LedgerEntry(
        module="sgl_atom.patches.disagg_pool_registry",
        target="sglang.srt.disaggregation.utils.get_kv_transfer_buf_infos",
        why=(
            "A transfer backend's KV manager gets raw pointers, not the pool; the atom backend "
            "describes regions from the live pool (dtype, heads, head dim, fp8 scale buffers). "
            "The AFTER hook records the pool under its first buffer pointer; the result is "
            "returned unchanged."
        ),
        upstream=(
            "sglang 0.5.23 srt/disaggregation/prefill.py and decode.py _init_kv_manager "
            "(KVArgs carries pointers only)"
        ),
        remove_when="KVArgs (or the manager's constructor) carries the KV pool",
    ),
    LedgerEntry(
        module="sgl_atom.patches.pp_spec_compat",
        target="sglang.srt.arg_groups.validation_hook.check_pipeline_parallel_compat",
        why=(
            "Under --pp-size > 1 SGLang asserts the speculative algorithm is its DSPARK or "
            "EAGLE, so ATOM_DSPARK on a PP prefill server fails start-up. The AROUND hook runs "
            "the original with the algorithm hidden for ATOM_DSPARK (the other PP checks still "
            "run); its own PP rules are in AtomDSparkAlgo.handle_server_args."
        ),
        upstream="sglang 0.5.23 srt/arg_groups/validation_hook.py check_pipeline_parallel_compat",
        remove_when="SGLang asks a registered speculative algorithm whether it supports PP",
    ),
    LedgerEntry(
        module="sgl_atom.patches.m3_atom_unwrapped",
        target="sglang.srt.layers.attention.attention_registry.attn_backend_wrapper",
        why=(
            "For MiniMax-M3 architectures SGLang wraps every attention backend in "
            "MiniMaxHybridAttnBackend with its own MiniMaxSparseAttnBackend, built and fed "
            "metadata every step. sgl_atom's M3 class runs sparse layers through the atom "
            "backend's forward_sparse, so for that model on atom the AROUND hook returns the "
            "atom backend unwrapped; other models and SGLang's M3 class are wrapped as before."
        ),
        upstream="sglang 0.5.23 srt/layers/attention/attention_registry.py attn_backend_wrapper",
        remove_when="SGLang lets a model or backend opt out of the MiniMax sparse wrapper",
    ),
    LedgerEntry(
        module="sgl_atom.patches.request_checks",
        target="sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        why=(
            "In SGLang 0.5.23 one request can crash the whole server: input ids outside the "
            "vocabulary, an empty prompt on a tokenizer without BOS, top_logprobs_num above the "
            "vocabulary. The BEFORE hook raises ValueError naming the field (HTTP 400) before the "
            "request reaches a scheduler; SGL_ATOM_REQUEST_CHECKS=off turns it off."
        ),
        upstream="sglang 0.5.23 srt/managers/tokenizer_manager.py _validate_one_request",
        remove_when="SGLang validates token ids, empty prompts and top_logprobs_num itself",
    ),
)
