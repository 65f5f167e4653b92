"""``--speculative-algorithm ATOM_DSPARK``: registration with SGLang and argument handling.

Registered through ``SpeculativeAlgorithm.register`` under a name distinct from SGLang's own
``DSPARK``, with overlap scheduling supported (SGLang's default; off under ``--pp-size`` > 1).
The worker verifies its block as a chain through SGLang's tree-verify path, the one the NGRAM
worker uses, so the spec class answers ``is_ngram()`` for the scheduler's verify and
relay branches; it writes no draft tokens into the target's KV (``has_draft_kv`` False).
"""

from __future__ import annotations

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

NAME = "ATOM_DSPARK"


def _draft_block_size(path: str | None) -> int:
    from .config import DSparkDraftConfig
    from .loader import read_config

    return DSparkDraftConfig.from_hf_dict(read_config(path)).block_size


def check_pipeline_parallel(server_args) -> None:
    """``--pp-size`` > 1: only a P/D prefill server, whose draft never proposes.

    There the draft (on the last stage) only writes its context K/V, from taps that the earlier
    stages send along with the pipeline payload (:mod:`sgl_atom.speculative.dspark.pp_taps`). A
    unified or decode server would verify under PP, which this worker does not do.
    """
    pp, mode = server_args.pp_size, server_args.disaggregation_mode
    if mode != "prefill":
        raise ValueError(
            f"{NAME} with --pp-size {pp} needs --disaggregation-mode prefill (got {mode!r}): "
            "under pipeline parallelism the draft only writes its context K/V on a P/D "
            "prefill server, it never drafts there; serve a unified or decode server at "
            "--pp-size 1 (use --tp-size to spread it over more devices)"
        )
    from sglang.srt.environ import envs as sglang_envs

    if sglang_envs.SGLANG_ENABLE_PP_SPEC.get():
        raise ValueError(
            f"{NAME} with --pp-size {pp}: unset SGLANG_ENABLE_PP_SPEC; that relay carries an "
            f"EAGLE draft tree and builds no draft worker on the earlier stages, which {NAME} "
            "needs to send its taps to the last stage"
        )


def host_seq_lens() -> bool:
    """Whether each decode step's sequence lengths are copied to the host under overlap
    scheduling (SGLang's FutureMap ``needs_cpu_seq_lens``).

    SGLang turns the copy on for every n-gram-style algorithm, for its n-gram worker's full
    verify mask (sized per request from the host lengths); it is a wait: the scheduler
    prepares step N + 1 only after step N's verify has run, so the host's preparation is not
    hidden behind the GPU. This worker builds no such mask, and the atom backend, which it
    requires, sizes its tables from a host bound instead (the requests' allocated KV and host
    lengths, ``AtomDSparkWorker._bound_lengths``), so the lengths stay on the device unless
    ``SGL_ATOM_DSPARK_HOST_SEQ_LENS`` asks for the copy or two-batch overlap needs it (it
    splits batches by the host lengths).
    """
    from sglang.srt.runtime_context import get_exec

    from ... import envs

    if envs.SGL_ATOM_DSPARK_HOST_SEQ_LENS.get():
        return True
    return bool(get_exec().overlap.enable_two_batch_overlap)


class AtomDSparkAlgo(CustomSpecAlgo):
    def is_ngram(self) -> bool:
        return True

    def has_draft_kv(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def carries_draft_hidden_states(self) -> bool:
        return False

    def create_future_map(
        self, device, req_to_token_pool, needs_cpu_seq_lens=True, needs_confidence_relay=False
    ):
        from sglang.srt.managers.overlap_utils import FutureMap
        from sglang.srt.runtime_context import get_parallel
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        # Under PP (a P/D prefill, which never decodes) every stage stashes the relayed first
        # token as a server without a draft does; the n-gram relay wants accept tokens there.
        spec = self if get_parallel().pp_size == 1 else SpeculativeAlgorithm.NONE
        return FutureMap(device, spec, req_to_token_pool, host_seq_lens(), needs_confidence_relay)

    def build_disagg_draft_input(self, batch, last_tokens_tensor, future_map):
        """A P/D decode server's first step: what the worker returns after an extend (the
        prefill's token as the only accepted one); the draft's context came with the KV."""
        import torch
        from sglang.srt.managers.overlap_utils import RelayPayload
        from sglang.srt.runtime_context import get_spec
        from sglang.srt.speculative.ngram_info import NgramVerifyInput

        n = int(get_spec().speculative_num_draft_tokens)
        bs = len(batch.reqs)
        device = last_tokens_tensor.device
        accept = torch.zeros(bs, n, dtype=torch.int32, device=device)
        accept[:, 0] = last_tokens_tensor.to(torch.int32)
        spec_info = NgramVerifyInput(
            draft_token_num=n,
            new_seq_lens=batch.seq_lens,
            accept_tokens=accept.flatten(),
            accept_lens=torch.ones(bs, dtype=torch.int32, device=device),
        )
        if batch.enable_overlap:  # the first step's accepted token goes through the relay
            spec_info.future_indices = batch.req_pool_indices
            future_map.publish(spec_info.future_indices, batch.seq_lens)
            future_map.stash(spec_info.future_indices, RelayPayload.from_ngram(spec_info))
        return spec_info

    def handle_server_args(self, server_args) -> None:
        from .fp8_weights import draft_quantization

        check_attention_backend(server_args)
        draft_quantization(server_args)  # a method the draft does not take: refused here
        k = _draft_block_size(server_args.speculative_draft_model_path)
        given = server_args.speculative_num_draft_tokens
        if given is not None and int(given) != k + 1:
            raise ValueError(
                f"--speculative-num-draft-tokens {given} does not match the draft's block size "
                f"k={k}: {NAME} verifies k + 1 = {k + 1} tokens; drop the flag or set it to "
                f"{k + 1}"
            )
        if server_args.speculative_eagle_topk not in (None, 1):
            raise ValueError(
                f"--speculative-eagle-topk {server_args.speculative_eagle_topk}: {NAME} drafts "
                "one chain; drop the flag or set it to 1"
            )
        if getattr(server_args, "enable_dp_attention", False):
            raise ValueError(f"{NAME} does not support --enable-dp-attention yet")
        if server_args.pp_size > 1:
            check_pipeline_parallel(server_args)
        server_args.speculative_num_draft_tokens = k + 1
        server_args.speculative_num_steps = k
        server_args.speculative_eagle_topk = 1
        if server_args.pp_size > 1:  # SGLang runs PP without overlap; say so in the arguments
            server_args.disable_overlap_schedule = True
        server_args.enable_mixed_chunk = False


def check_attention_backend(server_args) -> None:
    """Refuse, at argument time (before any weight loads), a backend other than atom: the
    draft's context write and the target-verify step run through the atom backend's kernels."""
    default = getattr(server_args, "attention_backend", None)
    for flag, attr in (
        ("--prefill-attention-backend", "prefill_attention_backend"),
        ("--decode-attention-backend", "decode_attention_backend"),
    ):
        value = getattr(server_args, attr, None) or default
        if value != "atom":
            given = (
                f"{flag} {value}"
                if getattr(server_args, attr, None)
                else (f"--attention-backend {default}" if default else "no --attention-backend")
            )
            raise ValueError(
                f"--speculative-algorithm {NAME} needs --attention-backend atom (its draft and "
                f"target-verify run through the atom backend's kernels); got {given}"
            )


def _worker_factory(server_args):
    from .worker import AtomDSparkWorker

    return AtomDSparkWorker


def register() -> str:
    """Register ``ATOM_DSPARK`` once; returns what was registered for the plugin's log line."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    from . import forced_accept

    if get_spec(NAME) is None:
        SpeculativeAlgorithm.register(NAME, spec_class=AtomDSparkAlgo, supports_overlap=True)(
            _worker_factory
        )
    return ", ".join([f"speculative_algorithm:{NAME}", *forced_accept.register()])
