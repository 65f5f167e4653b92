"""DSpark taps across pipeline stages (``ATOM_DSPARK`` on a ``--pp-size`` > 1 prefill server).

Tap ``i`` (an HF layer id of the draft config's ``dspark_target_layer_ids``) is the residual
stream entering target layer ``i + 1`` (SGLang's Llama capture convention), so it is captured
on the stage that holds layer ``i + 1``. The draft lives on the last stage; SGLang arms capture
on that stage only (``set_dflash_layers_to_capture`` returns early elsewhere). On every earlier
stage :class:`StageTapRelay` captures the stage's taps through the layers' own
``capture_output`` hook and sends them, after the taps it received, with the pipeline payload
under :data:`RELAY_KEY`; the next stage's layers read only ``hidden_states``/``residual``. The
last stage puts the relayed taps before its own (:func:`assemble_taps`). Tap ids are strictly
increasing (the config refuses others) and stages hold ascending layers, so stage order is the
config's order.

Only a tap set declared in the draft config can be relayed: every stage reads it from
``config.json`` without the draft's weights.
"""

from __future__ import annotations

import functools
import inspect

import torch
from sglang.srt.layers.aux_hidden_states import AuxHiddenStateList
from sglang.srt.model_executor.forward_batch_info import PPProxyTensors

RELAY_KEY = "sgl_atom_dspark_taps"


def taps_on_stage(tap_ids: tuple[int, ...], start: int, end: int) -> tuple[int, ...]:
    """The tap ids captured on the stage holding target layers [start, end)."""
    return tuple(i for i in tap_ids if start <= i + 1 < end)


def taps_before_stage(tap_ids: tuple[int, ...], start: int) -> tuple[int, ...]:
    """The tap ids captured on stages before the one starting at layer ``start``."""
    return tuple(i for i in tap_ids if i + 1 < start)


def stage_layers(target: torch.nn.Module) -> tuple[int, int]:
    """[start, end) of the target layers this pipeline stage holds."""
    inner = getattr(target, "model", target)
    num_layers = int(target.config.num_hidden_layers)
    return int(getattr(inner, "start_layer", 0)), int(getattr(inner, "end_layer", num_layers))


def relay_taps(incoming: PPProxyTensors | None, own: list[torch.Tensor]) -> torch.Tensor | None:
    """What a stage sends on: the taps it received, then its own ([tokens, n * hidden])."""
    parts = list(own)
    if incoming is not None and RELAY_KEY in incoming.tensors:
        parts.insert(0, incoming.tensors[RELAY_KEY])
    return torch.cat(parts, dim=-1) if parts else None


def assemble_taps(
    tap_ids: tuple[int, ...],
    start: int,
    hidden: int,
    incoming: PPProxyTensors | None,
    local: torch.Tensor | None,
) -> torch.Tensor:
    """All taps in config order on the last stage: the relayed ones, then ``local``.

    incoming: the pipeline payload this stage received; local: [tokens, n_local * hidden], the
    taps captured here (None when this stage holds none). Returns [tokens, len(tap_ids) *
    hidden]; refuses a relayed block that does not carry the earlier stages' taps.
    """
    earlier = taps_before_stage(tap_ids, start)
    relayed = None if incoming is None else incoming.tensors.get(RELAY_KEY)
    width = 0 if relayed is None else int(relayed.shape[-1])
    if width != len(earlier) * hidden:
        raise RuntimeError(
            f"ATOM_DSPARK under PP: the stage starting at layer {start} expects taps "
            f"{list(earlier)} ({len(earlier) * hidden} columns) from earlier stages, got {width} "
            f"columns under {RELAY_KEY!r}"
        )
    parts = [t for t in (relayed, local) if t is not None and t.shape[-1]]
    taps = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
    if taps.shape[-1] != len(tap_ids) * hidden:
        raise RuntimeError(
            f"ATOM_DSPARK under PP: assembled {taps.shape[-1]} tap columns, expected "
            f"{len(tap_ids)} taps x {hidden}"
        )
    return taps


class StageTapRelay:
    """On an earlier (not last) stage: capture this stage's taps in every forward and add them,
    after the received ones, to the pipeline payload the target returns."""

    def __init__(self, target: torch.nn.Module, tap_ids: tuple[int, ...]) -> None:
        start, end = stage_layers(target)
        self.own = taps_on_stage(tap_ids, start, end)
        self._aux = AuxHiddenStateList()
        layers = getattr(target, "model", target).layers
        for i in self.own:
            self._capture_input_of(layers[i + 1], i)
        self._relay_from(target)

    def _capture(self, hidden: torch.Tensor, *, owned: bool = False) -> None:
        self._aux.capture(hidden, owned=owned)

    def _capture_input_of(self, layer: torch.nn.Module, tap: int) -> None:
        if "capture_output" not in inspect.signature(layer.forward).parameters:
            raise ValueError(
                f"ATOM_DSPARK under PP: target layer {tap + 1} ({type(layer).__name__}) takes no "
                f"capture_output, so tap {tap} cannot be captured on its stage; serve this "
                "target without --pp-size"
            )
        original = layer.forward

        @functools.wraps(original)
        def forward(*args, capture_output=None, **kwargs):
            return original(*args, capture_output=self._capture, **kwargs)

        layer.forward = forward

    def _relay_from(self, target: torch.nn.Module) -> None:
        original = target.forward

        @functools.wraps(original)
        def forward(*args, **kwargs):
            self._aux = AuxHiddenStateList()
            out = original(*args, **kwargs)
            if isinstance(out, PPProxyTensors):
                taps = relay_taps(kwargs.get("pp_proxy_tensors"), list(self._aux))
                if taps is not None:
                    out.tensors[RELAY_KEY] = taps
            self._aux = AuxHiddenStateList()
            return out

        target.forward = forward
