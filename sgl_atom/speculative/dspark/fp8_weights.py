"""fp8 GEMMs for the DSpark draft: ``--speculative-draft-model-quantization fp8``.

The draft runs beside the target at every decode step, and at a large batch its GEMMs (two
layers' fused projections, the context write's ``fc`` and K/V, and the LM head over every block
row) are compute-bound: in fp8 they take about half the time of bf16 on Hopper's tensor cores,
and at batch 1, where they read their weights, half the bytes. Asked for explicitly, the
draft's linear layers and its own copy of the target's LM head are quantized once after loading:
e4m3fn weights with one fp32 scale per output row, activations quantized per row (token) as
they enter each GEMM (:func:`sgl_atom.kernels.row_quant.quant_rows_fp8`), products in
``torch._scaled_mm`` with those row and column scales, bf16 out. The layers stay SGLang's: the
quantized ones carry :class:`DraftFp8LinearMethod`, an SGLang ``LinearMethodBase``. The Markov
head's w2 ([vocab, rank], read whole at each of the k positions of its walk) becomes e4m3fn
rows too, read by its fused Triton step (``kernels/draft_markov``).

What the draft proposes changes a little (its logits carry fp8 rounding); what the server
outputs does not: the target verifies every draft token. The target's own LM head stays as it
is; the draft's fp8 copy costs ``vocab x hidden`` bytes (525 MB for a Llama-3 vocabulary at
hidden 4096), its layers half their bf16 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.layers.quantization.base_config import LinearMethodBase

from ... import envs
from ...kernels.row_quant import quant_rows_fp8, reference_quant_rows_fp8

FLAG = "--speculative-draft-model-quantization"
CHOICES = ("fp8",)  # what ATOM_DSPARK's draft takes (besides none / unquant)
ALIGN = 16  # fp8 GEMM operands: both dimensions multiples of this


def draft_quantization(server_args) -> str | None:
    """The draft's weight quantization: ``"fp8"`` when asked for with the flag; None when not
    asked (SGLang then fills the flag from the target's ``--quantization``, which describes the
    target's checkpoint, not the draft's: the draft stays unquantized) or asked ``unquant``.
    Any other value is refused, naming the flag."""
    value = getattr(server_args, "speculative_draft_model_quantization", None)
    explicit = getattr(server_args, "_speculative_draft_quantization_explicitly_set", None)
    if explicit is None:  # before SGLang's default resolution: only a given value is set
        explicit = value is not None
    if not explicit or value in (None, "unquant"):
        return None
    if value not in CHOICES:
        raise ValueError(
            f"{FLAG} {value}: the ATOM_DSPARK draft takes fp8 (its GEMMs in fp8 with per-row "
            "weight and activation scales, quantized at load) or no quantization; drop the "
            "flag or pass fp8"
        )
    return value


def check_device(device: torch.device) -> None:
    """fp8 tensor-core GEMMs need compute capability 8.9 or newer on CUDA."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(
                f"{FLAG} fp8: this GPU (compute capability {major}.{minor}) has no fp8 GEMMs "
                "(8.9 or newer needed); serve the draft unquantized"
            )


@dataclass(frozen=True)
class Fp8Rows:
    """A [rows, cols] weight as e4m3fn values and one fp32 scale per row (value * scale)."""

    q: torch.Tensor  # [rows, cols] float8_e4m3fn
    scale: torch.Tensor  # [rows] float32

    @classmethod
    def of(cls, w: torch.Tensor, what: str = "weight") -> Fp8Rows:
        rows, cols = w.shape
        if rows % ALIGN or cols % ALIGN:
            raise ValueError(
                f"{FLAG} fp8: {what} is [{rows}, {cols}]; fp8 GEMMs need both dimensions to be "
                f"multiples of {ALIGN}; serve this draft unquantized"
            )
        return cls.quantize(w)

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Fp8Rows:
        """w's rows quantized, whatever its dimensions: for a weight that a Triton kernel
        reads rather than an fp8 GEMM (the Markov head's w2)."""
        q, scale = reference_quant_rows_fp8(w)
        return cls(q, scale.view(-1))

    def rows(self, start: int) -> Fp8Rows:
        """Rows ``start`` onwards (a fused weight's trailing part), without a copy."""
        return Fp8Rows(self.q[start:], self.scale[start:])

    def dequantized(self) -> torch.Tensor:
        """float32 values the GEMMs multiply by."""
        return self.q.float() * self.scale[:, None]

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * 4


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8 of activations: the Triton kernel on a GPU; on CPU as
    ``SGL_ATOM_CPU_KERNELS`` asks (the interpreted kernel, or its torch reference)."""
    if x.device.type == "cpu" and envs.SGL_ATOM_CPU_KERNELS.get() == "reference":
        return reference_quant_rows_fp8(x)
    return quant_rows_fp8(x)


def fp8_matmul(x: torch.Tensor, w: Fp8Rows, out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., cols] @ w.T -> [..., rows] in ``out_dtype``: x quantized per row, one fp8 GEMM
    scaled by x's row scales and w's row scales."""
    lead, cols = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, cols)
    if x2.shape[0] == 0:
        return x2.new_empty(*lead, w.q.shape[0], dtype=out_dtype)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    xq, xs = quant_rows(x2)
    out = torch._scaled_mm(
        xq, w.q.t(), scale_a=xs, scale_b=w.scale.view(1, -1), out_dtype=out_dtype
    )
    return out.view(*lead, w.q.shape[0])


class DraftFp8LinearMethod(LinearMethodBase):
    """An SGLang linear method for a layer whose weight :meth:`install` turned into e4m3fn rows
    with ``weight_scale`` [rows]: ``apply`` runs :func:`fp8_matmul`."""

    @staticmethod
    def install(layer: torch.nn.Module, rows: Fp8Rows) -> None:
        """Put ``rows`` (the layer's own weight, quantized) in place of its weight."""
        layer.weight = torch.nn.Parameter(rows.q, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(rows.scale, requires_grad=False)
        layer.quant_method = DraftFp8LinearMethod()

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = fp8_matmul(x, weight_rows(layer), x.dtype)
        return out if bias is None else out + bias


def weight_rows(layer: torch.nn.Module) -> Fp8Rows:
    """A quantized layer's weight as :class:`Fp8Rows`."""
    return Fp8Rows(layer.weight, layer.weight_scale)


def is_quantized(layer: torch.nn.Module) -> bool:
    return isinstance(getattr(layer, "quant_method", None), DraftFp8LinearMethod)
