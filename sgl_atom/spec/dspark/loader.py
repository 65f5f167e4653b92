"""Build the DSpark draft from its checkpoint through SGLang's model registry, and arm the
target's tap layers."""

from __future__ import annotations

import glob
import json
import os

import torch

from ... import envs
from ...log import get_logger

logger = get_logger("sgl_atom.spec")
PACKAGE_HINT = "SGLANG_EXTERNAL_MODEL_PACKAGE=sgl_atom.models"


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


def arm_taps(target: torch.nn.Module, layer_ids: tuple[int, ...], num_layers: int) -> None:
    """Make the target capture the outputs of ``layer_ids`` (HF ids) in every forward."""
    if max(layer_ids) >= num_layers - 1:
        raise ValueError(
            f"dspark_target_layer_ids={list(layer_ids)}: the target has {num_layers} layers and "
            f"its last layer's output is not capturable; use ids below {num_layers - 1}"
        )
    arm = getattr(target, "set_dflash_layers_to_capture", None)
    if arm is None:
        raise ValueError(
            f"target model class {type(target).__name__} cannot expose layer taps "
            "(no set_dflash_layers_to_capture): ATOM_DSPARK needs a target that can"
        )
    arm(list(layer_ids))


def load_draft(path: str | None, target: torch.nn.Module, device) -> torch.nn.Module:
    """The draft model on ``device`` in the target's dtype, checked against the target."""
    if not path:
        raise ValueError(
            "--speculative-algorithm ATOM_DSPARK needs --speculative-draft-model-path "
            "(a DSpark draft checkpoint)"
        )
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    arch = (raw.get("architectures") or ["<none>"])[0]
    cls = _draft_class(path, arch)
    from transformers import PretrainedConfig

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
    arm_taps(target, taps, num_layers)
    dtype = next(target.parameters()).dtype
    model.place(device, dtype)
    cfg = model.dspark
    logger.info(
        "ATOM_DSPARK draft %s (%s): %d layers, k=%d, taps %s, Markov rank %d, %s",
        path,
        arch,
        cfg.num_hidden_layers,
        cfg.block_size,
        list(cfg.target_layer_ids),
        cfg.markov_rank,
        dtype,
    )
    return model
