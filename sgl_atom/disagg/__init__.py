"""P/D disaggregation core for the `atom` transfer backend: region descriptions, the handshake
pairing and head-cut planner, and the control-message wire format. Pure Python: no SGLang, no
torch, no transfer engine."""

from sgl_atom.disagg.plan import (
    HandshakeError,
    PairPlan,
    TransferPlan,
    check_stage_coverage,
    plan_transfer,
)
from sgl_atom.disagg.regions import (
    RegionDesc,
    RegionError,
    RegionKind,
    build_rank_regions,
    canonical_dtype,
)
from sgl_atom.disagg.wire import (
    Handshake,
    TransferRequest,
    TransferStatus,
    WireError,
    decode,
    encode,
)

__all__ = [
    "Handshake",
    "HandshakeError",
    "PairPlan",
    "RegionDesc",
    "RegionError",
    "RegionKind",
    "TransferPlan",
    "TransferRequest",
    "TransferStatus",
    "WireError",
    "build_rank_regions",
    "canonical_dtype",
    "check_stage_coverage",
    "decode",
    "encode",
    "plan_transfer",
]
