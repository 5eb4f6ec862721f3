"""A scripted /v1/realtime peer for the browser tests: speaks the OpenAI Realtime event schema
on a fixed script (no models), so that the page's client logic — session.update, audio appends,
playback, per-turn latency, barge-in and conversation.item.truncate — is checked exactly.

Script: after 1.5 s of microphone audio, one user turn ends (speech_stopped at 1.2 s); the reply
is 1 s of 24 kHz tone, paced in real time after a 300 ms burst, then response.done with our
realtime_metrics. Then a second turn whose reply is interrupted: after ~1.2 s of reply audio
the script sends speech_started (barge-in), waits for the client's truncate, sends a few late
deltas of the cancelled response (the page must drop them) and response.done cancelled.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from realtime.service import Service

RATE = 24000
CHUNK_MS = 40


def tone(ms: int, start: int = 0) -> bytes:
    n = RATE * ms // 1000
    t = (np.arange(n) + start) / RATE
    return (0.2 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2").tobytes()


@dataclass
class Record:
    """What the page sent, for the test's assertions."""

    updates: list[dict[str, Any]] = field(default_factory=list)
    audio: bytearray = field(default_factory=bytearray)
    truncates: list[dict[str, Any]] = field(default_factory=list)
    other: list[str] = field(default_factory=list)
    bargein_sent_ms: float | None = None  # reply audio sent when the barge-in was announced
    reply1_ms: int = 1000
    finished: bool = False
    failure: str | None = None

    @property
    def received_ms(self) -> float:
        return len(self.audio) / 2 / RATE * 1000


class ScriptedRealtime(Service):
    name = "scripted-realtime"

    def __init__(self) -> None:
        self.record = Record()

    def load(self) -> None:
        pass

    def attach(self, scheduler: Any) -> None:
        pass

    def routes(self, state: Callable[[], Any]) -> list:
        return [WebSocketRoute("/v1/realtime", self.handler)]

    async def handler(self, ws: WebSocket) -> None:
        await ws.accept()
        rec = self.record
        truncated = asyncio.Event()

        async def send(kind: str, **fields: Any) -> None:
            await ws.send_text(json.dumps({"type": kind, "event_id": f"ev_{time.monotonic_ns()}", **fields}))

        async def reader() -> None:
            try:
                while True:
                    msg = json.loads(await ws.receive_text())
                    kind = msg.get("type")
                    if kind == "session.update":
                        rec.updates.append(msg["session"])
                        await send("session.updated", session={"type": "realtime", "id": "sess_1", **msg["session"]})
                    elif kind == "input_audio_buffer.append":
                        rec.audio += base64.b64decode(msg["audio"])
                    elif kind == "conversation.item.truncate":
                        rec.truncates.append(msg)
                        truncated.set()
                    else:
                        rec.other.append(str(kind))
            except (WebSocketDisconnect, RuntimeError):
                pass

        async def until_audio(ms: float, timeout: float = 20.0) -> None:
            t0 = time.monotonic()
            while rec.received_ms < ms:
                if time.monotonic() - t0 > timeout:
                    raise TimeoutError(f"only {rec.received_ms:.0f} ms of microphone audio arrived")
                await asyncio.sleep(0.01)

        async def user_turn(n: int, end_ms: int) -> None:
            item = f"item_u{n}"
            await send("input_audio_buffer.speech_stopped", audio_end_ms=end_ms, item_id=item)
            await send("input_audio_buffer.committed", item_id=item, previous_item_id=None)
            await send("conversation.item.input_audio_transcription.delta", item_id=item, content_index=0,
                       delta="hello")
            await send("conversation.item.input_audio_transcription.completed", item_id=item, content_index=0,
                       transcript=f"hello number {n}")

        async def stream_reply(resp: str, item: str, total_ms: int, stop_at_ms: int | None = None) -> int:
            """Deltas of tone: a 300 ms burst, then real time. Returns ms sent."""
            await send("response.created", response={"id": resp, "object": "realtime.response",
                                                     "status": "in_progress", "output": []})
            await send("response.output_audio_transcript.delta", response_id=resp, item_id=item,
                       output_index=0, content_index=0, delta="This is a reply ")
            t0 = time.monotonic()
            sent = 0
            while sent < total_ms:
                if stop_at_ms is not None and sent >= stop_at_ms:
                    return sent
                due = t0 + max(0, sent - 300) / 1000
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                await send("response.output_audio.delta", response_id=resp, item_id=item, output_index=0,
                           content_index=0, delta=base64.b64encode(tone(CHUNK_MS, sent * RATE // 1000)).decode())
                sent += CHUNK_MS
            return sent

        task = asyncio.create_task(reader())
        try:
            await send("session.created", session={"type": "realtime", "id": "sess_1"})
            # turn 1: a complete reply
            await until_audio(300)
            await send("input_audio_buffer.speech_started", audio_start_ms=0, item_id="item_u1")
            await until_audio(1500)
            await user_turn(1, 1200)
            await stream_reply("resp_1", "item_a1", rec.reply1_ms)
            await send("response.output_audio.done", response_id="resp_1", item_id="item_a1",
                       output_index=0, content_index=0)
            await send("response.output_audio_transcript.done", response_id="resp_1", item_id="item_a1",
                       output_index=0, content_index=0, transcript="This is a reply to turn one.")
            await send("response.done", response={
                "id": "resp_1", "object": "realtime.response", "status": "completed", "metadata": None,
                "realtime_metrics": {"turn_latency_ms": 321.4, "asr_final_ms": 150, "llm_ttft_ms": 90,
                                     "tts_ttfa_ms": 40, "underruns": 0}})
            await asyncio.sleep(1.5)  # let it play out
            # turn 2: interrupted by the user
            await send("input_audio_buffer.speech_started", audio_start_ms=int(rec.received_ms), item_id="item_u2")
            await user_turn(2, int(rec.received_ms))
            sent = await stream_reply("resp_2", "item_a2", 5000, stop_at_ms=1200)
            rec.bargein_sent_ms = sent
            await send("input_audio_buffer.speech_started", audio_start_ms=int(rec.received_ms), item_id="item_u3")
            await asyncio.wait_for(truncated.wait(), 10)
            for i in range(3):  # in flight before the server saw the barge-in: the page must drop these
                await send("response.output_audio.delta", response_id="resp_2", item_id="item_a2", output_index=0,
                           content_index=0, delta=base64.b64encode(tone(CHUNK_MS)).decode())
            await send("response.done", response={"id": "resp_2", "object": "realtime.response",
                                                  "status": "cancelled",
                                                  "status_details": {"type": "cancelled", "reason": "turn_detected"}})
            rec.finished = True
            await task
        except Exception as exc:  # the test reads the failure instead of a silent hang
            rec.failure = f"{type(exc).__name__}: {exc}"
            task.cancel()
