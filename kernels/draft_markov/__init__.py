"""The DSpark draft's Markov head step: bias GEMM, base logits and argmax in one pass."""

from .reference import reference_markov_argmax
from .step import markov_argmax

__all__ = ["markov_argmax", "reference_markov_argmax"]
