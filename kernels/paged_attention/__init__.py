"""Paged attention over SGLang's token pool (bf16/fp16 or fp8 KV with per-token scales):
split-KV decode, causal extend/prefill, and target-verify. Layout: kernels/README.md."""

from .common import (
    SUPPORTED_HEAD_DIMS,
    SUPPORTED_KV_DTYPES,
    SUPPORTED_PAGE_SIZES,
    SUPPORTED_Q_DTYPES,
    check_supported,
    unsupported_reason,
)
from .decode import MAX_SPLITS, decode_fwd, decode_num_splits, decode_workspace, num_sms
from .extend import PrefixDequant, dequant_prefix, extend_fwd, plan_prefix_dequant
from .reference import reference_decode, reference_extend, reference_verify
from .verify import verify_fwd

__all__ = [
    "SUPPORTED_HEAD_DIMS",
    "SUPPORTED_KV_DTYPES",
    "SUPPORTED_PAGE_SIZES",
    "SUPPORTED_Q_DTYPES",
    "MAX_SPLITS",
    "check_supported",
    "unsupported_reason",
    "decode_fwd",
    "decode_num_splits",
    "decode_workspace",
    "num_sms",
    "extend_fwd",
    "PrefixDequant",
    "dequant_prefix",
    "plan_prefix_dequant",
    "verify_fwd",
    "reference_decode",
    "reference_extend",
    "reference_verify",
]
