"""Frame layout and the msgpack codec.

A frame is::

    header  12 bytes   magic u16 | version u16 | body_len u32 | payload_len u32  (little endian)
    body    body_len   a msgpack map (request or reply)
    payload payload_len raw bytes (bulk data: never packed through msgpack)

Request body: ``{"k": 0, "i": id, "m": method, "a": {args}}``.
Reply body:   ``{"k": 1, "i": id, "r": result}`` or ``{"k": 1, "i": id, "e": [errno, msg]}``.

Limits are checked on the header, before anything is allocated.
"""

from __future__ import annotations

import errno
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from shufflefs.rpc.errors import FsError

MAGIC = 0x5346  # "SF"
VERSION = 1
HEADER = struct.Struct("<HHII")
HEADER_SIZE = HEADER.size

KIND_REQUEST = 0
KIND_REPLY = 1


@dataclass(frozen=True)
class Limits:
    """Per-connection limits, enforced before allocation."""

    max_body: int = 1 << 20  # msgpack part of a frame
    max_payload: int = 64 << 20  # raw bulk part of a frame
    max_inflight: int = 256  # requests being served per connection
    frame_timeout: float = 30.0  # seconds to receive a frame once its header arrived
    send_timeout: float = 30.0  # seconds to hand one frame to the kernel


DEFAULT_LIMITS = Limits()


def pack_header(body_len: int, payload_len: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, body_len, payload_len)


def unpack_header(data: bytes | bytearray | memoryview, limits: Limits) -> tuple[int, int]:
    """Return (body_len, payload_len); raise FsError for a bad or oversize header."""
    magic, version, body_len, payload_len = HEADER.unpack(data)
    if magic != MAGIC:
        raise FsError(errno.EPROTO, f"bad frame magic 0x{magic:04x}")
    if version != VERSION:
        raise FsError(errno.EPROTO, f"unsupported protocol version {version}")
    if body_len == 0:
        raise FsError(errno.EBADMSG, "empty frame body")
    if body_len > limits.max_body:
        raise FsError(errno.EMSGSIZE, f"frame body {body_len} > limit {limits.max_body}")
    if payload_len > limits.max_payload:
        raise FsError(errno.EMSGSIZE, f"frame payload {payload_len} > limit {limits.max_payload}")
    return body_len, payload_len


def pack_body(obj: Any) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


def unpack_body(data: bytes | bytearray | memoryview) -> dict[Any, Any]:
    """Decode a frame body; anything but a well-formed map is EBADMSG."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise FsError(errno.EBADMSG, f"malformed msgpack body: {type(exc).__name__}") from None
    if not isinstance(obj, dict):
        raise FsError(errno.EBADMSG, "frame body is not a map")
    return obj


def request_body(
    call_id: int, method: str, args: dict[str, Any], after: int | None = None
) -> bytes:
    """*after*: run the call only once the server has applied its log that
    far (docs/protocol.md, "Log positions")."""
    body = {"k": KIND_REQUEST, "i": call_id, "m": method, "a": args}
    if after is not None:
        body["s"] = after
    return pack_body(body)


def reply_body(call_id: int, result: Any, position: int | None = None) -> bytes:
    """*position*: how far the server has applied its log (if it keeps one)."""
    body = {"k": KIND_REPLY, "i": call_id, "r": result}
    if position is not None:
        body["s"] = position
    return pack_body(body)


def error_body(call_id: int, error: FsError) -> bytes:
    return pack_body({"k": KIND_REPLY, "i": call_id, "e": error.to_wire()})
