"""Index-cache reuse across sparse layers (`use_index_cache`, `index_topk_freq`)."""

from __future__ import annotations

import torch


def should_score(layer_ordinal: int, freq: int, offset: int = 0) -> bool:
    """Whether sparse layer `layer_ordinal` (0-based among sparse layers) scores its own top-k.

    With `index_topk_freq = freq`, ordinals `o` with `max(o - offset, 0) % freq == 0` score; the
    others reuse the latest selection of the same forward. `freq <= 1` scores every layer.
    """
    if layer_ordinal < 0:
        raise ValueError(f"sparse layer ordinal must be >= 0, got {layer_ordinal}")
    return freq <= 1 or max(layer_ordinal - offset, 0) % freq == 0


class TopkHolder:
    """The latest (selected, count) of one forward, for the layers that reuse instead of scoring.

    Call `clear()` at the start of every forward. A reuse with nothing stored, or stored for
    another token count, raises: it is an error, never a silent dense fallback.
    """

    def __init__(self) -> None:
        self._entry: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def clear(self) -> None:
        self._entry = None

    def store(self, layer_ordinal: int, selected: torch.Tensor, count: torch.Tensor) -> None:
        self._entry = (layer_ordinal, selected, count)

    def reuse(self, layer_ordinal: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._entry is None:
            raise RuntimeError(
                f"sparse layer {layer_ordinal} reuses the top-k block selection "
                "(use_index_cache with "
                "index_topk_freq), but no earlier sparse layer scored in this forward; make sparse "
                "ordinal 0 score (index_skip_topk_offset) or disable use_index_cache"
            )
        scored_by, selected, count = self._entry
        if selected.shape[0] != num_tokens:
            raise RuntimeError(
                f"sparse layer {layer_ordinal} reuses the selection of layer {scored_by}, which "
                f"has {selected.shape[0]} token rows, but this forward has {num_tokens}; clear() "
                "the holder "
                "at the start of every forward"
            )
        return selected, count

    def select(self, layer_ordinal: int, freq: int, num_tokens: int, score_fn, offset: int = 0):
        """`score_fn()` -> (selected, count) on scoring layers (stored), else the stored one."""
        if should_score(layer_ordinal, freq, offset):
            selected, count = score_fn()
            self.store(layer_ordinal, selected, count)
            return selected, count
        return self.reuse(layer_ordinal, num_tokens)
