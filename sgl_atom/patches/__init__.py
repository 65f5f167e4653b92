"""Monkey-patches of SGLang internals, one module per target, each with a ledger entry.

We register through SGLang's own APIs first; a module here exists only where SGLang offers no
API. Every patch is applied through SGLang's ``HookRegistry`` (so it keeps the original), is
registered once (:func:`register_once`), is listed in :data:`LEDGER` with the tests that cover
it, and is installed by :func:`install`, which the plugin's ``register()`` calls: nothing else
installs a hook. SGLang applies the hooks after every plugin ran and only logs a hook that
failed to apply, so ``hooks_applied`` checks, in every SGLang process, that each target
sgl_atom hooked is wrapped, and fails start-up naming the target (:func:`verify_applied`).

:data:`PRIVATE_NAMES` lists the other private SGLang names the code relies on (and the
attributes it sets on SGLang objects); ``tests/unit/test_patches.py`` fails when one moves.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

HOOK_KINDS = ("before", "after", "around", "replace")  # SGLang's HookType values
ALWAYS, CPU_MODE, REQUEST_CHECKS = "always", "CPU mode", "SGL_ATOM_REQUEST_CHECKS on"


@dataclass(frozen=True)
class LedgerEntry:
    module: str  # sgl_atom.patches.<module>
    target: str  # dotted path of what is patched in SGLang
    why: str
    upstream: str  # where upstream the behaviour lives
    upstream_change: str  # the upstream PR/issue that would let the patch go ("none filed: ...")
    remove_when: str
    tests: tuple[str, ...]  # test files (from the repository root) that cover the patch
    applies: str = ALWAYS  # ALWAYS, CPU_MODE or REQUEST_CHECKS


@dataclass(frozen=True)
class PrivateName:
    name: str  # dotted: module[.Class].attr
    kind: (
        str  # "method", "class attribute", "instance attribute", "module global", "set by sgl_atom"
    )
    used_by: str  # sgl_atom modules that rely on it
    why: str


class HooksNotApplied(RuntimeError):
    """SGLang did not apply a hook sgl_atom registered; the message names the target."""


def register_once(target: str, hook: Callable, kind: str) -> None:
    """Register ``hook`` on ``target`` with SGLang's HookRegistry unless it already is there."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    assert kind in HOOK_KINDS, f"hook kind {kind!r} is not one of {HOOK_KINDS}"
    if any(h is hook for _, h, _ in HookRegistry._hooks.get(target, [])):
        return
    HookRegistry.register(target, hook, HookType(kind))


def applies(entry: LedgerEntry) -> bool:
    """Whether the patch is installed in this process."""
    from .. import cpu_mode, envs

    if entry.applies == CPU_MODE:
        return cpu_mode.cpu_mode_enabled()
    if entry.applies == REQUEST_CHECKS:
        return bool(envs.SGL_ATOM_REQUEST_CHECKS.get())
    assert entry.applies == ALWAYS, entry.applies
    return True


def install() -> list[str]:
    """Register every ledger patch that applies here (idempotent); returns ``patch:<module>``
    names for the plugin's log line."""
    names = []
    for entry in LEDGER:
        if applies(entry):
            importlib.import_module(entry.module).install()
            names.append("patch:" + entry.module.rsplit(".", 1)[1])
    return names


def _is_wrapped(target: str) -> bool:
    owner, attr = target.rsplit(".", 1)
    try:
        value = getattr(pkgutil.resolve_name(owner), attr)
    except (ImportError, AttributeError, ValueError):
        return False
    return hasattr(value, "__wrapped__")  # HookRegistry's wrappers keep the original there


def verify_applied() -> list[str]:
    """The targets sgl_atom hooked in this process, after SGLang applied the hooks; raises
    :class:`HooksNotApplied` naming each one SGLang did not wrap."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    modules = {e.target: e.module for e in LEDGER}
    ours = [
        target
        for target, hooks in HookRegistry._hooks.items()
        if any(getattr(h, "__module__", "").startswith(__name__ + ".") for _, h, _ in hooks)
    ]
    missing = [t for t in ours if t not in HookRegistry._patched or not _is_wrapped(t)]
    if missing:
        raise HooksNotApplied(
            "sgl_atom: SGLang did not apply the hook on "
            + ", ".join(f"{t} ({modules.get(t, 'not in the ledger')})" for t in missing)
            + "; sgl_atom cannot serve without it. SGLang's log says why ('Failed to apply "
            "hooks to ...'); check that sglang==0.5.23 is installed."
        )
    return ours


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
        upstream_change="none filed: use_pynccl=False for gloo groups in init_model_parallel_group",
        tests=("tests/unit/test_plugin.py", "tests/e2e/test_parity.py"),
        applies=CPU_MODE,
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
        upstream_change="none filed: ask the attention backend whether it reads fp8 KV on CPU",
        tests=("tests/unit/test_plugin.py", "tests/e2e/test_atom_serving.py"),
        applies=CPU_MODE,
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
        upstream_change=(
            "none filed: ship copy_all_layer_kv_cache_cpu in the CPU sgl_kernel, or fall back "
            "to the native move when the op is missing"
        ),
        tests=("tests/unit/test_plugin.py", "tests/e2e/test_dspark_serving.py"),
        applies=CPU_MODE,
    ),
    LedgerEntry(
        module="sgl_atom.patches.cli_args",
        target="sglang.srt.server_args.ServerArgs.add_cli_args",
        why=(
            "SGLang builds its parser from ServerArgs fields and has no API for a plugin's own "
            "flags. The AFTER hook adds the flags declared with cli_flags.add_flag (today "
            "--spec-decode-kv-cache-dtype, the alias of --speculative-draft-kv-cache-dtype)."
        ),
        upstream="sglang 0.5.23 srt/server_args.py ServerArgs.add_cli_args",
        remove_when="SGLang offers an API for plugin CLI flags",
        upstream_change="none filed: a plugin API for CLI flags",
        tests=("tests/unit/test_plugin.py", "tests/unit/test_draft_kv_dtype.py"),
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
        upstream_change="none filed: plugin flags carried on ServerArgs",
        tests=("tests/unit/test_plugin.py", "tests/unit/test_draft_kv_dtype.py"),
    ),
    LedgerEntry(
        module="sgl_atom.patches.pool_budget",
        target="sglang.srt.model_executor.pool_configurator.create_memory_pool_configurator",
        why=(
            "The atom backend's fp8 KV keeps fp32 scales per token and KV head that SGLang's "
            "cell size does not count, so the pool would not fit the memory budget. "
            "DefaultPoolConfigurator reserves an EAGLE/STANDALONE draft's layers at the "
            "target's bytes per token whatever the draft's KV dtype, so an fp8 draft under a "
            "bf16 target gets fewer KV tokens than fit; the ATOM_DSPARK draft pool is unknown "
            "to SGLang. One AFTER hook calls the features that own those bytes "
            "(attention.kv_scales, speculative.draft_kv_pricing), which add or re-price them."
        ),
        upstream=(
            "sglang 0.5.23 srt/model_executor/pool_configurator.py DefaultPoolConfigurator."
            "__init__ (EAGLE/STANDALONE draft_kv_size); HybridSWAPoolConfigurator ~736-810"
        ),
        remove_when=(
            "SGLang prices EAGLE/STANDALONE drafts with the draft's KV dtype and lets a "
            "backend (fp8 scales) and an algorithm (its own draft pool) add bytes per token"
        ),
        upstream_change=(
            "none filed: price EAGLE/STANDALONE drafts at the draft KV dtype, and let an "
            "attention backend or a speculative algorithm add bytes per token"
        ),
        tests=(
            "tests/unit/test_patches.py",
            "tests/unit/test_atom_backend.py",
            "tests/unit/test_draft_kv_dtype.py",
            "tests/e2e/test_dspark_serving.py",
        ),
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
        upstream_change="none filed: a transfer-backend registry (value and classes)",
        tests=("tests/unit/test_plugin.py", "tests/unit/test_disagg_backend.py"),
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
        upstream_change="none filed: a transfer-backend registry (value and classes)",
        tests=("tests/unit/test_plugin.py", "tests/unit/test_disagg_backend.py"),
    ),
    LedgerEntry(
        module="sgl_atom.patches.dspark_graph_capture",
        target=(
            "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
            ".get_spec_info"
        ),
        why=(
            "ATOM_DSPARK verifies through SGLang's n-gram path, whose decode CUDA graphs are "
            "captured with CaptureHiddenMode.NULL; its verify forward needs FULL (the draft "
            "writes context K/V from the target's tapped layers), so the first replay failed "
            "('runtime hidden-state mode exceeds the fixed CUDA graph capture mode'). The AFTER "
            "hook sets FULL on the captured verify input of an ATOM_DSPARK target runner only."
        ),
        upstream=(
            "sglang 0.5.23 srt/model_executor/runner/decode_cuda_graph_runner.py get_spec_info "
            "(capture mode per built-in algorithm)"
        ),
        remove_when="SGLang asks a custom speculative algorithm which hidden states to capture",
        upstream_change=(
            "none filed: a CustomSpecAlgo method for the target-verify graph's capture mode"
        ),
        tests=("tests/unit/test_dspark_graph_capture.py", "tests/gpu/test_server_tier.py"),
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
        upstream_change="none filed: KVArgs carrying the KV pool",
        tests=("tests/unit/test_plugin.py", "tests/unit/test_disagg_backend.py"),
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
        upstream_change=(
            "none filed for a registered algorithm's say; related demand: sgl-project/sglang "
            "#37154, #23162 (PP prefill + speculative decode)"
        ),
        tests=("tests/unit/test_plugin.py", "tests/unit/test_dspark_pp.py"),
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
        upstream_change="none filed: a model or backend opt-out of the MiniMax sparse wrapper",
        tests=(
            "tests/unit/test_plugin.py",
            "tests/unit/test_m3_serving_config.py",
            "tests/e2e/test_m3_serving.py",
        ),
    ),
    LedgerEntry(
        module="sgl_atom.patches.m3_index_pool_build",
        target=(
            "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator."
            "_build_minimax_sparse_kv_pool"
        ),
        why=(
            "SGLang builds a MiniMax-M3 pool with index-key pools that only its own MiniMax "
            "sparse backend reads. For sgl_atom's M3 model on the atom backend (which keeps its "
            "own index cache) the AROUND hook marks the build (a context variable) so that "
            "m3_index_pool leaves those pools out; the pool budget prices the atom index cache "
            "in their place (attention/m3_index_pool.price_atom_index_cache)."
        ),
        upstream=(
            "sglang 0.5.23 srt/mem_cache/kv_cache_configurator.py _build_minimax_sparse_kv_pool"
        ),
        remove_when="SGLang lets an attention backend that keeps its own index cache opt out of "
        "the M3 index pools (and their budget)",
        upstream_change="none filed: an opt-out of MiniMaxSparseKVPool's index pools",
        tests=("tests/unit/test_m3_index_pool.py", "tests/e2e/test_m3_serving.py"),
    ),
    LedgerEntry(
        module="sgl_atom.patches.m3_index_pool",
        target="sglang.srt.mem_cache.memory_pool.MiniMaxSparseKVPool.__init__",
        why=(
            "Inside a build m3_index_pool_build marked, the pool gets index pool classes that "
            "allocate nothing (index_k_pool/index_kv_pool None, which SGLang already handles), "
            "so an M3 model served on atom holds one index cache, not two."
        ),
        upstream="sglang 0.5.23 srt/mem_cache/memory_pool.py MiniMaxSparseKVPool",
        remove_when="as m3_index_pool_build",
        upstream_change="none filed: an opt-out of MiniMaxSparseKVPool's index pools",
        tests=("tests/unit/test_m3_index_pool.py", "tests/e2e/test_m3_serving.py"),
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
        upstream_change=(
            "none filed (proposed in the README's known issues: check token ids, empty "
            "prompts and top_logprobs_num in _validate_one_request)"
        ),
        tests=(
            "tests/unit/test_plugin.py",
            "tests/unit/test_request_checks.py",
            "tests/e2e/test_api.py",
        ),
        applies=REQUEST_CHECKS,
    ),
    LedgerEntry(
        module="sgl_atom.patches.hooks_applied",
        target="sglang.srt.runtime_context.publish",
        why=(
            "SGLang applies plugin hooks after every plugin ran and only logs a hook that "
            "failed to apply, so a server would run without a patch it needs. Every SGLang "
            "process (launcher/tokenizer, scheduler, detokenizer, DP controller) calls "
            "publish() right after load_plugins(); the BEFORE hook checks that each target "
            "sgl_atom hooked is wrapped and fails start-up naming the target if not."
        ),
        upstream="sglang 0.5.23 srt/plugins/__init__.py load_plugins (logs, carries on)",
        upstream_change="none filed: let a plugin ask load_plugins to fail on a hook that fails",
        remove_when="SGLang fails start-up (or reports to the plugin) when a hook fails to apply",
        tests=("tests/unit/test_patches.py", "tests/e2e/test_api.py"),
    ),
)

_NGRAM = "sglang.srt.speculative.ngram_worker.NGRAMWorker"
_NGRAM_WHY = (
    "AtomDSparkWorker subclasses NGRAMWorker for SGLang's chain/tree verify but skips its "
    "__init__ (the n-gram corpus), so it sets the attributes NGRAMWorker's methods read"
)
_CONFIGURATOR = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator"
_PRICING = "sgl_atom.attention.kv_scales, sgl_atom.speculative.draft_kv_pricing"

PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName(
        "sglang.srt.plugins.hook_registry.HookRegistry._hooks",
        "class attribute",
        "sgl_atom.patches (register_once, verify_applied)",
        "no public way to ask which hooks are registered on a target",
    ),
    PrivateName(
        "sglang.srt.plugins.hook_registry.HookRegistry._patched",
        "class attribute",
        "sgl_atom.patches (verify_applied)",
        "no public way to ask whether a target's hooks were applied",
    ),
    PrivateName(
        "sglang.srt.arg_groups.resolution_hooks._HOOKS",
        "module global",
        "sgl_atom.speculative.draft_kv_resolution (install), "
        "sgl_atom.speculative.dspark.forced_accept",
        "register_resolution_hook appends every call; the registry is read to register once",
    ),
    PrivateName(
        f"{_NGRAM}._prepare_for_speculative_decoding",
        "method",
        "sgl_atom.speculative.dspark.worker",
        "overridden: the chain's verify input built on the device; the n-gram one (tree mask, "
        "positions, cache locs from _prepare_draft_tokens) for a batch with a grammar",
    ),
    PrivateName(
        "sglang.srt.speculative.ngram_worker.USE_FULL_MASK",
        "module global",
        "sgl_atom.speculative.dspark.worker",
        "off while the DSpark worker builds its verify input: the per-request full mask it "
        "selects on CUDA is read by no attention backend ATOM_DSPARK can run with",
    ),
    PrivateName(
        "sglang.srt.speculative.ngram_worker._derive_tree_links",
        "module global",
        "sgl_atom.speculative.dspark.worker",
        "the verify window's tree links from the staged host mask, for the grammar's vocabulary "
        "mask of a batch with a grammar (as NGRAMWorker builds it)",
    ),
    PrivateName(
        f"{_NGRAM}._prepare_draft_tokens",
        "method",
        "sgl_atom.speculative.dspark.worker",
        "overridden: the DSpark draft's tokens and a chain mask instead of n-gram matches",
    ),
    *(
        PrivateName(
            f"{_NGRAM}.{attr}",
            "instance attribute",
            "sgl_atom.speculative.dspark.worker",
            _NGRAM_WHY,
        )
        for attr in (
            "_target_worker",
            "enable_overlap",
            "model_runner",
            "page_size",
            "device",
            "draft_token_num",
            "speculative_num_draft_tokens",
            "topk",
            "speculative_num_steps",
            "adaptive_controller",
            "grammar_tree_host",
            "max_trie_depth",
        )
    ),
    *(
        PrivateName(
            f"{_NGRAM}.{attr}",
            "instance attribute",
            "sgl_atom.speculative.dspark.worker",
            "the verify-input buffers NGRAMWorker.alloc_memory_pool allocates (per batch size "
            "views of one buffer each), filled on the device by the worker's chain verify input",
        )
        for attr in (
            "max_batch_size",
            "tree_mask",
            "draft_tokens_batch",
            "tree_mask_batch",
            "positions_batch",
            "retrieve_indexes_batch",
            "retrieve_next_token_batch",
            "retrieve_next_sibling_batch",
        )
    ),
    PrivateName(
        f"{_CONFIGURATOR}._cell_size",
        "instance attribute",
        _PRICING,
        "the per-token bytes the pool is sized with; the pricing adds or re-prices terms",
    ),
    PrivateName(
        f"{_CONFIGURATOR}._fixed_overhead_bytes",
        "instance attribute",
        "sgl_atom.speculative.draft_kv_pricing",
        "subtracted from the budget to log the tokens the draft's dtype gains",
    ),
    PrivateName(
        f"{_CONFIGURATOR}._compute_cell_size",
        "method",
        "sgl_atom.speculative.draft_kv_pricing",
        "the target's own per-token bytes, to split the draft term off the cell size",
    ),
    PrivateName(
        "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._kv_copy_config",
        "instance attribute",
        "sgl_atom.patches.cpu_kv_move",
        "set to None with use_native_move_kv_cache: the pool then moves rows with torch",
    ),
    PrivateName(
        "sglang.srt.mem_cache.kv_cache_configurator.cpu_has_amx_support",
        "module global",
        "sgl_atom.patches.cpu_fp8_kv",
        "answered True for the duration of configure() when atom serves every mode",
    ),
    PrivateName(
        "sglang.srt.mem_cache.kv_cache_configurator.attention_backends",
        "module global",
        "sgl_atom.patches.cpu_fp8_kv",
        "answered with intel_amx for atom for the duration of configure()",
    ),
    PrivateName(
        "sglang.srt.disaggregation.common.conn.CommonKVManager._start_heartbeat_checker_thread",
        "method",
        "sgl_atom.disagg.conn",
        "the decode side's heartbeat to its prefill peers, as SGLang's own backends start it",
    ),
    *(
        PrivateName(
            f"sglang.srt.disaggregation.common.conn.CommonKVManager.{attr}",
            kind,
            "sgl_atom.disagg.heartbeat (through sgl_atom.disagg.conn)",
            "the transfer-session heartbeat fails a silent peer's rooms through SGLang's own "
            "node-failure path and sends on SGLang's per-peer control sockets",
        )
        for attr, kind in (
            ("_handle_node_failure", "method"),
            ("_connect", "method"),
            ("_socket_send_locks", "instance attribute"),
            ("connection_pool", "instance attribute"),
            ("connection_lock", "instance attribute"),
            ("addr_to_rooms_tracker", "instance attribute"),
        )
    ),
    *(
        PrivateName(
            f"sglang.srt.disaggregation.pp_consensus_store.PPConsensusStore.{attr}",
            "instance attribute",
            "sgl_atom.disagg.heartbeat.status_snapshot",
            "a PP stage's request statuses, copied for the prefill's orphan sweep (the store "
            "has item access but no iteration)",
        )
        for attr in ("_local_map", "_cache_lock")
    ),
    PrivateName(
        "sglang.srt.disaggregation.common.conn.CommonKVReceiver._connect",
        "method",
        "sgl_atom.disagg.conn",
        "the decode side's control socket to a prefill rank, cached as SGLang's receivers do",
    ),
    PrivateName(
        "sglang.srt.server_args.ServerArgs._sgl_atom_cli",
        "set by sgl_atom",
        "sgl_atom.patches.prepare_server_args, sgl_atom.speculative.draft_kv_resolution",
        "sgl_atom's flag values; a _-prefixed non-field attribute survives the pickle",
    ),
    PrivateName(
        "sglang.srt.server_args.ServerArgs._sgl_atom_draft_kv",
        "set by sgl_atom",
        "sgl_atom.speculative.draft_kv_resolution and every reader of the settled draft dtype",
        "the settled draft KV dtype; a _-prefixed non-field attribute survives the pickle",
    ),
    PrivateName(
        "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._sgl_atom_state",
        "set by sgl_atom",
        "sgl_atom.pool_state (its only reader and writer)",
        "sgl_atom's per-pool state (fp8 scales, index cache, the draft pool P/D moves with it) "
        "hangs off the pool every backend of it reads",
    ),
)
