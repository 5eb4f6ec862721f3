"""The /v1/asr session protocol as a state machine: messages in, typed events out. No I/O.

States::

    AWAIT_START --start--> STREAMING --stop--> STOPPING --(finals sent)--> DONE
                             |  ^ audio / finalize
    any state --protocol error--> FAILED

Client messages: ``start`` (sample_rate, format, language?, interim?, preview?, words?, task?, prompt?), ``audio`` (bytes of the
start's format, any length that is a whole number of samples), ``finalize`` (end the current
utterance now), ``stop`` (finalize, then the server sends ``done`` and closes 1000).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum
from typing import Any

from realtime.codecs.resample import BYTES_PER_SAMPLE
from realtime.errors import ProtocolError, StateError, UnsupportedError
from realtime.protocol.messages import AUDIO_FORMATS, SAMPLE_RATES


TASKS = ("transcribe", "translate")
MAX_PROMPT_CHARS = 2000  # (Whisper keeps a prompt's last 223 tokens: ~1,000 characters of English)


class ASRState(str, Enum):
    AWAIT_START = "await_start"
    STREAMING = "streaming"
    STOPPING = "stopping"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class ASRParams:
    sample_rate: int = 16000
    format: str = "pcm_s16le"
    language: str | None = None  # None: the model's default (English, or detected when multilingual)
    interim: bool = True  # send revisable partials
    preview: bool = False  # send final_preview (the likely final, when silence begins) and speech_resumed
    words: bool = False  # each final carries its words' times (one alignment pass a final)
    task: str = "transcribe"  # or "translate": English text from speech in another language
    prompt: str | None = None  # text before the speech (vocabulary, spelling, style): Whisper's initial prompt


@dataclass(frozen=True)
class Start:
    params: ASRParams


@dataclass(frozen=True)
class Audio:
    data: bytes


@dataclass(frozen=True)
class Finalize:
    pass


@dataclass(frozen=True)
class Stop:
    pass


Event = Start | Audio | Finalize | Stop


def _field(msg: dict[str, Any], name: str, kind: type) -> Any:
    if name not in msg or msg[name] is None:
        return None
    value = msg[name]
    # bool is an int in Python: a JSON true is never a sample rate
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ProtocolError(f"field '{name}' has the wrong type", code="bad_field")
    return value


def parse_start(msg: dict[str, Any], languages: Collection[str] | None = None) -> ASRParams:
    """Validate a start message. ``languages``: codes the model knows (None: any is passed on; only
    ``en``: an English-only model, which cannot translate)."""
    rate = _field(msg, "sample_rate", int) or 16000
    if rate not in SAMPLE_RATES:
        raise UnsupportedError(f"sample_rate {rate} is not supported; use one of {SAMPLE_RATES}")
    fmt = _field(msg, "format", str) or "pcm_s16le"
    if fmt not in AUDIO_FORMATS:
        raise UnsupportedError(f"format '{fmt[:20]}' is not supported; use one of {', '.join(AUDIO_FORMATS)}")
    lang = _field(msg, "language", str)
    if lang is not None:
        lang = lang.strip().lower()
        if languages is not None and lang not in languages:
            listed = ", ".join(sorted(languages)[:12])
            raise UnsupportedError(f"language '{lang[:12]}' is not supported by this model; use {listed}")
    interim = _field(msg, "interim", bool)
    preview = _field(msg, "preview", bool)
    words = _field(msg, "words", bool)
    task = _field(msg, "task", str) or "transcribe"
    if task not in TASKS:
        raise UnsupportedError(f"task '{task[:20]}' is not supported; use transcribe or translate")
    if task == "translate" and languages is not None and tuple(languages) == ("en",):
        raise UnsupportedError("this model is English-only: translation needs a multilingual Whisper")
    prompt = _field(msg, "prompt", str)
    if prompt is not None and len(prompt) > MAX_PROMPT_CHARS:
        raise ProtocolError(f"'prompt' may hold at most {MAX_PROMPT_CHARS} characters", code="too_long")
    prompt = (prompt or "").strip() or None
    return ASRParams(sample_rate=rate, format=fmt, language=lang, interim=True if interim is None else interim,
                     preview=bool(preview), words=bool(words), task=task, prompt=prompt)


class ASRProtocol:
    """Validates client messages against the session state and turns them into events."""

    def __init__(self, languages: Collection[str] | None = None) -> None:
        self.state = ASRState.AWAIT_START
        self.languages = languages
        self.params: ASRParams | None = None

    def receive(self, msg: dict[str, Any]) -> Event:
        kind = msg.get("type")
        if not isinstance(kind, str):
            raise ProtocolError("a message needs a string 'type'", code="missing_field")
        if self.state in (ASRState.DONE, ASRState.FAILED):
            raise StateError(f"'{kind[:40]}' after the session ended (state {self.state.value})")
        if kind == "start":
            if self.state is not ASRState.AWAIT_START:
                raise StateError(f"'start' sent twice (state {self.state.value})")
            self.params = parse_start(msg, self.languages)
            self.state = ASRState.STREAMING
            return Start(self.params)
        if kind not in ("audio", "finalize", "stop"):
            raise ProtocolError(f"unknown message type '{kind[:40]}'", code="unknown_type")
        if self.state is ASRState.AWAIT_START:
            raise StateError(f"'{kind}' before 'start' (state {self.state.value})")
        if self.state is ASRState.STOPPING:
            raise StateError(f"'{kind}' after 'stop' (state {self.state.value})")
        assert self.params is not None
        if kind == "audio":
            data = msg.get("audio")
            if isinstance(data, (bytearray, memoryview)):
                data = bytes(data)
            if not isinstance(data, bytes):
                raise ProtocolError("'audio' needs the bytes field 'audio'", code="missing_field")
            width = BYTES_PER_SAMPLE[self.params.format]
            if len(data) % width:
                raise ProtocolError(f"{self.params.format} audio must be a multiple of {width} bytes, "
                                    f"got {len(data)}", code="bad_audio")
            return Audio(data)
        if kind == "finalize":
            return Finalize()
        self.state = ASRState.STOPPING
        return Stop()

    def finished(self) -> None:
        """Every final after 'stop' has been sent."""
        if self.state is ASRState.STOPPING:
            self.state = ASRState.DONE

    def fail(self) -> None:
        self.state = ASRState.FAILED
