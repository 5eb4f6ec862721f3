"""WebSocket sessions: move frames between a client and the scheduler, nothing else.

The protocol state machine (realtime.protocol) validates; the job (realtime.tts) holds the work;
this module only receives, sends, runs timers and maps errors to close codes. GPU/CPU model work
never runs here.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from realtime.errors import InternalError, RealtimeError
from realtime.protocol import messages as m
from realtime.protocol.frames import WireFormat, decode_frame, encode_frame
from realtime.protocol.player import GapTracker
from realtime.protocol.tts import Cancel, Flush, Start, Stop, Text, TTSProtocol
from realtime.scheduler import JobState
from realtime.tts import END, SPURT_END, AudioChunk, TTSJob

if TYPE_CHECKING:
    from realtime.server import AppState

log = logging.getLogger("realtime.sessions")


class Connection:
    """Frame I/O over a starlette WebSocket with our size limit and wire-format choice."""

    def __init__(self, ws: WebSocket, max_frame: int) -> None:
        self.ws = ws
        self.max_frame = max_frame
        self.fmt = WireFormat.MSGPACK
        self.closed = False

    async def recv(self) -> dict[str, Any] | None:
        """The next message, or None when the client went away."""
        msg = await self.ws.receive()
        if msg["type"] == "websocket.disconnect":
            self.closed = True
            return None
        data = msg.get("bytes")
        if data is None:
            data = msg.get("text", "")
        parsed, self.fmt = decode_frame(data, self.max_frame)
        return parsed

    async def send(self, msg: dict[str, Any]) -> None:
        if self.closed:
            return
        frame = encode_frame(msg, self.fmt)
        try:
            if isinstance(frame, bytes):
                await self.ws.send_bytes(frame)
            else:
                await self.ws.send_text(frame)
        except (WebSocketDisconnect, RuntimeError, OSError):
            self.closed = True

    async def close(self, code: int = 1000, reason: str = "") -> None:
        if self.closed or self.ws.application_state == WebSocketState.DISCONNECTED:
            self.closed = True
            return
        self.closed = True
        try:
            await self.ws.close(code=code, reason=reason[:120])
        except (RuntimeError, OSError):
            pass

    async def fail(self, exc: RealtimeError) -> None:
        """Tell the client what was wrong (no internals) and close with the matching code."""
        await self.send(m.error(exc.code, exc.message))
        await self.close(exc.close_code, exc.code)


class StreamSession:
    """The lifecycle every one-job WebSocket session shares (/v1/tts, /v1/asr, /v1/image).

    Subclasses set ``app``, ``conn``, ``proto`` (a state machine with ``fail()``), ``job``,
    ``sender`` and ``id``, and implement ``_receive_loop``. ``run`` maps errors to an ``error``
    message and close code (never a traceback) and, however the session ends, cancels the job and
    its send task so a vanished client frees its scheduler slot at once.
    """

    kind = "stream"
    app: "AppState"
    conn: "Connection"
    proto: Any
    job: Any = None
    sender: asyncio.Task[None] | None = None
    id: str = ""

    async def _receive_loop(self) -> None:
        raise NotImplementedError

    async def _job_over(self, failure: str) -> bool:
        """After a batch of output: True when the job failed (the client is told why, without
        internals) or was cancelled, so the send loop should end."""
        job = self.job
        if job.state is JobState.FAILED:
            self.app.metrics.errors.inc()
            err = job.error if isinstance(job.error, RealtimeError) else InternalError(failure)
            await self.conn.fail(err)
            return True
        return job.state is JobState.CANCELLED

    async def run(self) -> None:
        try:
            await self._receive_loop()
        except RealtimeError as exc:
            self.proto.fail()
            self.app.metrics.errors.inc()
            await self.conn.fail(exc)
        except Exception:
            log.exception("%s session %s crashed", self.kind, self.id)
            self.proto.fail()
            await self.conn.fail(InternalError("internal error"))
        finally:
            if self.job is not None and self.job.active:
                self.app.scheduler.cancel(self.job)
            if self.sender is not None:
                if not self.sender.done():
                    self.sender.cancel()
                await asyncio.gather(self.sender, return_exceptions=True)


class TTSSession(StreamSession):
    """One /v1/tts connection."""

    kind = "tts"

    def __init__(self, app: "AppState", conn: Connection) -> None:
        self.app = app
        self.conn = conn
        self.proto = TTSProtocol(default_rate=app.tts.native_rate)
        self.job: TTSJob | None = None
        self.id = uuid.uuid4().hex[:16]
        self.tracker = GapTracker()
        self.sender: asyncio.Task[None] | None = None
        self.first_sent: float | None = None

    async def _receive_loop(self) -> None:
        while True:
            msg = await self.conn.recv()
            if msg is None:  # the client went away: free the slot now
                return
            if self.conn.closed:
                return
            event = self.proto.receive(msg)
            if isinstance(event, Start):
                await self._start(event)
            elif isinstance(event, Text):
                assert self.job is not None
                self.job.push_text(event.text)
                self.app.scheduler.wake()
            elif isinstance(event, Flush):
                assert self.job is not None
                self.job.flush()
                self.app.scheduler.wake()
            elif isinstance(event, Stop):
                assert self.job is not None
                self.job.stop()
                self.app.scheduler.wake()
            elif isinstance(event, Cancel):
                assert self.job is not None
                self.app.scheduler.cancel(self.job)
                if self.sender is not None:
                    self.sender.cancel()
                    await asyncio.gather(self.sender, return_exceptions=True)
                await self.conn.send(m.done(self._stats(cancelled=True)))
                await self.conn.close(1000, "cancelled")
                return
            if self.sender is not None and self.sender.done():
                return  # the stream ended (done or error) while we were reading

    async def _start(self, event: Start) -> None:
        job = self.app.tts.new_job(event.params, session=self.id)
        loop = asyncio.get_running_loop()
        self.wake = asyncio.Event()
        job.output.bind(loop, self.wake)
        self.app.tts.submit(self.app.scheduler, job)
        self.job = job
        self.app.metrics.streams.inc()
        await self.conn.send(m.ready(self.id, job.params.sample_rate, job.params.format, job.chunk_samples,
                                     model=self.app.tts.name))
        self.sender = asyncio.create_task(self._send_loop(), name=f"tts-send-{self.id}")
        self.sender.add_done_callback(self._sender_done)

    def _sender_done(self, task: asyncio.Task[None]) -> None:
        # Unblock the receive loop when the stream is over: closing the socket makes recv return.
        if not task.cancelled() and task.exception() is not None:
            log.error("sender failed: %r", task.exception())

    async def _send_loop(self) -> None:
        job = self.job
        assert job is not None
        while True:
            items = await job.output.drain(self.app.scheduler.wake)
            for item in items:
                if item is END:
                    self.proto.finished()
                    self.app.scheduler.reap(job)  # its slot is free before the client hears "done"
                    stats = self._stats()
                    self._record(stats)
                    await self.conn.send(m.done(stats))
                    await self.conn.close(1000, "done")
                    return
                if item is SPURT_END:
                    self.tracker.idle()
                    continue
                assert isinstance(item, AudioChunk)
                await self.conn.send(m.audio(item.seq, item.data, item.start_ms, item.duration_ms))
                now = time.monotonic()
                if self.first_sent is None:
                    self.first_sent = now
                self.tracker.on_chunk(now, item.duration_ms / 1000.0)
                if self.conn.closed:
                    return
            if await self._job_over("speech generation failed"):
                return

    def _stats(self, cancelled: bool = False) -> dict[str, Any]:
        job = self.job
        assert job is not None
        ttfa = None
        if self.first_sent is not None and job.first_text_at is not None:
            ttfa = (self.first_sent - job.first_text_at) * 1000.0
        audio_s = job.audio_s()
        st = self.tracker.stats()
        return {"ttfa_ms": None if ttfa is None else round(ttfa, 3), "audio_ms": round(audio_s * 1000, 3),
                "frames": job.frames, "chunks": st["chunks"],
                "rtf": round(job.compute_s / audio_s, 4) if audio_s > 0 else None,
                "underruns": st["underruns"], "underrun_ms": st["underrun_ms"],
                "max_underrun_ms": st["max_underrun_ms"], "underruns_over_100ms": st["underruns_over_100ms"],
                "cancelled": cancelled}

    def _record(self, stats: dict[str, Any]) -> None:
        mt = self.app.metrics
        if stats["ttfa_ms"] is not None:
            mt.ttfa.observe(stats["ttfa_ms"] / 1000.0)
        if stats["rtf"] is not None:
            mt.rtf.observe(stats["rtf"])
        mt.underruns.inc(stats["underruns"])
        mt.underrun_s.inc(stats["underrun_ms"] / 1000.0)
        mt.audio_s.inc(stats["audio_ms"] / 1000.0)
