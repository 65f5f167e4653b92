"""ATOM_DSPARK under pipeline parallelism: start-up refusals and taps relayed across stages.

The stages here are fakes (layers that add one to the stream, so the stream entering layer j
is j): what is checked is which stage captures which tap, that the relayed block travels with
the pipeline payload, and that the last stage lays the taps out in draft-config order.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import PPProxyTensors
from torch import nn

from sgl_atom.patches.pp_spec_compat import pp_compat_with_atom_dspark
from sgl_atom.speculative.dspark import loader
from sgl_atom.speculative.dspark.algorithm import NAME, AtomDSparkAlgo, _worker_factory
from sgl_atom.speculative.dspark.pp_taps import (
    RELAY_KEY,
    StageTapRelay,
    assemble_taps,
    taps_before_stage,
    taps_on_stage,
)
from sgl_atom.testing import DSPARK_CHAIN

# ---------------------------------------------------------------- start-up refusals


def _algo() -> AtomDSparkAlgo:
    return AtomDSparkAlgo(NAME, _worker_factory)


def _server_args(**over) -> SimpleNamespace:
    args = dict(
        speculative_draft_model_path=str(DSPARK_CHAIN),
        speculative_num_draft_tokens=None,
        speculative_eagle_topk=None,
        enable_dp_attention=False,
        pp_size=2,
        disaggregation_mode="prefill",
        attention_backend="atom",
    )
    return SimpleNamespace(**{**args, **over})


@pytest.mark.parametrize(
    "over, given",
    [
        ({"attention_backend": "torch_native"}, "got --attention-backend torch_native"),
        ({"attention_backend": None}, "got no --attention-backend"),
        ({"decode_attention_backend": "triton"}, "got --decode-attention-backend triton"),
        ({"attention_backend": None, "prefill_attention_backend": "atom"},
         "got no --attention-backend"),
    ],
    ids=["torch_native", "unset", "decode-triton", "prefill-only"],
)  # fmt: skip
def test_non_atom_attention_backend_refused(over, given):
    with pytest.raises(ValueError, match="needs --attention-backend atom") as err:
        _algo().handle_server_args(_server_args(**over))
    assert given in str(err.value)


@pytest.mark.parametrize("mode", ["null", "decode"])
def test_pp_without_prefill_mode_is_refused(mode):
    with pytest.raises(ValueError, match=r"--pp-size 2 needs --disaggregation-mode prefill") as e:
        _algo().handle_server_args(_server_args(disaggregation_mode=mode))
    assert "--pp-size 1" in str(e.value)  # the remedy


@pytest.mark.parametrize(
    "path, message",
    [
        (None, r"needs --speculative-draft-model-path \(a DSpark draft checkpoint directory\)"),
        ("EMPTY", r"--speculative-draft-model-path .+: no config.json there"),
    ],
)
def test_draft_path_without_a_config_is_refused(tmp_path, path, message):
    path = str(tmp_path) if path == "EMPTY" else path
    with pytest.raises(ValueError, match=message):
        _algo().handle_server_args(_server_args(speculative_draft_model_path=path, pp_size=1))
    with pytest.raises(ValueError, match=message):
        loader.read_config(path)


def test_pp_prefill_is_accepted():
    args = _server_args()
    _algo().handle_server_args(args)
    assert args.speculative_num_draft_tokens == 5 and args.disable_overlap_schedule


@pytest.mark.parametrize("given", [False, True])
def test_overlap_schedule_is_kept_as_given_without_pp(given):
    """SGLang's default (overlap on) or --disable-overlap-schedule, both left alone at PP 1;
    under PP (the prefill above) it is off."""
    args = _server_args(pp_size=1, disaggregation_mode="null", disable_overlap_schedule=given)
    _algo().handle_server_args(args)
    assert args.disable_overlap_schedule is given


def test_registered_with_overlap_support():
    """SGLang refuses an algorithm without it when overlap scheduling is on (its default)."""
    from sglang.srt.speculative.spec_registry import get_spec

    from sgl_atom.speculative.dspark.algorithm import register

    register()
    assert get_spec(NAME).supports_overlap


@pytest.mark.parametrize(
    "env, tbo, host",
    [(None, False, False), ("1", False, True), (None, True, True), ("0", False, False)],
    ids=["default", "env", "two-batch-overlap", "env-off"],
)
def test_future_map_keeps_the_lengths_on_the_device(monkeypatch, env, tbo, host):
    """SGLang asks every n-gram-style algorithm for a host copy of each step's lengths, a wait
    on every verify under overlap scheduling; ATOM_DSPARK's map asks for none unless
    SGL_ATOM_DSPARK_HOST_SEQ_LENS does or two-batch overlap needs it, whatever SGLang passed."""
    import sglang.srt.managers.overlap_utils as overlap_utils
    import sglang.srt.runtime_context as rc

    made = {}

    def future_map(device, spec, pool, needs_cpu_seq_lens, needs_confidence_relay):
        made.update(spec=spec, needs_cpu_seq_lens=needs_cpu_seq_lens)
        return made

    monkeypatch.setattr(overlap_utils, "FutureMap", future_map)
    bag = SimpleNamespace(overlap=SimpleNamespace(enable_two_batch_overlap=tbo))
    monkeypatch.setattr(rc, "get_exec", lambda: bag)
    if env is None:
        monkeypatch.delenv("SGL_ATOM_DSPARK_HOST_SEQ_LENS", raising=False)
    else:
        monkeypatch.setenv("SGL_ATOM_DSPARK_HOST_SEQ_LENS", env)
    algo = _algo()
    with rc.get_parallel().override(pp_size=1):
        algo.create_future_map("cpu", None, needs_cpu_seq_lens=True)
    assert made == {"spec": algo, "needs_cpu_seq_lens": host}


def test_pp_with_sglang_pp_spec_relay_is_refused(monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_PP_SPEC", "1")
    with pytest.raises(ValueError, match="unset SGLANG_ENABLE_PP_SPEC"):
        _algo().handle_server_args(_server_args())


def _pp_cfg(**over) -> SimpleNamespace:
    cfg = dict(
        speculative_algorithm=NAME,
        disaggregation_mode="prefill",
        disable_overlap_schedule=True,
        min_free_slots_delay=None,
        enable_multi_layer_eagle=False,
    )
    return SimpleNamespace(**{**cfg, **over})


def test_sglang_pp_check_lets_atom_dspark_through_and_keeps_its_other_checks():
    from sglang.srt.arg_groups import validation_hook

    original = validation_hook.check_pipeline_parallel_compat
    original = getattr(original, "__wrapped__", original)
    with pytest.raises(AssertionError, match="only supports EAGLE"):
        original(_pp_cfg())  # what SGLang alone says
    pp_compat_with_atom_dspark(original, _pp_cfg())
    with pytest.raises(AssertionError, match="overlap schedule"):
        pp_compat_with_atom_dspark(original, _pp_cfg(disable_overlap_schedule=False))
    with pytest.raises(AssertionError, match="only supports EAGLE"):
        pp_compat_with_atom_dspark(original, _pp_cfg(speculative_algorithm="NGRAM"))


class _ModelArmedDraft(nn.Module):
    """A draft class that picks the target's taps itself (EAGLE3-style)."""

    def arm_target_taps(self, target) -> None:
        target.set_dflash_layers_to_capture([0])


def _target(num_layers: int = 4) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(num_hidden_layers=num_layers))


def test_model_armed_taps_are_refused_under_pp(monkeypatch):
    monkeypatch.setattr(loader, "_draft_class", lambda path, arch: _ModelArmedDraft)
    with pytest.raises(ValueError, match=r"arms the target's taps itself \(arm_target_taps\)"):
        loader.relay_stage_taps(str(DSPARK_CHAIN), _target(), pp_size=2)
    with pytest.raises(ValueError, match="only a tap set declared in the draft config"):
        loader.load_draft(str(DSPARK_CHAIN), _target(), "cpu", pp_size=2)
    loader.check_taps_declared(_ModelArmedDraft, pp_size=1)  # without PP it arms itself


# ---------------------------------------------------------------- taps across stages

HIDDEN, TOKENS = 3, 5


class _AddOne(nn.Module):
    def forward(self, x, capture_output=None):
        if capture_output is not None:
            capture_output(x)
        return x + 1


class _Stage(nn.Module):
    """One pipeline stage of a fake target: layers [start, end) of ``num_layers``."""

    def __init__(self, num_layers: int, start: int, end: int):
        super().__init__()
        self.config = SimpleNamespace(num_hidden_layers=num_layers)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(_AddOne() for _ in range(num_layers))
        self.model.start_layer, self.model.end_layer = start, end

    def forward(self, x, pp_proxy_tensors=None):
        h = x if pp_proxy_tensors is None else pp_proxy_tensors["hidden_states"]
        for i in range(self.model.start_layer, self.model.end_layer):
            h = self.model.layers[i](h)
        return PPProxyTensors({"hidden_states": h})


def _run_pipeline(tap_ids: tuple[int, ...], bounds: list[tuple[int, int]]) -> torch.Tensor:
    """Earlier stages relay; the last stage captures its own taps and assembles them all."""
    num_layers = bounds[-1][1]
    stages = [_Stage(num_layers, s, e) for s, e in bounds]
    for stage in stages[:-1]:
        StageTapRelay(stage, tap_ids)
    payload = None
    x = torch.zeros(TOKENS, HIDDEN)
    for stage in stages[:-1]:
        payload = stage(x, pp_proxy_tensors=payload)
    start, end = bounds[-1]
    local_ids = taps_on_stage(tap_ids, start, end)
    h, local = payload["hidden_states"], []
    for i in range(start, end):
        h = stages[-1].model.layers[i](
            h, capture_output=local.append if i - 1 in local_ids else None
        )
    return assemble_taps(tap_ids, start, HIDDEN, payload, torch.cat(local, -1) if local else None)


def _blocks(taps: torch.Tensor) -> list[float]:
    """The value of each tap's column block (the stream entering layer j is j everywhere)."""
    blocks = taps.view(TOKENS, -1, HIDDEN)
    assert bool((blocks == blocks[:1, :, :1]).all())
    return blocks[0, :, 0].tolist()


@pytest.mark.parametrize(
    "tap_ids, bounds",
    [
        ((0, 1, 3), [(0, 2), (2, 4), (4, 6)]),  # one tap per stage
        ((1, 2), [(0, 3), (3, 4)]),  # the chain draft under SGLANG_PP_LAYER_PARTITION=3,1
        ((1, 2), [(0, 2), (2, 4)]),  # an even split: both taps enter stage 1
        ((0, 1), [(0, 3), (3, 4)]),  # every tap from stage 0, none on the last
        ((0, 2, 3, 5), [(0, 1), (1, 3), (3, 5), (5, 7)]),  # a stage in between with none
    ],
    ids=["3-stages-one-each", "chain-3-1", "chain-2-2", "all-relayed", "4-stages-gap"],
)
def test_taps_arrive_in_config_order(tap_ids, bounds):
    taps = _run_pipeline(tap_ids, bounds)
    assert taps.shape == (TOKENS, len(tap_ids) * HIDDEN)
    assert _blocks(taps) == [float(i + 1) for i in tap_ids]  # tap i enters layer i + 1


def test_stage_sends_received_taps_before_its_own():
    stage = _Stage(6, 2, 4)
    relay = StageTapRelay(stage, (0, 1, 3))
    assert relay.own == (1,)
    incoming = PPProxyTensors(
        {"hidden_states": torch.full((TOKENS, HIDDEN), 2.0), RELAY_KEY: torch.ones(TOKENS, HIDDEN)}
    )
    out = stage(None, pp_proxy_tensors=incoming)
    assert _blocks(out[RELAY_KEY]) == [1.0, 2.0]
    assert torch.equal(out["hidden_states"], torch.full((TOKENS, HIDDEN), 4.0))


def test_missing_relayed_taps_are_refused():
    local = torch.zeros(TOKENS, HIDDEN)
    with pytest.raises(RuntimeError, match=r"expects taps \[1\] .* got 0 columns"):
        assemble_taps((1, 2), 3, HIDDEN, PPProxyTensors({"hidden_states": local}), local)


def test_stage_split_of_tap_ids():
    assert taps_on_stage((1, 2), 0, 2) == () and taps_on_stage((1, 2), 2, 4) == (1, 2)
    assert taps_on_stage((1, 2), 0, 3) == (1,) and taps_before_stage((1, 2), 3) == (1,)
