"""A mic-less client for the voice agent over /v1/realtime (the OpenAI Realtime event schema):
feed PCM, receive PCM and events. Only ``websockets`` and numpy are needed.

    async with AgentStream("ws://127.0.0.1:8000/v1/realtime") as agent:
        await agent.send_pcm(float32_24k)
        async for ev in agent.events():
            if ev["type"] == "response.output_audio.delta":
                play(ev["pcm"])  # float32 at agent.sample_rate
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

RATE = 24000  # audio/pcm on the OpenAI Realtime API is 16-bit at 24 kHz


class AgentStream:
    def __init__(self, url: str = "ws://127.0.0.1:8000/v1/realtime", *, api_key: str | None = None,
                 instructions: str | None = None, voice: str | None = None, max_output_tokens: int | None = None,
                 turn_detection: dict[str, Any] | None = None) -> None:
        self.url = url
        self.api_key = api_key
        self.sample_rate = RATE
        self.session_update: dict[str, Any] = {"type": "realtime"}
        if instructions is not None:
            self.session_update["instructions"] = instructions
        if max_output_tokens is not None:
            self.session_update["max_output_tokens"] = max_output_tokens
        audio: dict[str, Any] = {"input": {"format": {"type": "audio/pcm", "rate": RATE}},
                                 "output": {"format": {"type": "audio/pcm", "rate": RATE}}}
        if voice is not None:
            audio["output"]["voice"] = voice
        if turn_detection is not None:
            audio["input"]["turn_detection"] = turn_detection
        self.session_update["audio"] = audio
        self.ws: Any = None
        self.session: dict[str, Any] | None = None

    async def __aenter__(self) -> "AgentStream":
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> dict[str, Any]:
        import websockets

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        self.ws = await websockets.connect(self.url, additional_headers=headers, max_size=1 << 24)
        first = json.loads(await self.ws.recv())
        if first.get("type") != "session.created":
            raise RuntimeError(f"server: {first.get('error', first)}")
        await self.send({"type": "session.update", "session": self.session_update})
        while True:
            ev = json.loads(await self.ws.recv())
            if ev["type"] == "session.updated":
                self.session = ev["session"]
                return ev["session"]
            if ev["type"] == "error":
                raise RuntimeError(f"server: {ev['error'].get('code')}: {ev['error'].get('message')}")

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
            self.ws = None

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(event))

    async def send_pcm(self, pcm: np.ndarray | bytes) -> None:
        """float32 [-1, 1] (or s16le bytes) at 24 kHz."""
        if not isinstance(pcm, bytes):
            x = np.clip(np.asarray(pcm, np.float32), -1.0, 1.0)
            pcm = np.round(x * 32767.0).astype("<i2").tobytes()
        await self.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode("ascii")})

    async def commit(self) -> None:
        await self.send({"type": "input_audio_buffer.commit"})

    async def create_response(self, **response: Any) -> None:
        await self.send({"type": "response.create", "response": response} if response else {"type": "response.create"})

    async def cancel(self) -> None:
        await self.send({"type": "response.cancel"})

    async def truncate(self, item_id: str, audio_end_ms: int) -> None:
        await self.send({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                         "audio_end_ms": int(audio_end_ms)})

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Server events as dicts; audio deltas also carry ``pcm`` (float32 at 24 kHz)."""
        async for frame in self.ws:
            ev = json.loads(frame)
            if ev.get("type") == "response.output_audio.delta":
                raw = base64.b64decode(ev["delta"])
                ev["pcm"] = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
            yield ev


@dataclass
class Conversation:
    audio: np.ndarray  # the agent's reply, float32
    sample_rate: int
    transcript: str
    user_transcript: str
    metrics: dict[str, Any] | None
    events: list[str] = field(default_factory=list)


async def converse_wav(url: str, audio: np.ndarray, rate: int, *, api_key: str | None = None,
                       instructions: str | None = None, max_output_tokens: int | None = None,
                       chunk_ms: int = 40, timeout_s: float = 60.0) -> Conversation:
    """Say ``audio`` (float32 mono at ``rate``) at real-time pace, then keep sending silence (a
    live microphone) until the agent's reply is done. Returns the reply audio and metrics."""
    from realtime.codecs.resample import resample

    x = audio if rate == RATE else resample(np.asarray(audio, np.float32), rate, RATE)
    n = RATE * chunk_ms // 1000
    replies: list[np.ndarray] = []
    result: dict[str, Any] = {"transcript": "", "user": "", "metrics": None}
    kinds: list[str] = []
    async with AgentStream(url, api_key=api_key, instructions=instructions,
                           max_output_tokens=max_output_tokens) as agent:
        done = asyncio.Event()

        async def mic() -> None:
            t0 = time.monotonic()
            i = 0
            while not done.is_set():
                piece = x[i:i + n] if i < len(x) else np.zeros(n, np.float32)
                if len(piece) < n:
                    piece = np.concatenate([piece, np.zeros(n - len(piece), np.float32)])
                await agent.send_pcm(piece)
                i += n
                await asyncio.sleep(max(0.0, t0 + i / RATE - time.monotonic()))

        async def listen() -> None:
            async for ev in agent.events():
                kind = ev["type"]
                kinds.append(kind)
                if kind == "response.output_audio.delta":
                    replies.append(ev["pcm"])
                elif kind == "conversation.item.input_audio_transcription.completed":
                    result["user"] = ev.get("transcript", "")
                elif kind == "error":
                    raise RuntimeError(f"server: {ev['error'].get('code')}: {ev['error'].get('message')}")
                elif kind == "response.done":
                    resp = ev["response"]
                    result["metrics"] = resp.get("realtime_metrics")
                    out = resp.get("output") or []
                    if out and out[0].get("content"):
                        result["transcript"] = out[0]["content"][0].get("transcript") or ""
                    if replies:
                        done.set()
                        return
            raise RuntimeError("the server closed the connection before replying")

        sender = asyncio.create_task(mic())
        try:
            await asyncio.wait_for(listen(), timeout_s)
        finally:
            done.set()
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
    pcm = np.concatenate(replies) if replies else np.zeros(0, np.float32)
    return Conversation(pcm, RATE, result["transcript"], result["user"], result["metrics"], kinds)
