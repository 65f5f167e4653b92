"""Control messages between P/D peers: a fixed header, then a strictly checked JSON body.

Frame: `!4sBBHI` = magic b"SAPD", version, message type, reserved (0), body length; then exactly
body-length bytes of UTF-8 JSON holding one object. Why this shape:

- The header is a fixed struct, so framing, version and type are checked, and the total length
  compared with the declared one, before any body byte is parsed.
- The body is JSON because control messages are few and small (a handshake per peer, a request
  and a status per room): parse cost does not matter, a message reads in a log, and the stdlib
  parser only ever builds dicts, lists, strings and numbers. Nothing is unpickled or evaluated,
  so a peer's bytes cannot run code. Floats, NaN and duplicate keys are refused by the parser.
- The parsed object is checked by pydantic against the message dataclass's annotated field
  types: scalars are strict (no bool where an int belongs, no number where a string does), so
  unknown or missing fields, out-of-range numbers and over-long strings or lists are refused,
  and the error names the field.
- Binary blobs (the transfer engine's agent metadata) travel as base64 with a size cap.

`decode` raises :class:`WireError` for anything else and never another exception; `encode`
runs the same checks, so it never emits what `decode` would refuse.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import struct
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetPydanticSchema,
    PlainSerializer,
    Strict,
    TypeAdapter,
    ValidationError,
)
from pydantic_core import PydanticSerializationError

from sgl_atom.disagg.regions import RegionDesc, RegionKind

MAGIC = b"SAPD"
VERSION = 4  # 2: Handshake.region_devices; 3: Heartbeat; 4: Handshake.device_uuid, ipc_regions
HEADER = struct.Struct("!4sBBHI")
MAX_BODY = 16 << 20
MAX_INBOUND_FRAME = MAX_BODY + HEADER.size  # the control socket's ZMQ_MAXMSGSIZE
MAX_REGIONS = 8192
MAX_PAGE_IDS = 1 << 20
MAX_AGENT_METADATA = 1 << 20
MAX_NAME = 256
MAX_AUX = 64
MAX_ERROR = 1024
MAX_ROOMS = 1 << 16
U64 = (1 << 64) - 1


class WireError(ValueError):
    """A control message is malformed, too large, of another version or of an unknown type."""


# -- field types. The models' config is lax only so that a JSON object may fill a dataclass and
# a JSON list a tuple; every scalar is Strict.

_CONFIG = ConfigDict(extra="forbid")
Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Rank = Annotated[Int, Field(ge=0, le=1023)]
Size = Annotated[Int, Field(ge=1, le=1024)]
Heads = Annotated[Int, Field(ge=1, le=1 << 12)]
Extent = Annotated[Int, Field(ge=1, le=1 << 16)]  # head dim, tokens or runs per page
UInt64 = Annotated[Int, Field(ge=0, le=U64)]  # an address, a byte count, a room
StageBound = Annotated[Int, Field(ge=0, le=1 << 16)]  # a PP stage's first or end layer
PageId = Annotated[Int, Field(ge=0, le=(1 << 31) - 1)]
Device = Annotated[Int, Field(ge=-1, le=1023)]  # a CUDA device, -1: host memory
Name = Annotated[str, Strict(), Field(max_length=MAX_NAME)]


def _from_base64(v: Any) -> bytes:
    if type(v) is not str or len(v) > 4 * ((MAX_AGENT_METADATA + 2) // 3):
        raise ValueError(f"expected base64 of at most {MAX_AGENT_METADATA} bytes")
    try:
        return base64.b64decode(v.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise ValueError("not valid base64") from None


def _to_base64(b: bytes) -> str:
    return base64.b64encode(b).decode()


Blob = Annotated[bytes, Strict(), BeforeValidator(_from_base64), PlainSerializer(_to_base64)]


class _Region(BaseModel):
    """A :class:`RegionDesc` as the wire spells it (its global layer is `layer`)."""

    model_config = _CONFIG
    kind: RegionKind
    layer: Annotated[Int, Field(ge=0, le=(1 << 16) - 1)]
    dtype: Annotated[str, Strict(), Field(max_length=32)]
    head_dim: Extent
    heads_per_rank: Heads
    total_heads: Heads
    tokens_per_page: Extent
    runs_per_page: Extent | None
    replicated: Bool
    unit_bytes: Annotated[Int, Field(ge=1, le=1 << 20)]

    def desc(self) -> RegionDesc:
        return RegionDesc(global_layer=self.layer, **self.model_dump(exclude={"layer"}))


_REGION_FIELDS = tuple(k for k in _Region.model_fields if k not in ("kind", "layer"))


def _region_json(r: RegionDesc) -> dict[str, Any]:
    same = {k: getattr(r, k) for k in _REGION_FIELDS}
    return {"kind": r.kind.value, "layer": r.global_layer, **same}


# A RegionDesc is checked in the wire's spelling (_Region), then built, which runs its own checks
# (a refusal there reads as a value error of that region).
Region = Annotated[
    RegionDesc,
    GetPydanticSchema(lambda _tp, handler: handler(_Region)),
    AfterValidator(_Region.desc),
    PlainSerializer(_region_json),
]


@dataclass(frozen=True)
class CudaIpcRegion:
    """A consumer region's buffer as CUDA IPC shares it (torch's ``reduce_tensor`` of the
    buffer's flat bytes): the allocation's handle, the storage's place in it, the buffer's byte
    offset in the storage and its length, torch's reference counter and its ready event."""

    __pydantic_config__ = _CONFIG
    device: Rank
    handle: Blob
    storage_bytes: UInt64
    storage_offset: UInt64
    offset: UInt64
    nbytes: UInt64
    ref_counter: Blob
    ref_counter_offset: UInt64
    event: Blob
    event_sync: Bool


@dataclass(frozen=True)
class Handshake:
    """A rank's description of itself: its place in TP/PP, its regions, its transfer agent.

    stage_layers: [first, end) global layers of this rank's PP stage. region_addrs: base address
    of each region's buffer (same order as regions), or empty where the peer needs none;
    region_bytes: each buffer's length (writes into it are bounds-checked against it), or empty.
    aux: (base address, bytes, bytes per request) of each per-request metadata buffer (the
    first output token and its logprobs), copied whole per request. status_host/status_port:
    where the producer reports a room's outcome (a consumer's control socket). region_devices:
    the CUDA device of each region's buffer, -1 for host memory; empty: all host memory.
    device_uuid: the UUID of the GPU holding the regions; ipc_regions: each region's buffer as
    CUDA IPC shares it (same order as regions), for a producer on the same host and GPU to map
    and write directly (:mod:`sgl_atom.disagg.ipc`); empty: NIXL only.
    """

    __pydantic_config__ = _CONFIG
    role: Literal["producer", "consumer"]
    tp_rank: Rank
    tp_size: Size
    pp_rank: Rank
    pp_size: Size
    stage_layers: tuple[StageBound, StageBound]
    regions: Annotated[tuple[Region, ...], Field(max_length=MAX_REGIONS)]
    region_addrs: Annotated[tuple[UInt64, ...], Field(max_length=MAX_REGIONS)]
    agent_name: Name
    agent_metadata: Blob
    region_bytes: Annotated[tuple[UInt64, ...], Field(max_length=MAX_REGIONS)] = ()
    aux: Annotated[tuple[tuple[UInt64, UInt64, UInt64], ...], Field(max_length=MAX_AUX)] = ()
    status_host: Name = ""
    status_port: Annotated[Int, Field(ge=0, le=65535)] = 0
    region_devices: Annotated[tuple[Device, ...], Field(max_length=MAX_REGIONS)] = ()
    device_uuid: Name = ""
    ipc_regions: Annotated[tuple[CudaIpcRegion, ...], Field(max_length=MAX_REGIONS)] = ()


@dataclass(frozen=True)
class TransferRequest:
    """A consumer rank asks for room `room`'s pages; it holds heads [head_start, +head_count).

    aux_index: the consumer's metadata row for the request (-1: none). agent_name: the
    consumer's transfer agent (its handshake). peers: how many consumer ranks ask this producer
    rank for the room (the room is ready once all of them asked).
    """

    __pydantic_config__ = _CONFIG
    room: UInt64
    consumer_rank: Rank
    page_ids: Annotated[tuple[PageId, ...], Field(max_length=MAX_PAGE_IDS)]
    head_start: Annotated[Int, Field(ge=0, le=(1 << 12) - 1)]
    head_count: Heads
    aux_index: Annotated[Int, Field(ge=-1, le=(1 << 31) - 1)] = -1
    agent_name: Name = ""
    peers: Size = 1


@dataclass(frozen=True)
class TransferStatus:
    """How a room's transfer ended: status "done" (error empty) or "failed" (error says why)."""

    __pydantic_config__ = _CONFIG
    room: UInt64
    status: Literal["done", "failed"]
    error: Annotated[str, Strict(), Field(max_length=MAX_ERROR)] = ""

    @classmethod
    def failed(cls, room: int, error: str) -> TransferStatus:
        """A failure whose text is cut to the cap, so reporting it never fails."""
        return cls(room, "failed", error[:MAX_ERROR])


@dataclass(frozen=True)
class Heartbeat:
    """A consumer's liveness probe of a producer rank (reply False) and the answer (reply True).

    agent_name: the consumer's transfer agent (its handshake; the producer answers only agents
    it knows, at their status endpoint). endpoint: the producer's control socket as the consumer
    dialled it (``host:port``), echoed in the answer so the consumer knows which rank answered.
    rooms: in a probe, the bootstrap rooms the consumer holds for that producer, so a producer
    can fail the rooms no live consumer holds any more; in an answer, those of them the producer
    has no request for, so the consumer can fail a room whose request never reached it.
    """

    __pydantic_config__ = _CONFIG
    agent_name: Name
    endpoint: Name
    reply: Bool = False
    rooms: Annotated[tuple[UInt64, ...], Field(max_length=MAX_ROOMS)] = ()


Message = Handshake | TransferRequest | TransferStatus | Heartbeat
TYPE_CODES: dict[type, int] = {Handshake: 1, TransferRequest: 2, TransferStatus: 3, Heartbeat: 4}
_BY_CODE = {code: cls for cls, code in TYPE_CODES.items()}
_ADAPTERS: dict[type, TypeAdapter] = {cls: TypeAdapter(cls) for cls in TYPE_CODES}
_FIELDS = {cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in TYPE_CODES}


def encode(msg: Message) -> bytes:
    """One frame for `msg`; WireError if a field is out of bounds."""
    cls = type(msg)
    if cls not in TYPE_CODES:
        raise WireError(f"not a control message: {cls.__name__}")
    try:
        # python mode: a bool stays a bool (mode="json" would write it as an int) for the check
        obj = _ADAPTERS[cls].dump_python(msg, warnings="error")
    except PydanticSerializationError as e:
        detail = " ".join(str(e).split())[:300]
        raise WireError(f"{cls.__name__}: a field has the wrong type ({detail})") from None
    _from_json(cls, obj)  # the checks decode applies
    body = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    if len(body) > MAX_BODY:
        raise WireError(f"{cls.__name__} body is {len(body)} bytes, cap {MAX_BODY}")
    return HEADER.pack(MAGIC, VERSION, TYPE_CODES[cls], 0, len(body)) + body


def decode(data: bytes) -> Message:
    """The message in one frame, or WireError: never another exception, never code execution."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError(f"a frame is bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < HEADER.size:
        raise WireError(f"frame of {len(data)} bytes is shorter than the {HEADER.size}-byte header")
    magic, version, code, reserved, length = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise WireError(f"control message version {version}, this side speaks {VERSION}")
    if code not in _BY_CODE or reserved:
        raise WireError(f"unknown message type {code} (reserved field {reserved})")
    if length > MAX_BODY or len(data) != HEADER.size + length:
        raise WireError(
            f"body length {length} does not match the {len(data) - HEADER.size} "
            f"bytes after the header (cap {MAX_BODY})"
        )
    return _from_json(_BY_CODE[code], _parse_body(data[HEADER.size :]))


def _parse_body(body: bytes) -> Any:
    try:
        return json.loads(
            body.decode("utf-8"),
            object_pairs_hook=_no_duplicates,
            parse_float=_refuse_float,
            parse_constant=_refuse_float,
        )
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError included
        raise WireError(f"body is not valid JSON: {str(e)[:200]}") from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise WireError("duplicate key in a JSON object")
    return out


def _refuse_float(text: str) -> None:
    raise WireError(f"non-integer number {text[:40]!r}")


def _from_json(cls: type, obj: Any) -> Message:
    # Both sides speak one version and send every field: a default is no licence to omit one.
    if type(obj) is dict and (missing := sorted(_FIELDS[cls] - obj.keys())):
        raise WireError(f"{cls.__name__}: missing fields {missing}")
    try:
        msg = _ADAPTERS[cls].validate_python(obj)
    except ValidationError as e:
        raise WireError(_describe(cls.__name__, e)) from None
    problems = _relation_problems(msg)
    if problems:
        raise WireError(f"{cls.__name__}: " + "; ".join(problems))
    return msg


_PLAIN = {"extra_forbidden": "unknown field", "unexpected_keyword_argument": "unknown field"}


def _describe(name: str, e: ValidationError) -> str:
    """The first error as `Handshake.regions[3].kind: <what is wrong>, got <the value>`."""
    err = e.errors(include_url=False)[0]
    path = name + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
    cause = err.get("ctx", {}).get("error")
    what = _PLAIN.get(err["type"]) or str(cause or err["msg"][:1].lower() + err["msg"][1:])
    more = f" (+{e.error_count() - 1} more)" if e.error_count() > 1 else ""
    return f"{path}: {what[:300]}, got {_show(err['input'])}{more}"


def _show(v: Any) -> str:
    if type(v) is int and v.bit_length() > 64:
        return f"an int of {v.bit_length()} bits"
    if isinstance(v, int | float | bool | type(None)):
        return f"{type(v).__name__} {v!r}"
    if isinstance(v, str | bytes):
        return f"{type(v).__name__} {v[:40]!r}" + (f" ({len(v)} long)" if len(v) > 40 else "")
    return f"a {type(v).__name__}" + (f" of {len(v)}" if isinstance(v, list | tuple | dict) else "")


def _relation_problems(m: Message) -> list[str]:
    """What no single field shows: ranks below sizes, per-region lists as long as the regions."""
    if isinstance(m, TransferStatus) and m.status == "done" and m.error:
        return ["a done transfer carries no error text"]
    if not isinstance(m, Handshake):
        return []
    problems = []
    if m.tp_rank >= m.tp_size or m.pp_rank >= m.pp_size:
        problems.append(f"rank tp {m.tp_rank}/{m.tp_size} pp {m.pp_rank}/{m.pp_size}")
    if m.stage_layers[0] > m.stage_layers[1]:
        problems.append(f"stage_layers {list(m.stage_layers)} is not [first, end)")
    for name in ("region_addrs", "region_bytes", "region_devices"):
        n = len(getattr(m, name))
        if n and n != len(m.regions):
            problems.append(f"{n} {name} for {len(m.regions)} regions")
    return problems
