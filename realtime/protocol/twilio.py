"""Twilio Media Streams (bidirectional ``<Connect><Stream>``), without I/O.

Twilio sends JSON text frames: ``connected``, ``start`` (streamSid, callSid, mediaFormat
``audio/x-mulaw`` 8000 Hz mono), ``media`` (base64 μ-law, 20 ms per message, with
``sequenceNumber`` / ``chunk`` / ``timestamp``), ``mark`` (echo of a mark we sent, once the audio
before it has played), ``dtmf`` and ``stop``. We send ``media`` (base64 μ-law 8 kHz, the
streamSid), ``mark`` (named; Twilio echoes it when playback reaches it) and ``clear`` (drop the
audio Twilio has buffered: the caller hears a barge-in at once).

``TwilioStream.receive`` validates one message against the stream state and returns a typed event;
``MulawFramer`` cuts outgoing μ-law into 160-byte (20 ms) frames.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from realtime.errors import DecodeError, ProtocolError, StateError, UnsupportedError

RATE = 8000
FRAME_BYTES = 160  # 20 ms of 8 kHz μ-law: what Twilio sends and expects
ULAW_SILENCE = 0xFF  # μ-law code of 0 (the positive zero)
MAX_PAYLOAD = 64_000  # bytes of audio in one inbound media message (Twilio sends 160)


class StreamState(str, Enum):
    CONNECTING = "connecting"  # before 'start'
    STREAMING = "streaming"
    STOPPED = "stopped"


@dataclass(frozen=True)
class Connected:
    protocol: str
    version: str


@dataclass(frozen=True)
class Start:
    stream_sid: str
    call_sid: str
    account_sid: str
    tracks: tuple[str, ...]
    encoding: str
    sample_rate: int
    channels: int
    custom_parameters: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Media:
    payload: bytes  # μ-law 8 kHz
    track: str
    chunk: int | None
    timestamp_ms: int | None
    sequence_number: int | None


@dataclass(frozen=True)
class Mark:
    name: str


@dataclass(frozen=True)
class Dtmf:
    digit: str


@dataclass(frozen=True)
class Stop:
    call_sid: str | None


Event = Connected | Start | Media | Mark | Dtmf | Stop


def _int(value: Any) -> int | None:
    """Twilio sends numbers as strings ("sequenceNumber": "3")."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def _obj(msg: dict[str, Any], name: str) -> dict[str, Any]:
    v = msg.get(name)
    if not isinstance(v, dict):
        raise ProtocolError(f"'{msg.get('event')}' needs the object '{name}'", code="missing_field")
    return v


def _str(obj: dict[str, Any], name: str, required: bool = True) -> str | None:
    v = obj.get(name)
    if isinstance(v, str) and v:
        return v
    if required:
        raise ProtocolError(f"field '{name}' must be a non-empty string", code="missing_field")
    return None


class TwilioStream:
    """One Media Stream: validates Twilio's messages in order; remembers the streamSid."""

    def __init__(self) -> None:
        self.state = StreamState.CONNECTING
        self.stream_sid: str | None = None
        self.call_sid: str | None = None
        self.last_sequence: int | None = None
        self.media_in = 0  # inbound media messages accepted
        self.bytes_in = 0

    def receive(self, msg: dict[str, Any]) -> Event:
        kind = msg.get("event")
        if not isinstance(kind, str):
            raise ProtocolError("a Twilio message needs a string 'event'", code="missing_field")
        if self.state is StreamState.STOPPED:
            raise StateError(f"'{kind[:20]}' after 'stop'")
        seq = _int(msg.get("sequenceNumber"))
        if kind == "connected":
            return Connected(str(msg.get("protocol", "")), str(msg.get("version", "")))
        if kind == "start":
            if self.state is not StreamState.CONNECTING:
                raise StateError("'start' sent twice")
            st = _obj(msg, "start")
            sid = _str(msg, "streamSid", required=False) or _str(st, "streamSid")
            fmt = st.get("mediaFormat") or {}
            if not isinstance(fmt, dict):
                raise ProtocolError("'mediaFormat' must be an object", code="bad_field")
            enc = fmt.get("encoding", "audio/x-mulaw")
            rate = _int(fmt.get("sampleRate", RATE))
            ch = _int(fmt.get("channels", 1))
            if enc != "audio/x-mulaw" or rate != RATE or ch != 1:
                raise UnsupportedError(f"media format {str(enc)[:20]} {rate} Hz x{ch} is not supported; "
                                       "Twilio streams audio/x-mulaw 8000 Hz mono")
            tracks = st.get("tracks") or ["inbound"]
            params = st.get("customParameters") or {}
            self.state = StreamState.STREAMING
            self.stream_sid = sid
            self.call_sid = _str(st, "callSid", required=False)
            self.last_sequence = seq
            return Start(sid, self.call_sid or "", _str(st, "accountSid", required=False) or "",
                         tuple(str(t) for t in tracks) if isinstance(tracks, list) else ("inbound",),
                         enc, RATE, 1,
                         {str(k): str(v) for k, v in params.items()} if isinstance(params, dict) else {})
        if kind not in ("media", "mark", "dtmf", "stop"):
            raise ProtocolError(f"unknown Twilio event '{kind[:30]}'", code="unknown_type")
        if self.state is StreamState.CONNECTING:
            raise StateError(f"'{kind}' before 'start'")
        sid = msg.get("streamSid")
        if sid is not None and sid != self.stream_sid:
            raise ProtocolError("streamSid does not match this stream", code="bad_field")
        if seq is not None:
            self.last_sequence = seq
        if kind == "media":
            media = _obj(msg, "media")
            raw = media.get("payload")
            if not isinstance(raw, str):
                raise ProtocolError("'media.payload' must be a base64 string", code="missing_field")
            if len(raw) > MAX_PAYLOAD * 4 // 3 + 4:
                raise ProtocolError("media payload too large", code="too_large")
            try:
                payload = base64.b64decode(raw, validate=True)
            except (binascii.Error, ValueError):
                raise DecodeError("'media.payload' is not valid base64") from None
            track = media.get("track", "inbound")
            if track not in ("inbound", "outbound"):
                raise ProtocolError("media.track must be inbound or outbound", code="bad_field")
            if track == "inbound":
                self.media_in += 1
                self.bytes_in += len(payload)
            return Media(payload, track, _int(media.get("chunk")), _int(media.get("timestamp")), seq)
        if kind == "mark":
            mark = _obj(msg, "mark")
            return Mark(_str(mark, "name"))  # type: ignore[arg-type]
        if kind == "dtmf":
            d = _obj(msg, "dtmf")
            digit = _str(d, "digit")
            assert digit is not None
            if len(digit) != 1 or digit not in "0123456789*#ABCD":
                raise ProtocolError("dtmf.digit must be one key", code="bad_field")
            return Dtmf(digit)
        self.state = StreamState.STOPPED
        stop = msg.get("stop") if isinstance(msg.get("stop"), dict) else {}
        return Stop(_str(stop, "callSid", required=False))

    # ---- outbound (server -> Twilio) ----
    def media(self, payload: bytes) -> dict[str, Any]:
        assert self.stream_sid is not None, "media before start"
        return {"event": "media", "streamSid": self.stream_sid,
                "media": {"payload": base64.b64encode(payload).decode("ascii")}}

    def mark(self, name: str) -> dict[str, Any]:
        assert self.stream_sid is not None, "mark before start"
        return {"event": "mark", "streamSid": self.stream_sid, "mark": {"name": name}}

    def clear(self) -> dict[str, Any]:
        assert self.stream_sid is not None, "clear before start"
        return {"event": "clear", "streamSid": self.stream_sid}


class MulawFramer:
    """μ-law bytes of any length in → whole 160-byte (20 ms) frames out; ``flush`` pads the tail
    with silence so every frame Twilio gets is exactly 20 ms."""

    def __init__(self, frame: int = FRAME_BYTES) -> None:
        self.frame = frame
        self.buf = bytearray()

    def push(self, data: bytes) -> list[bytes]:
        self.buf += data
        n = len(self.buf) // self.frame * self.frame
        out = [bytes(self.buf[i:i + self.frame]) for i in range(0, n, self.frame)]
        del self.buf[:n]
        return out

    def flush(self) -> list[bytes]:
        if not self.buf:
            return []
        out = bytes(self.buf) + bytes([ULAW_SILENCE]) * (self.frame - len(self.buf))
        self.buf.clear()
        return [out]

    def reset(self) -> None:
        self.buf.clear()
