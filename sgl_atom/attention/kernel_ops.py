"""Which implementation of the paged-attention launchers the atom backend calls.

On a GPU, always the Triton kernels. On CPU, ``SGL_ATOM_CPU_KERNELS`` picks the Triton kernels
under Triton's interpreter (``triton``, the default: the kernels themselves are exercised) or
their torch references in float64 (``reference``: same contracts, far faster), for servers whose
kernels are not what is under test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import envs
from ..kernels.kv_quant import reference_store_kv, store_kv
from ..kernels.paged_attention import (
    decode_fwd,
    extend_fwd,
    reference_decode,
    reference_extend,
    reference_verify,
    verify_fwd,
)

CHOICES = ("triton", "reference")
F64 = torch.float64  # row results then do not depend on how many rows run together


@dataclass(frozen=True)
class KernelOps:
    name: str
    store: Callable
    decode: Callable
    verify: Callable
    extend: Callable


def _ref_decode(q, kc, vc, pt, lens, page_size, sm_scale, out, k_scale=None, v_scale=None, **_):
    ref = reference_decode(q, kc, vc, pt, lens, page_size, sm_scale, k_scale, v_scale, F64)
    return out.copy_(ref)


def _ref_verify(q, kc, vc, pt, lens, page_size, sm_scale, num_draft, out, k_scale=None,
                v_scale=None, **_):
    ref = reference_verify(q, kc, vc, pt, lens, page_size, sm_scale, k_scale, v_scale, F64)
    return out.copy_(ref)


def _ref_extend(q, kc, vc, pt, lens, qo_indptr, page_size, sm_scale, out, k_scale=None,
                v_scale=None, **_):
    ref = reference_extend(
        q, kc, vc, pt, lens, qo_indptr, page_size, sm_scale, k_scale, v_scale, F64
    )
    return out.copy_(ref)


TRITON = KernelOps("triton", store_kv, decode_fwd, verify_fwd, extend_fwd)
REFERENCE = KernelOps("reference", reference_store_kv, _ref_decode, _ref_verify, _ref_extend)


def kernel_ops(device: torch.device | str) -> KernelOps:
    """The launchers for a backend on ``device``."""
    if torch.device(device).type != "cpu":
        return TRITON
    choice = envs.SGL_ATOM_CPU_KERNELS.get()
    if choice not in CHOICES:
        raise ValueError(
            f"SGL_ATOM_CPU_KERNELS={choice!r}: use one of {', '.join(CHOICES)}"
        )
    return REFERENCE if choice == "reference" else TRITON
