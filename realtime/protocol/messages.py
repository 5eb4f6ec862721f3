"""Typed wire messages shared by every endpoint (see docs/protocol.md)."""

from __future__ import annotations

from typing import Any, Literal, TypedDict

AudioFormat = Literal["pcm_s16le", "pcm_f32le", "mulaw", "alaw"]
AUDIO_FORMATS: tuple[str, ...] = ("pcm_s16le", "pcm_f32le", "mulaw", "alaw")
SAMPLE_RATES: tuple[int, ...] = (8000, 16000, 22050, 24000, 48000)


class ReadyMsg(TypedDict):
    type: Literal["ready"]
    session: str
    sample_rate: int
    format: str
    frame_samples: int


class AudioMsg(TypedDict):
    type: Literal["audio"]
    seq: int
    audio: bytes
    start_ms: float
    duration_ms: float


class DoneMsg(TypedDict):
    type: Literal["done"]
    stats: dict[str, Any]


class ErrorMsg(TypedDict):
    type: Literal["error"]
    code: str
    message: str


def ready(session: str, sample_rate: int, fmt: str, frame_samples: int, **extra: Any) -> dict[str, Any]:
    return {"type": "ready", "session": session, "sample_rate": sample_rate, "format": fmt,
            "frame_samples": frame_samples, **extra}


def audio(seq: int, data: bytes, start_ms: float, duration_ms: float) -> dict[str, Any]:
    return {"type": "audio", "seq": seq, "audio": data, "start_ms": round(start_ms, 3),
            "duration_ms": round(duration_ms, 3)}


def done(stats: dict[str, Any]) -> dict[str, Any]:
    return {"type": "done", "stats": stats}


def error(code: str, message: str) -> dict[str, Any]:
    return {"type": "error", "code": code, "message": message}
