"""Frame encoding: msgpack maps in binary frames, JSON maps in text frames.

Sans-I/O: bytes (or str) in, a ``dict`` out, and back. JSON cannot carry bytes, so on text frames
binary fields (``audio``, ``image``) travel base64-encoded; the decoder turns them back into bytes
so the rest of the server never sees the difference.
"""

from __future__ import annotations

import base64
import binascii
import json
from enum import Enum
from typing import Any

import msgpack

from realtime.errors import DecodeError, FrameTooLarge

DEFAULT_MAX_FRAME = 1 << 20  # 1 MiB: ~30 s of 16 kHz s16 audio, far above any sane chunk
BINARY_FIELDS = frozenset({"audio", "image", "video"})


class WireFormat(str, Enum):
    MSGPACK = "msgpack"  # binary WebSocket frames
    JSON = "json"  # text WebSocket frames


def decode_frame(data: bytes | str, max_size: int = DEFAULT_MAX_FRAME) -> tuple[dict[str, Any], WireFormat]:
    """Parse one WebSocket frame into a message map; raise a typed error on anything else."""
    if len(data) > max_size:
        raise FrameTooLarge(f"frame of {len(data)} bytes is over the limit of {max_size}")
    if isinstance(data, str):
        try:
            msg = json.loads(data)
        except (json.JSONDecodeError, RecursionError):
            raise DecodeError("text frame is not valid JSON") from None
        fmt = WireFormat.JSON
    else:
        try:
            msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception:  # msgpack raises several unrelated types on garbage
            raise DecodeError("binary frame is not valid msgpack") from None
        fmt = WireFormat.MSGPACK
    if not isinstance(msg, dict):
        raise DecodeError("a frame must hold a map with a 'type' field")
    if fmt is WireFormat.JSON:
        for key in BINARY_FIELDS & msg.keys():
            if isinstance(msg[key], str):
                try:
                    msg[key] = base64.b64decode(msg[key], validate=True)
                except (binascii.Error, ValueError):
                    raise DecodeError(f"field '{key}' is not valid base64") from None
    return msg, fmt


def encode_frame(msg: dict[str, Any], fmt: WireFormat) -> bytes | str:
    """Serialise a message for the wire in the client's chosen format."""
    if fmt is WireFormat.MSGPACK:
        return msgpack.packb(msg, use_bin_type=True)
    out = {k: (base64.b64encode(v).decode("ascii") if isinstance(v, (bytes, bytearray, memoryview)) else v)
           for k, v in msg.items()}
    return json.dumps(out, separators=(",", ":"))
