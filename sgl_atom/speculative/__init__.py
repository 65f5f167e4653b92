"""Speculative decoding features: the draft KV dtype option (``draft_kv_dtype``).

Rules are plain functions with no SGLang import; the SGLang glue (a resolution hook, CLI flags,
the pool budget) is installed by each feature's ``register()``.
"""
