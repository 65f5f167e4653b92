"""CPU mode: move KV rows with torch indexing instead of sgl_kernel's CPU copy op.

With speculative decoding on, SGLang's MHA pool warms up its tiled all-layer KV copy at
construction and uses it to move accepted draft rows. On CPU that goes to
``torch.ops.sgl_kernel.copy_all_layer_kv_cache_cpu``, which the sgl_kernel CPU build paired
with SGLang 0.5.23 does not ship, so the pool cannot even be built. SGLang's own native move
(``SGLANG_NATIVE_MOVE_KV_CACHE``, per-layer torch indexing) does the same job; this AROUND hook
switches the pool to it and skips the warm-up. Applied in CPU mode only.
Ledger: ``sgl_atom.patches.LEDGER``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import register_once

TARGET = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._init_kv_copy_and_warmup"


def native_move_on_cpu(original: Callable[..., Any], self, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook: a CPU pool moves rows natively and has no tiled-copy config."""
    if getattr(self, "device", None) is None or str(self.device) != "cpu":
        return original(self, *args, **kwargs)
    self.use_native_move_kv_cache = True
    self._kv_copy_config = None
    return None


def install() -> None:
    register_once(TARGET, native_move_on_cpu, "around")
