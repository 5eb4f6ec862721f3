"""The /v1/tts session protocol as a state machine: messages in, typed events out. No I/O.

States::

    AWAIT_START --start--> STREAMING --stop--> STOPPING --(audio drained)--> DONE
                               |  ^text/flush                 |
                               +--cancel--> CANCELLED <-------+
    any state --protocol error--> FAILED
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from realtime.errors import ProtocolError, StateError, UnsupportedError
from realtime.protocol.messages import AUDIO_FORMATS, SAMPLE_RATES

MAX_TEXT_CHARS = 20_000  # per text message; pending text is bounded separately by the session
MIN_CHUNK_MS, MAX_CHUNK_MS = 10, 2000


class TTSState(str, Enum):
    AWAIT_START = "await_start"
    STREAMING = "streaming"
    STOPPING = "stopping"
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass(frozen=True)
class StartParams:
    voice: str | None
    format: str
    sample_rate: int
    chunk_ms: int | None
    reference_audio: bytes | None = None
    reference_text: str | None = None
    speaker: int = 0
    temperature: float | None = None
    seed: int | None = None
    speed: float = 1.0


@dataclass(frozen=True)
class Start:
    params: StartParams


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Flush:
    pass


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Cancel:
    pass


Event = Start | Text | Flush | Stop | Cancel


def _field(msg: dict[str, Any], name: str, kind: type | tuple[type, ...], required: bool = False) -> Any:
    if name not in msg or msg[name] is None:
        if required:
            raise ProtocolError(f"'{msg.get('type')}' needs the field '{name}'", code="missing_field")
        return None
    value = msg[name]
    # bool is an int in Python; a JSON true is never a sample rate
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ProtocolError(f"field '{name}' has the wrong type", code="bad_field")
    if not isinstance(value, kind):
        raise ProtocolError(f"field '{name}' has the wrong type", code="bad_field")
    return value


def parse_start(msg: dict[str, Any], default_rate: int) -> StartParams:
    """Validate a start message (shared by /v1/tts and the HTTP speech endpoint)."""
    fmt = _field(msg, "format", str) or "pcm_s16le"
    if fmt not in AUDIO_FORMATS:
        raise UnsupportedError(f"format '{fmt}' is not supported; use one of {', '.join(AUDIO_FORMATS)}")
    rate = _field(msg, "sample_rate", int) or default_rate
    if rate not in SAMPLE_RATES:
        raise UnsupportedError(f"sample_rate {rate} is not supported; use one of {SAMPLE_RATES}")
    chunk_ms = _field(msg, "chunk_ms", int)
    if chunk_ms is not None and not MIN_CHUNK_MS <= chunk_ms <= MAX_CHUNK_MS:
        raise ProtocolError(f"chunk_ms must be between {MIN_CHUNK_MS} and {MAX_CHUNK_MS}", code="bad_field")
    ref_audio = ref_text = None
    ref = _field(msg, "reference", dict)
    if ref is not None:
        ref_audio = _field(ref, "audio", bytes, required=True)
        ref_text = _field(ref, "text", str, required=True)
    speaker = _field(msg, "speaker", int) or 0
    temperature = _field(msg, "temperature", (int, float))
    seed = _field(msg, "seed", int)
    speed = _field(msg, "speed", (int, float))
    if speed is not None and not 0.25 <= speed <= 4.0:
        raise ProtocolError("speed must be between 0.25 and 4.0", code="bad_field")
    return StartParams(voice=_field(msg, "voice", str), format=fmt, sample_rate=rate, chunk_ms=chunk_ms,
                       reference_audio=ref_audio, reference_text=ref_text, speaker=speaker,
                       temperature=None if temperature is None else float(temperature), seed=seed,
                       speed=1.0 if speed is None else float(speed))


class TTSProtocol:
    """Validates client messages against the session state and turns them into events."""

    def __init__(self, default_rate: int = 24000) -> None:
        self.state = TTSState.AWAIT_START
        self.default_rate = default_rate

    def receive(self, msg: dict[str, Any]) -> Event:
        kind = msg.get("type")
        if not isinstance(kind, str):
            raise ProtocolError("a message needs a string 'type'", code="missing_field")
        if self.state in (TTSState.DONE, TTSState.CANCELLED, TTSState.FAILED):
            raise StateError(f"'{kind}' after the session ended (state {self.state.value})")
        if kind == "start":
            if self.state is not TTSState.AWAIT_START:
                raise StateError(f"'start' sent twice (state {self.state.value})")
            params = parse_start(msg, self.default_rate)
            self.state = TTSState.STREAMING
            return Start(params)
        if kind not in ("text", "flush", "stop", "cancel"):
            raise ProtocolError(f"unknown message type '{kind[:40]}'", code="unknown_type")
        if self.state is TTSState.AWAIT_START:
            raise StateError(f"'{kind}' before 'start' (state {self.state.value})")
        if kind == "cancel":
            self.state = TTSState.CANCELLED
            return Cancel()
        if self.state is TTSState.STOPPING:
            raise StateError(f"'{kind}' after 'stop' (state {self.state.value})")
        if kind == "text":
            text = _field(msg, "text", str, required=True)
            if len(text) > MAX_TEXT_CHARS:
                raise ProtocolError(f"a text message may hold at most {MAX_TEXT_CHARS} characters",
                                    code="too_long")
            return Text(text)
        if kind == "flush":
            return Flush()
        self.state = TTSState.STOPPING
        return Stop()

    def finished(self) -> None:
        """All audio after 'stop' has been sent."""
        if self.state is TTSState.STOPPING:
            self.state = TTSState.DONE

    def fail(self) -> None:
        self.state = TTSState.FAILED
