"""KV store into the paged token pool: a copy, or fp8 e4m3fn with per-(token, KV head) scales."""

from .reference import reference_store_kv
from .store import store_kv

__all__ = ["store_kv", "reference_store_kv"]
