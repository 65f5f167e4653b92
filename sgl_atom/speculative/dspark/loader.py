"""Build the DSpark draft from its checkpoint through SGLang's model registry, and arm the
target's tap layers.

The taps are the draft config's ``dspark_target_layer_ids`` (a declared tap set). A draft class
may instead pick and arm the target's taps itself (a ``arm_target_taps(target)`` method, as
EAGLE3 heads do); such a draft is refused under pipeline parallelism, where the earlier stages
must know from the config alone which layers to send to the last stage
(:mod:`sgl_atom.speculative.dspark.pp_taps`).
"""

from __future__ import annotations

import glob
import json
import os

import torch

from ... import envs
from ...log import get_logger
from .fp8_weights import check_device

logger = get_logger("sgl_atom.speculative")
PACKAGE_HINT = "SGLANG_EXTERNAL_MODEL_PACKAGE=sgl_atom.models"
MODEL_ARMED = "arm_target_taps"  # a draft class method that picks and arms the taps itself


def _draft_class(path: str, arch: str):
    from sglang.srt.models.registry import ModelRegistry

    if not ModelRegistry.is_arch_supported(arch):
        raise ValueError(
            f"draft checkpoint {path} declares architecture {arch!r}, which SGLang's model "
            f"registry does not hold: start the server with {PACKAGE_HINT} so sgl_atom's model "
            "classes are registered"
        )
    cls, _ = ModelRegistry.resolve_model_cls([arch])
    return cls


def _read_weights(path: str):
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"draft checkpoint {path} has no *.safetensors file")
    for f in files:
        yield from load_file(f).items()


def read_config(path: str | None) -> dict:
    """The draft checkpoint's config.json (ValueError naming the flag when there is none)."""
    if not path:
        raise ValueError(
            "--speculative-algorithm ATOM_DSPARK needs --speculative-draft-model-path (a DSpark "
            "draft checkpoint directory)"
        )
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise ValueError(
            f"--speculative-draft-model-path {path}: no config.json there (ATOM_DSPARK reads the "
            "draft from a local checkpoint directory)"
        )
    with open(config) as f:
        return json.load(f)


def check_taps_declared(cls: type, pp_size: int) -> None:
    """Under PP only a tap set declared in the draft config travels between stages."""
    if pp_size > 1 and callable(getattr(cls, MODEL_ARMED, None)):
        raise ValueError(
            f"ATOM_DSPARK with --pp-size {pp_size}: draft class {cls.__name__} arms the target's "
            f"taps itself ({MODEL_ARMED}), so the earlier pipeline stages cannot know which "
            "layers to send to the last stage, where the draft lives; only a tap set declared "
            "in the draft config (dspark_target_layer_ids) travels with the pipeline payload. "
            "Use a draft that declares its taps, or serve without --pp-size"
        )


def _check_capturable(layer_ids: tuple[int, ...], num_layers: int) -> None:
    if max(layer_ids) >= num_layers - 1:
        raise ValueError(
            f"dspark_target_layer_ids={list(layer_ids)}: the target has {num_layers} layers and "
            f"its last layer's output is not capturable; use ids below {num_layers - 1}"
        )


def relay_stage_taps(path: str | None, target: torch.nn.Module, pp_size: int):
    """On a pipeline stage before the last: no draft, only its taps sent on to the last stage.

    Reads the draft config (not its weights) and returns the installed
    :class:`~sgl_atom.speculative.dspark.pp_taps.StageTapRelay`.
    """
    from .config import DSparkDraftConfig
    from .pp_taps import StageTapRelay

    raw = read_config(path)
    check_taps_declared(_draft_class(path, (raw.get("architectures") or ["<none>"])[0]), pp_size)
    taps = DSparkDraftConfig.from_hf_dict(raw).target_layer_ids
    _check_capturable(taps, int(target.config.num_hidden_layers))
    relay = StageTapRelay(target, taps)
    logger.info("ATOM_DSPARK PP stage: no draft here; taps %s sent on", list(relay.own))
    return relay


def arm_taps(
    target: torch.nn.Module, layer_ids: tuple[int, ...], num_layers: int, start: int = 0
) -> tuple[int, ...]:
    """Make the target capture the outputs of ``layer_ids`` (HF ids) its stage holds (layers
    ``start`` onwards; all of them without PP) in every forward; returns those ids."""
    from .pp_taps import taps_on_stage

    _check_capturable(layer_ids, num_layers)
    local = taps_on_stage(layer_ids, start, num_layers)
    if not local:  # every tap arrives from earlier stages
        return local
    arm = getattr(target, "set_dflash_layers_to_capture", None)
    if arm is None:
        raise ValueError(
            f"target model class {type(target).__name__} cannot expose layer taps "
            "(no set_dflash_layers_to_capture): ATOM_DSPARK needs a target that can"
        )
    arm(list(local))
    return local


def load_draft(
    path: str | None,
    target: torch.nn.Module,
    device,
    pp_size: int = 1,
    quantization: str | None = None,
) -> torch.nn.Module:
    """The draft model on ``device`` in the target's dtype, checked against the target; on the
    last pipeline stage under PP, the taps this stage holds are armed (the others arrive).
    ``quantization`` ``"fp8"``: its GEMM layers quantized once placed
    (:mod:`sgl_atom.speculative.dspark.fp8_weights`)."""
    from .pp_taps import stage_layers

    raw = read_config(path)
    arch = (raw.get("architectures") or ["<none>"])[0]
    cls = _draft_class(path, arch)
    check_taps_declared(cls, pp_size)
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from transformers import PretrainedConfig

    dtype = next(target.parameters()).dtype
    with set_default_torch_dtype(dtype):  # parameters built at the served dtype
        model = cls(PretrainedConfig.from_dict(raw))
    model.load_weights(_read_weights(path))
    tcfg = target.config
    num_layers = int(tcfg.num_hidden_layers)
    model.dspark.check_target(
        num_layers=num_layers, hidden_size=int(tcfg.hidden_size), vocab_size=int(tcfg.vocab_size)
    )
    taps = model.dspark.target_layer_ids
    if envs.SGL_ATOM_DSPARK_FAULT.get() == "taps-early":
        taps = tuple(i - 1 for i in taps)
        logger.warning(
            "%s=taps-early: tapping target layers %s instead of the draft's %s",
            envs.SGL_ATOM_DSPARK_FAULT.name,
            list(taps),
            list(model.dspark.target_layer_ids),
        )
    if callable(getattr(model, MODEL_ARMED, None)):
        getattr(model, MODEL_ARMED)(target)
    else:
        arm_taps(target, taps, num_layers, stage_layers(target)[0])
    model.place(device, dtype)
    weights = str(dtype)
    if quantization == "fp8":
        check_device(device)
        weights = (
            f"fp8 GEMM weights ({model.quantize_fp8() / 2**20:.2f} MiB with the Markov head's "
            f"w2), {dtype} compute"
        )
    cfg = model.dspark
    logger.info(
        "ATOM_DSPARK draft %s (%s): %d layers, k=%d, taps %s, Markov rank %d, %s",
        path,
        arch,
        cfg.num_hidden_layers,
        cfg.block_size,
        list(cfg.target_layer_ids),
        cfg.markov_rank,
        weights,
    )
    return model
