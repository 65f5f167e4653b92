"""Control messages between P/D peers: a fixed header, then a strictly checked JSON body.

Frame: `!4sBBHI` = magic b"SAPD", version, message type, reserved (0), body length; then exactly
body-length bytes of UTF-8 JSON holding one object. Why this shape:

- The header is a fixed struct, so framing, version and type are checked, and the total length
  compared with the declared one, before any body byte is parsed.
- The body is JSON because control messages are few and small (a handshake per peer, a request
  and a status per room): parse cost does not matter, a message reads in a log, and the stdlib
  parser only ever builds dicts, lists, strings and numbers. Nothing is unpickled or evaluated,
  so a peer's bytes cannot run code. Floats, NaN, duplicate keys, unknown or missing fields, a
  bool where an int belongs, out-of-range numbers and over-long strings or lists are refused.
- Binary blobs (the transfer engine's agent metadata) travel as base64 with a size cap.

`decode` raises :class:`WireError` for anything else and never another exception; `encode`
runs the same checks, so it never emits what `decode` would refuse.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sgl_atom.disagg.regions import RegionDesc, RegionKind

MAGIC = b"SAPD"
VERSION = 3  # 2: Handshake.region_devices; 3: Heartbeat
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
    """

    role: str  # "producer" or "consumer"
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    stage_layers: tuple[int, int]
    regions: tuple[RegionDesc, ...]
    region_addrs: tuple[int, ...]
    agent_name: str
    agent_metadata: bytes
    region_bytes: tuple[int, ...] = ()
    aux: tuple[tuple[int, int, int], ...] = ()
    status_host: str = ""
    status_port: int = 0
    region_devices: tuple[int, ...] = ()


@dataclass(frozen=True)
class TransferRequest:
    """A consumer rank asks for room `room`'s pages; it holds heads [head_start, +head_count).

    aux_index: the consumer's metadata row for the request (-1: none). agent_name: the
    consumer's transfer agent (its handshake). peers: how many consumer ranks ask this producer
    rank for the room (the room is ready once all of them asked).
    """

    room: int
    consumer_rank: int
    page_ids: tuple[int, ...]
    head_start: int
    head_count: int
    aux_index: int = -1
    agent_name: str = ""
    peers: int = 1


@dataclass(frozen=True)
class TransferStatus:
    """How a room's transfer ended: status "done" (error empty) or "failed" (error says why)."""

    room: int
    status: str
    error: str = ""

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

    agent_name: str
    endpoint: str
    reply: bool = False
    rooms: tuple[int, ...] = ()


Message = Handshake | TransferRequest | TransferStatus | Heartbeat
TYPE_CODES: dict[type, int] = {Handshake: 1, TransferRequest: 2, TransferStatus: 3, Heartbeat: 4}
_BY_CODE = {code: cls for cls, code in TYPE_CODES.items()}


def encode(msg: Message) -> bytes:
    """One frame for `msg`; WireError if a field is out of bounds."""
    code = TYPE_CODES.get(type(msg))
    if code is None:
        raise WireError(f"not a control message: {type(msg).__name__}")
    try:
        obj = _TO_JSON[type(msg)](msg)
    except (TypeError, AttributeError) as e:
        raise WireError(f"{type(msg).__name__}: a field has the wrong type ({e})") from None
    _from_json(type(msg), obj)  # the checks decode applies
    body = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    if len(body) > MAX_BODY:
        raise WireError(f"{type(msg).__name__} body is {len(body)} bytes, cap {MAX_BODY}")
    return HEADER.pack(MAGIC, VERSION, code, 0, len(body)) + body


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


# -- field checks: each takes the JSON value and a path, returns the Python value


Check = Callable[[Any, str], Any]


def _int(lo: int, hi: int) -> Check:
    def check(v: Any, path: str) -> int:
        if type(v) is not int or not lo <= v <= hi:
            raise WireError(f"{path}: expected an int in [{lo}, {hi}], got {_show(v)}")
        return v

    return check


def _str(max_len: int, choices: tuple[str, ...] | None = None) -> Check:
    def check(v: Any, path: str) -> str:
        if type(v) is not str or len(v) > max_len:
            raise WireError(f"{path}: expected a string of at most {max_len}, got {_show(v)}")
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise WireError(f"{path}: string is not valid Unicode") from None
        if choices is not None and v not in choices:
            raise WireError(f"{path}: {v!r} is not one of {', '.join(choices)}")
        return v

    return check


def _bool(v: Any, path: str) -> bool:
    if type(v) is not bool:
        raise WireError(f"{path}: expected a bool, got {_show(v)}")
    return v


def _optional(inner: Check) -> Check:
    return lambda v, path: None if v is None else inner(v, path)


def _list(item: Check, max_len: int, min_len: int = 0) -> Check:
    def check(v: Any, path: str) -> tuple:
        if type(v) is not list or not min_len <= len(v) <= max_len:
            raise WireError(
                f"{path}: expected a list of {min_len}..{max_len} items, got {_show(v)}"
            )
        return tuple(item(x, f"{path}[{i}]") for i, x in enumerate(v))

    return check


def _blob(max_bytes: int) -> Check:
    def check(v: Any, path: str) -> bytes:
        if type(v) is not str or len(v) > 4 * ((max_bytes + 2) // 3):
            raise WireError(f"{path}: expected base64 of at most {max_bytes} bytes, got {_show(v)}")
        try:
            return base64.b64decode(v.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError):
            raise WireError(f"{path}: not valid base64") from None

    return check


def _object(fields: dict[str, Check]) -> Check:
    def check(v: Any, path: str) -> dict[str, Any]:
        if type(v) is not dict:
            raise WireError(f"{path}: expected an object, got {_show(v)}")
        if set(v) != set(fields):
            extra, missing = sorted(set(v) - set(fields)), sorted(set(fields) - set(v))
            raise WireError(f"{path}: unknown fields {extra[:5]}, missing fields {missing}")
        return {k: c(v[k], f"{path}.{k}") for k, c in fields.items()}

    return check


def _show(v: Any) -> str:
    if type(v) is int and v.bit_length() > 64:
        return f"an int of {v.bit_length()} bits"
    if isinstance(v, int | float | bool | type(None)):
        return f"{type(v).__name__} {v!r}"
    if isinstance(v, str | bytes):
        return f"{type(v).__name__} {v[:40]!r}" + (f" ({len(v)} long)" if len(v) > 40 else "")
    return f"a {type(v).__name__}" + (f" of {len(v)}" if isinstance(v, list | dict) else "")


_RANK = _int(0, 1023)
_SIZE = _int(1, 1024)
_LAYER = _int(0, (1 << 16) - 1)
_REGION = _object(
    {
        "kind": _str(32, tuple(k.value for k in RegionKind)),
        "layer": _LAYER,
        "dtype": _str(32),
        "head_dim": _int(1, 1 << 16),
        "heads_per_rank": _int(1, 1 << 12),
        "total_heads": _int(1, 1 << 12),
        "tokens_per_page": _int(1, 1 << 16),
        "runs_per_page": _optional(_int(1, 1 << 16)),
        "replicated": _bool,
        "unit_bytes": _int(1, 1 << 20),
    }
)
_FIELDS: dict[type, dict[str, Check]] = {
    Handshake: {
        "role": _str(16, ("producer", "consumer")),
        "tp_rank": _RANK,
        "tp_size": _SIZE,
        "pp_rank": _RANK,
        "pp_size": _SIZE,
        "stage_layers": _list(_int(0, 1 << 16), 2, 2),
        "regions": _list(_REGION, MAX_REGIONS),
        "region_addrs": _list(_int(0, U64), MAX_REGIONS),
        "agent_name": _str(MAX_NAME),
        "agent_metadata": _blob(MAX_AGENT_METADATA),
        "region_bytes": _list(_int(0, U64), MAX_REGIONS),
        "aux": _list(_list(_int(0, U64), 3, 3), MAX_AUX),
        "status_host": _str(MAX_NAME),
        "status_port": _int(0, 65535),
        "region_devices": _list(_int(-1, 1023), MAX_REGIONS),
    },
    TransferRequest: {
        "room": _int(0, U64),
        "consumer_rank": _RANK,
        "page_ids": _list(_int(0, (1 << 31) - 1), MAX_PAGE_IDS),
        "head_start": _int(0, (1 << 12) - 1),
        "head_count": _int(1, 1 << 12),
        "aux_index": _int(-1, (1 << 31) - 1),
        "agent_name": _str(MAX_NAME),
        "peers": _int(1, 1024),
    },
    TransferStatus: {
        "room": _int(0, U64),
        "status": _str(8, ("done", "failed")),
        "error": _str(MAX_ERROR),
    },
    Heartbeat: {
        "agent_name": _str(MAX_NAME),
        "endpoint": _str(MAX_NAME),
        "reply": _bool,
        "rooms": _list(_int(0, U64), MAX_ROOMS),
    },
}


def _from_json(cls: type, obj: Any) -> Message:
    v = _object(_FIELDS[cls])(obj, cls.__name__)
    if cls is Handshake:
        return _handshake(v)
    if cls is TransferStatus and v["status"] == "done" and v["error"]:
        raise WireError("TransferStatus: a done transfer carries no error text")
    return cls(**v)


def _handshake(v: dict[str, Any]) -> Handshake:
    problems = []
    if v["tp_rank"] >= v["tp_size"] or v["pp_rank"] >= v["pp_size"]:
        problems.append(f"rank tp {v['tp_rank']}/{v['tp_size']} pp {v['pp_rank']}/{v['pp_size']}")
    if v["stage_layers"][0] > v["stage_layers"][1]:
        problems.append(f"stage_layers {list(v['stage_layers'])} is not [first, end)")
    if v["region_addrs"] and len(v["region_addrs"]) != len(v["regions"]):
        problems.append(f"{len(v['region_addrs'])} region_addrs for {len(v['regions'])} regions")
    if v["region_bytes"] and len(v["region_bytes"]) != len(v["regions"]):
        problems.append(f"{len(v['region_bytes'])} region_bytes for {len(v['regions'])} regions")
    if v["region_devices"] and len(v["region_devices"]) != len(v["regions"]):
        problems.append(
            f"{len(v['region_devices'])} region_devices for {len(v['regions'])} regions"
        )
    if problems:
        raise WireError("Handshake: " + "; ".join(problems))
    try:
        regions = tuple(_region(r) for r in v["regions"])
    except ValueError as e:
        raise WireError(f"Handshake.regions: {str(e)[:300]}") from None
    return Handshake(**{**v, "regions": regions})


def _region(r: dict[str, Any]) -> RegionDesc:
    return RegionDesc(
        kind=RegionKind(r["kind"]),
        global_layer=r["layer"],
        dtype=r["dtype"],
        head_dim=r["head_dim"],
        heads_per_rank=r["heads_per_rank"],
        total_heads=r["total_heads"],
        tokens_per_page=r["tokens_per_page"],
        runs_per_page=r["runs_per_page"],
        replicated=r["replicated"],
        unit_bytes=r["unit_bytes"],
    )


def _region_json(r: RegionDesc) -> dict[str, Any]:
    return {
        "kind": r.kind.value,
        "layer": r.global_layer,
        "dtype": r.dtype,
        "head_dim": r.head_dim,
        "heads_per_rank": r.heads_per_rank,
        "total_heads": r.total_heads,
        "tokens_per_page": r.tokens_per_page,
        "runs_per_page": r.runs_per_page,
        "replicated": r.replicated,
        "unit_bytes": r.unit_bytes,
    }


def _handshake_json(m: Handshake) -> dict[str, Any]:
    if not isinstance(m.agent_metadata, bytes):
        raise WireError(f"Handshake.agent_metadata: expected bytes, got {_show(m.agent_metadata)}")
    return {
        "role": m.role,
        "tp_rank": m.tp_rank,
        "tp_size": m.tp_size,
        "pp_rank": m.pp_rank,
        "pp_size": m.pp_size,
        "stage_layers": list(m.stage_layers),
        "regions": [_region_json(r) for r in m.regions],
        "region_addrs": list(m.region_addrs),
        "agent_name": m.agent_name,
        "agent_metadata": base64.b64encode(m.agent_metadata).decode(),
        "region_bytes": list(m.region_bytes),
        "aux": [list(a) for a in m.aux],
        "status_host": m.status_host,
        "status_port": m.status_port,
        "region_devices": list(m.region_devices),
    }


_TO_JSON: dict[type, Callable[[Any], dict[str, Any]]] = {
    Handshake: _handshake_json,
    TransferRequest: lambda m: {
        "room": m.room,
        "consumer_rank": m.consumer_rank,
        "page_ids": list(m.page_ids),
        "head_start": m.head_start,
        "head_count": m.head_count,
        "aux_index": m.aux_index,
        "agent_name": m.agent_name,
        "peers": m.peers,
    },
    TransferStatus: lambda m: {"room": m.room, "status": m.status, "error": m.error},
    Heartbeat: lambda m: {
        "agent_name": m.agent_name,
        "endpoint": m.endpoint,
        "reply": m.reply,
        "rooms": list(m.rooms),
    },
}
