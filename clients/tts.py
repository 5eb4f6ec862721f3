"""Python streaming client for /v1/tts.

    async with TTSStream("ws://127.0.0.1:8000/v1/tts") as s:
        await s.send_text("Hello there. ")
        await s.stop()
        async for chunk in s:
            play(chunk.audio)
    print(s.stats, s.gaps.stats())

The client runs the same simulated player as the server on the receiving side (``s.gaps``): it
starts when the first chunk arrives and counts an underrun whenever the next chunk is late.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import websockets

from realtime.codecs.resample import unpack_pcm
from realtime.protocol.frames import WireFormat, encode_frame
from realtime.clients.wire import ServerError, recv_message
from realtime.protocol.player import GapTracker

__all__ = ["TTSStream", "Chunk", "ServerError", "synthesize", "synthesize_async"]


@dataclass
class Chunk:
    seq: int
    audio: bytes
    start_ms: float
    duration_ms: float
    received_at: float

    def samples(self, fmt: str) -> np.ndarray:
        return unpack_pcm(self.audio, fmt)


def _headers(api_key: str | None) -> dict[str, str] | None:
    return {"Authorization": f"Bearer {api_key}"} if api_key else None


class TTSStream:
    def __init__(self, url: str, *, format: str = "pcm_s16le", sample_rate: int = 24000,
                 voice: str | None = None, chunk_ms: int | None = None, api_key: str | None = None,
                 wire: WireFormat = WireFormat.MSGPACK, reference: dict[str, Any] | None = None,
                 extra: dict[str, Any] | None = None, open_timeout: float = 30.0) -> None:
        self.url, self.api_key, self.wire = url, api_key, wire
        self.start_msg: dict[str, Any] = {"type": "start", "format": format, "sample_rate": sample_rate}
        if voice is not None:
            self.start_msg["voice"] = voice
        if chunk_ms is not None:
            self.start_msg["chunk_ms"] = chunk_ms
        if reference is not None:
            self.start_msg["reference"] = reference
        self.start_msg.update(extra or {})
        self.format = format
        self.open_timeout = open_timeout
        self.ws: Any = None
        self.ready: dict[str, Any] | None = None
        self.stats: dict[str, Any] | None = None
        self.gaps = GapTracker()
        self.first_text_at: float | None = None
        self.first_audio_at: float | None = None
        self.chunks = 0

    async def __aenter__(self) -> "TTSStream":
        # compression=None: audio frames barely compress; deflate only costs CPU on both ends.
        self.ws = await websockets.connect(self.url, additional_headers=_headers(self.api_key),
                                           open_timeout=self.open_timeout, max_size=None, compression=None)
        await self._send(self.start_msg)
        msg = await self._recv()
        if msg.get("type") != "ready":
            raise ServerError("protocol", f"expected ready, got {msg.get('type')}")
        self.ready = msg
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.ws.close()

    async def _send(self, msg: dict[str, Any]) -> None:
        await self.ws.send(encode_frame(msg, self.wire))

    async def _recv(self) -> dict[str, Any]:
        return await recv_message(self.ws, 1 << 30)

    async def send_text(self, text: str) -> None:
        if self.first_text_at is None:
            self.first_text_at = time.monotonic()
        await self._send({"type": "text", "text": text})

    async def flush(self) -> None:
        await self._send({"type": "flush"})

    async def stop(self) -> None:
        await self._send({"type": "stop"})

    async def cancel(self) -> None:
        await self._send({"type": "cancel"})

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        while True:
            msg = await self._recv()
            kind = msg.get("type")
            if kind == "done":
                self.stats = msg.get("stats", {})
                return
            if kind != "audio":
                continue
            now = time.monotonic()
            if self.first_audio_at is None:
                self.first_audio_at = now
            if msg["seq"] != self.chunks:
                raise ServerError("protocol", f"chunk seq {msg['seq']} where {self.chunks} was due")
            self.chunks += 1
            self.gaps.on_chunk(now, msg["duration_ms"] / 1000.0)
            yield Chunk(msg["seq"], msg["audio"], msg["start_ms"], msg["duration_ms"], now)

    @property
    def ttfa_ms(self) -> float | None:
        if self.first_text_at is None or self.first_audio_at is None:
            return None
        return (self.first_audio_at - self.first_text_at) * 1000.0


async def synthesize_async(url: str, text: str, *, sample_rate: int = 24000, api_key: str | None = None,
                           **kw: Any) -> tuple[np.ndarray, dict[str, Any]]:
    async with TTSStream(url, format="pcm_f32le", sample_rate=sample_rate, api_key=api_key, **kw) as s:
        await s.send_text(text)
        await s.stop()
        parts = [c.samples("pcm_f32le") async for c in s]
    audio = np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)
    stats = dict(s.stats or {})
    stats["client_ttfa_ms"] = s.ttfa_ms
    stats["client_gaps"] = s.gaps.stats()
    return audio, stats


def synthesize(url: str, text: str, **kw: Any) -> tuple[np.ndarray, dict[str, Any]]:
    """Blocking helper: the whole utterance as float32 samples, plus the server's stats."""
    return asyncio.run(synthesize_async(url, text, **kw))
