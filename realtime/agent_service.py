"""The voice agent service: WS /v1/realtime (OpenAI Realtime API subset) and WS
/v1/telephony/twilio (Twilio Media Streams), both over one transport-neutral pipeline
(realtime.agent.AgentSession) built from the "asr" and "text" services and the TTS backend.

The agent has no lanes of its own: its work runs as ordinary ASR, text and TTS jobs on the one
scheduler, so replies compete with every other stream by deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from realtime.agent import (AgentConfig, AgentError, AgentEvent, AgentSession, PlaybackInterrupted, ResponseAudio,
                            ResponseFinished, ResponseStarted, ResponseText, UserSpeechStarted, UserSpeechStopped,
                            UserTranscriptDelta, UserTurn)
from realtime.config import ServerConfig
from realtime.errors import ConfigError, DecodeError, FrameTooLarge, InternalError, ProtocolError, RealtimeError, \
    UnsupportedError
from realtime.protocol import openai_realtime as oa
from realtime.protocol import twilio as tw
from realtime.protocol.frames import WireFormat
from realtime.service import Service

if TYPE_CHECKING:
    from realtime.scheduler import Scheduler
    from realtime.server import AppState
    from realtime.sessions import Connection

log = logging.getLogger("realtime.agent")

# OpenAI's voice names map to the TTS backend's default voice (as on /v1/audio/speech).
OPENAI_VOICES = frozenset("alloy ash ballad coral echo fable onyx nova sage shimmer verse marin cedar".split())


class AgentService(Service):
    name = "agent"

    def __init__(self, config: ServerConfig, agent: AgentConfig | None = None) -> None:
        self.config = config
        self.agent_cfg = agent or AgentConfig()
        self.sessions: dict[str, AgentSession] = {}  # live conversations (inspection, tests, metrics)
        self.finished_turns = 0
        self.preemptive_done = {"started": 0, "committed": 0, "dropped": 0}  # of ended sessions
        self._gauge = False
        from realtime.metrics import Histogram

        self.turn_latency = Histogram("realtime_agent_turn_latency_seconds",
                                      "End of user speech to first agent audio sent",
                                      (0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0))

    def load(self) -> None:
        pass  # the ASR, text and TTS services own the weights

    def attach(self, scheduler: "Scheduler") -> None:
        pass  # no lanes: replies are ASR / text / TTS jobs

    def describe(self) -> list[dict[str, Any]]:
        return [{"id": "realtime-agent", "object": "model", "kind": "agent",
                 "endpoints": ["/v1/realtime", "/v1/telephony/twilio"]}]

    def parts(self, st: "AppState") -> tuple[Any, Any]:
        asr, text = st.services.get("asr"), st.services.get("text")
        if asr is None or text is None:
            raise ConfigError("the agent needs the asr and text services")
        if not self._gauge:
            from realtime.metrics import Gauge

            st.metrics.gauges.append(Gauge("realtime_agent_sessions", "Voice agent conversations in progress",
                                           lambda: {"": len(self.sessions)}))
            # Rendered like a gauge (Metrics.render only calls .render()); a Metrics field would be tidier.
            st.metrics.gauges.append(self.turn_latency)  # type: ignore[arg-type]
            st.metrics.gauges.append(Gauge("realtime_agent_preemptive_replies",
                                           "Replies started when silence began: started, committed (the "
                                           "turn's reply), dropped (the caller went on); since start",
                                           self.preemptive_counts))
            self._gauge = True
        return asr, text

    def new_session(self, st: "AppState", config: AgentConfig, session: str = "") -> AgentSession:
        asr, text = self.parts(st)
        s = AgentSession(scheduler=st.scheduler, asr=asr, text=text, tts=st.tts, config=config,
                         metrics=st.metrics, session=session)
        s.on_turn = self._on_turn
        self.sessions[s.id] = s
        return s

    def _on_turn(self, m: dict[str, Any]) -> None:
        if m.get("turn_latency_ms") is not None:
            self.turn_latency.observe(m["turn_latency_ms"] / 1000.0)

    def preemptive_counts(self) -> dict[str, float]:
        totals = dict(self.preemptive_done)
        for s in list(self.sessions.values()):
            for k, v in s.spec_stats.items():
                totals[k] += v
        return {f'{{outcome="{k}"}}': v for k, v in totals.items()}

    def end_session(self, s: AgentSession) -> None:
        if self.sessions.pop(s.id, None) is not None:
            for k, v in s.spec_stats.items():
                self.preemptive_done[k] += v
        self.finished_turns += len(s.turns)

    def routes(self, state: Callable[[], "AppState"]) -> list:
        from starlette.routing import WebSocketRoute

        from realtime.server import run_websocket

        async def realtime_ws(ws) -> None:  # noqa: ANN001 - starlette WebSocket
            model = ws.query_params.get("model") or "realtime-agent"
            await run_websocket(state(), ws, lambda st, conn: OpenAIRealtimeSession(st, conn, self, model).run())

        async def twilio_ws(ws) -> None:  # noqa: ANN001
            await run_websocket(state(), ws, lambda st, conn: TwilioSession(st, conn, self).run())

        return [WebSocketRoute("/v1/realtime", realtime_ws), WebSocketRoute("/v1/telephony/twilio", twilio_ws)]


def _voice(tts: Any, voice: str | None) -> str | None:
    if voice is None or voice in OPENAI_VOICES:
        return None
    if tts.voices and voice not in tts.voices:
        raise UnsupportedError(f"unknown voice '{voice[:40]}'; available: {', '.join(tts.voices)} "
                               f"(or an OpenAI voice name for the default)")
    return voice


class _AgentBridge:
    """What the two wire bridges share: the agent session and the task that sends its events."""

    svc: AgentService
    agent: AgentSession | None = None
    sender: asyncio.Task[None] | None = None

    async def _teardown(self) -> None:
        """End the agent session (if one started) and stop the sender task."""
        if self.agent is not None:
            await self.agent.close()
            self.svc.end_session(self.agent)
        if self.sender is not None:
            self.sender.cancel()
            await asyncio.gather(self.sender, return_exceptions=True)


# ---------------------------------------------------------------------------------------------
# OpenAI Realtime

class OpenAIRealtimeSession(_AgentBridge):
    """One /v1/realtime connection: OpenAI client events in, agent events out as OpenAI server events."""

    def __init__(self, app: "AppState", conn: "Connection", svc: AgentService, model: str) -> None:
        self.app, self.conn, self.svc = app, conn, svc
        self.id = f"sess_{uuid.uuid4().hex[:20]}"
        base = svc.agent_cfg
        self.cfg = oa.SessionConfig(model=model[:64], instructions=None, max_output_tokens=None)
        self.base = base
        self.agent: AgentSession | None = None
        self.sender: asyncio.Task[None] | None = None
        self.spoken = False  # voice locked once audio went out
        self.prev_item: str | None = None

    def _voice_name(self) -> str:
        return self.cfg.voice or (self.app.tts.voices[0] if self.app.tts.voices else self.app.tts.name)

    def _agent_config(self) -> AgentConfig:
        c = self.cfg
        fin, rin = c.input_codec
        fout, rout = c.output_codec
        td = c.turn_detection
        return AgentConfig(
            instructions=c.instructions or self.base.instructions, voice=_voice(self.app.tts, c.voice),
            max_tokens=c.max_output_tokens or self.base.max_tokens, temperature=self.base.temperature,
            top_p=self.base.top_p, seed=self.base.seed, in_format=fin, in_rate=rin, out_format=fout, out_rate=rout,
            chunk_ms=self.base.chunk_ms if fout == "pcm_s16le" else 20,
            turn_detection=td is not None, create_response=td.create_response if td else False,
            interrupt_response=td.interrupt_response if td else False,
            silence_duration_ms=td.silence_duration_ms if td else 500,
            interim_transcripts=self.base.interim_transcripts, asr_prompt=c.transcription_prompt,
            asr_language=c.transcription_language,
            preemptive=self.base.preemptive,
            max_history_messages=self.base.max_history_messages, max_history_chars=self.base.max_history_chars)

    async def send(self, ev: dict[str, Any]) -> None:
        self.conn.fmt = WireFormat.JSON
        await self.conn.send(ev)

    async def run(self) -> None:
        self.conn.fmt = WireFormat.JSON  # OpenAI clients speak JSON text frames only
        try:
            self.agent = self.svc.new_session(self.app, self._agent_config(), session=self.id)
            await self.agent.start()
            self.app.metrics.streams.inc()
            await self.send(oa.event("session.created", session=oa.session_object(self.cfg, self.id,
                                                                                     self._voice_name())))
            self.sender = asyncio.create_task(self._send_loop(), name=f"oa-send-{self.id}")
            await self._receive_loop()
        except RealtimeError as exc:
            self.app.metrics.errors.inc()
            await self.send(oa.error_event(exc))
            await self.conn.close(exc.close_code, exc.code)
        except Exception:
            log.exception("realtime session %s crashed", self.id)
            await self.send(oa.error_event(InternalError("internal error")))
            await self.conn.close(InternalError.close_code, "internal")
        finally:
            await self._teardown()

    async def _receive_loop(self) -> None:
        assert self.agent is not None
        while True:
            try:
                msg = await self.conn.recv()
            except (DecodeError, FrameTooLarge) as exc:
                await self.send(oa.error_event(exc))
                continue
            self.conn.fmt = WireFormat.JSON
            if msg is None or self.conn.closed:
                return
            if self.sender is not None and self.sender.done():
                return
            eid = msg.get("event_id") if isinstance(msg.get("event_id"), str) else None
            try:
                await self._handle(oa.parse_client_event(msg))
            except RealtimeError as exc:
                if isinstance(exc, InternalError):
                    raise
                self.app.metrics.errors.inc()
                await self.send(oa.error_event(exc, eid))

    async def _handle(self, ev: oa.ClientEvent) -> None:
        agent = self.agent
        assert agent is not None
        if isinstance(ev, oa.AudioAppend):
            agent.push_audio(ev.audio)
            while agent.asr_backlog():  # back-pressure: stop reading while the ASR is behind
                await asyncio.sleep(0.01)
        elif isinstance(ev, oa.SessionUpdate):
            new = oa.apply_session_update(self.cfg, ev.session, voice_locked=self.spoken,
                                          languages=agent.asr.languages)
            _voice(self.app.tts, new.voice)
            self.cfg = new
            a = self._agent_config()
            agent.configure(**{k: getattr(a, k) for k in a.__dataclass_fields__})
            await self.send(oa.event("session.updated", session=oa.session_object(self.cfg, self.id,
                                                                                     self._voice_name())))
        elif isinstance(ev, oa.AudioCommit):
            if self.cfg.turn_detection is not None:
                # server VAD commits by itself; an explicit commit ends the current utterance now
                agent.finalize_utterance()
                return
            await agent.commit()  # its UserTurn event becomes committed + transcription events
        elif isinstance(ev, oa.AudioClear):
            await agent.clear_audio()
            await self.send(oa.event("input_audio_buffer.cleared"))
        elif isinstance(ev, oa.ItemCreate):
            iid = ev.item_id or f"item_{uuid.uuid4().hex[:20]}"
            agent.add_item(ev.role, ev.text, iid)
            item = oa.text_item(iid, ev.role, ev.text)
            await self.send(oa.event("conversation.item.added", previous_item_id=self.prev_item, item=item))
            await self.send(oa.event("conversation.item.done", previous_item_id=self.prev_item, item=item))
            self.prev_item = iid
        elif isinstance(ev, oa.ItemTruncate):
            agent.truncate(ev.item_id, ev.audio_end_ms)
            await self.send(oa.event("conversation.item.truncated", item_id=ev.item_id,
                                     content_index=ev.content_index, audio_end_ms=ev.audio_end_ms))
        elif isinstance(ev, oa.ItemRetrieve):
            role, text, spoken = agent.get_item(ev.item_id)
            if not spoken:
                item = oa.text_item(ev.item_id, role, text)
            elif role == "assistant":
                item = oa.assistant_item(ev.item_id, "completed", text)
            else:
                item = oa.user_item(ev.item_id, "completed", text)
            await self.send(oa.event("conversation.item.retrieved", item=item))
        elif isinstance(ev, oa.ItemDelete):
            before = agent.delete_item(ev.item_id)
            if self.prev_item == ev.item_id:
                self.prev_item = before
            await self.send(oa.event("conversation.item.deleted", item_id=ev.item_id))
        elif isinstance(ev, oa.ResponseCreate):
            agent.create_response(instructions=ev.instructions, max_tokens=ev.max_output_tokens,
                                  metadata=ev.metadata, conversation=ev.conversation, extra=ev.extra_input)
        elif isinstance(ev, oa.ResponseCancel):
            if not await agent.cancel_response(ev.response_id):
                raise ProtocolError("no response in progress to cancel", code="response_cancel_not_active")

    async def _send_loop(self) -> None:
        assert self.agent is not None
        while True:
            for ev in await self.agent.next_events():
                await self._send_event(ev)
                if self.conn.closed:
                    return

    async def _send_event(self, ev: AgentEvent) -> None:
        c0 = {"content_index": 0}
        if isinstance(ev, ResponseAudio):
            self.spoken = True
            await self.send(oa.event("response.output_audio.delta", response_id=ev.response_id, item_id=ev.item_id,
                                     output_index=0, **c0, delta=oa.b64(ev.data)))
        elif isinstance(ev, ResponseText):
            await self.send(oa.event("response.output_audio_transcript.delta", response_id=ev.response_id,
                                     item_id=ev.item_id, output_index=0, **c0, delta=ev.delta))
        elif isinstance(ev, UserSpeechStarted):
            await self.send(oa.event("input_audio_buffer.speech_started", audio_start_ms=ev.audio_start_ms,
                                     item_id=ev.item_id))
        elif isinstance(ev, UserSpeechStopped):
            await self.send(oa.event("input_audio_buffer.speech_stopped", audio_end_ms=ev.audio_end_ms,
                                     item_id=ev.item_id))
        elif isinstance(ev, UserTranscriptDelta):
            await self.send(oa.event("conversation.item.input_audio_transcription.delta", item_id=ev.item_id,
                                     **c0, delta=ev.delta))
        elif isinstance(ev, UserTurn):
            await self.send(oa.event("input_audio_buffer.committed", previous_item_id=self.prev_item,
                                     item_id=ev.item_id))
            item = oa.user_item(ev.item_id, "completed", None)
            await self.send(oa.event("conversation.item.added", previous_item_id=self.prev_item, item=item))
            self.prev_item = ev.item_id
            if self.cfg.transcription_model is not None:
                if ev.transcript:
                    await self.send(oa.event("conversation.item.input_audio_transcription.delta",
                                             item_id=ev.item_id, **c0, delta=ev.transcript))
                await self.send(oa.event("conversation.item.input_audio_transcription.completed",
                                         item_id=ev.item_id, **c0, transcript=ev.transcript,
                                         usage={"type": "duration", "seconds": round(ev.audio_ms / 1000.0, 3)}))
            await self.send(oa.event("conversation.item.done", previous_item_id=None,
                                     item=oa.user_item(ev.item_id, "completed", ev.transcript)))
        elif isinstance(ev, ResponseStarted):
            voice = self._voice_name()
            await self.send(oa.event("response.created", response=oa.response_object(
                ev.response_id, "in_progress", self.cfg, voice)))
            item = oa.assistant_item(ev.item_id, "in_progress", None)
            await self.send(oa.event("response.output_item.added", response_id=ev.response_id, output_index=0,
                                     item=item))
            await self.send(oa.event("conversation.item.added", previous_item_id=self.prev_item, item=item))
            self.prev_item = ev.item_id
            await self.send(oa.event("response.content_part.added", response_id=ev.response_id, item_id=ev.item_id,
                                     output_index=0, **c0, part={"type": "audio", "transcript": ""}))
        elif isinstance(ev, ResponseFinished):
            rid, iid = ev.response_id, ev.item_id
            common = {"response_id": rid, "item_id": iid, "output_index": 0, **c0}
            await self.send(oa.event("response.output_audio.done", **common))
            await self.send(oa.event("response.output_audio_transcript.done", **common, transcript=ev.transcript))
            await self.send(oa.event("response.content_part.done", **common,
                                     part={"type": "audio", "transcript": ev.transcript}))
            item_status = "completed" if ev.status == "completed" else "incomplete"
            # The item carries what its audio covers; the client's truncate then cuts it to what was
            # heard (the server's own estimate of that is in the metrics and the LLM's history).
            item = oa.assistant_item(iid, item_status, ev.audio_transcript)
            await self.send(oa.event("response.output_item.done", response_id=rid, output_index=0, item=item))
            await self.send(oa.event("conversation.item.done", previous_item_id=None, item=item))
            details = None
            if ev.status != "completed":
                details = {"type": ev.status, "reason": ev.reason}
            metrics = {**ev.metrics, "transcript_spoken": ev.spoken_transcript}
            await self.send(oa.event("response.done", response=oa.response_object(
                rid, ev.status, self.cfg, self._voice_name(), output=[item],
                usage=oa.usage(ev.prompt_tokens, ev.completion_tokens), status_details=details,
                metadata=ev.metadata, metrics=metrics, conversation=ev.conversation)))
        elif isinstance(ev, PlaybackInterrupted):
            pass  # the client saw speech_started: it stops playback and sends conversation.item.truncate
        elif isinstance(ev, AgentError):
            await self.send(oa.error_event(ev.error))


# ---------------------------------------------------------------------------------------------
# Twilio Media Streams

class TwilioSession(_AgentBridge):
    """One /v1/telephony/twilio connection (a phone call)."""

    def __init__(self, app: "AppState", conn: "Connection", svc: AgentService) -> None:
        self.app, self.conn, self.svc = app, conn, svc
        self.proto = tw.TwilioStream()
        self.framer = tw.MulawFramer()
        self.agent: AgentSession | None = None
        self.sender: asyncio.Task[None] | None = None
        self.bad_messages = 0
        self.marks_sent: list[str] = []
        self.marks_echoed: list[str] = []
        self.dtmf: list[str] = []
        self.cleared = 0

    async def send(self, msg: dict[str, Any]) -> None:
        self.conn.fmt = WireFormat.JSON
        await self.conn.send(msg)

    async def run(self) -> None:
        self.conn.fmt = WireFormat.JSON
        try:
            await self._receive_loop()
        except Exception:
            log.exception("twilio session crashed")
            await self.conn.close(InternalError.close_code, "internal")
        finally:
            await self._teardown()

    async def _receive_loop(self) -> None:
        while True:
            try:
                msg = await self.conn.recv()
            except (DecodeError, FrameTooLarge) as exc:
                self._bad(exc)
                continue
            self.conn.fmt = WireFormat.JSON
            if msg is None or self.conn.closed:
                return
            try:
                ev = self.proto.receive(msg)
            except RealtimeError as exc:
                # Twilio does not read errors from us: log, count, go on (the call stays up).
                self._bad(exc)
                if isinstance(exc, UnsupportedError) and self.agent is None:
                    await self.conn.close(exc.close_code, exc.code)
                    return
                continue
            if isinstance(ev, tw.Start):
                base = self.svc.agent_cfg
                cfg = AgentConfig(**{**{k: getattr(base, k) for k in base.__dataclass_fields__},
                                     "in_format": "mulaw", "in_rate": tw.RATE, "out_format": "mulaw",
                                     "out_rate": tw.RATE, "chunk_ms": 20, "turn_detection": True})
                self.agent = self.svc.new_session(self.app, cfg, session=ev.stream_sid[:40])
                self.agent.playback_acks = True  # our marks come back when the caller heard the reply
                await self.agent.start()
                self.app.metrics.streams.inc()
                self.sender = asyncio.create_task(self._send_loop(), name=f"twilio-send-{ev.stream_sid[:20]}")
            elif isinstance(ev, tw.Media):
                if ev.track == "inbound" and self.agent is not None:
                    self.agent.push_audio(ev.payload)
                    while self.agent.asr_backlog():
                        await asyncio.sleep(0.01)
            elif isinstance(ev, tw.Mark):
                self.marks_echoed.append(ev.name)
                if self.agent is not None:
                    self.agent.playback_reached_end(ev.name)
            elif isinstance(ev, tw.Dtmf):
                self.dtmf.append(ev.digit)
            elif isinstance(ev, tw.Stop):
                await self.conn.close(1000, "stream stopped")
                return
            if self.sender is not None and self.sender.done():
                return

    def _bad(self, exc: RealtimeError) -> None:
        self.bad_messages += 1
        self.app.metrics.errors.inc()
        log.warning("twilio stream %s: ignored a bad message: %s", self.proto.stream_sid, exc.message)

    async def _send_loop(self) -> None:
        assert self.agent is not None
        while True:
            for ev in await self.agent.next_events():
                if isinstance(ev, ResponseAudio):
                    for frame in self.framer.push(ev.data):
                        await self.send(self.proto.media(frame))
                elif isinstance(ev, PlaybackInterrupted):
                    self.framer.reset()
                    self.cleared += 1
                    await self.send(self.proto.clear())
                elif isinstance(ev, ResponseFinished):
                    if ev.status != "cancelled":
                        for frame in self.framer.flush():
                            await self.send(self.proto.media(frame))
                        self.marks_sent.append(ev.response_id)
                        await self.send(self.proto.mark(ev.response_id))
                    else:
                        self.framer.reset()
                elif isinstance(ev, AgentError):
                    log.warning("twilio stream %s: %s", self.proto.stream_sid, ev.error.message)
                if self.conn.closed:
                    return


# ---------------------------------------------------------------------------------------------
# CLI: realtime agent --wav in.wav -o reply.wav [--url URL]

def add_cli(subparsers: Any) -> None:
    p = subparsers.add_parser("agent", help="talk to the voice agent: stream a WAV, save its spoken reply")
    p.add_argument("--wav", required=True, help="what you say (WAV/FLAC, any rate; streamed at real-time pace)")
    p.add_argument("-o", "--output", required=True, help="the agent's reply (WAV, 24 kHz)")
    p.add_argument("--url", default="ws://127.0.0.1:8000/v1/realtime", help="the server's /v1/realtime WebSocket")
    p.add_argument("--api-key", default=None)
    p.add_argument("--instructions", default=None, help="system prompt for the agent")
    p.add_argument("--max-tokens", type=int, default=None, help="longest reply in tokens")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the reply")
    p.set_defaults(fn=_agent_cli)


def _agent_cli(args: argparse.Namespace) -> int:
    import numpy as np
    import soundfile as sf

    from realtime.clients.agent import converse_wav

    t0 = time.perf_counter()
    try:
        x, rate = sf.read(args.wav, dtype="float32", always_2d=True)
    except Exception as exc:  # soundfile raises several types for unreadable files
        print(f"realtime agent: cannot read {args.wav}: {exc}", file=sys.stderr)
        return 2
    mono = x.mean(axis=1).astype(np.float32)
    try:
        result = asyncio.run(converse_wav(args.url, mono, int(rate), api_key=args.api_key or
                                          os.environ.get("REALTIME_API_KEY"), instructions=args.instructions,
                                          max_output_tokens=args.max_tokens, timeout_s=args.timeout))
    except (OSError, RuntimeError, asyncio.TimeoutError) as exc:
        print(f"realtime agent: {exc}", file=sys.stderr)
        return 1
    sf.write(args.output, result.audio, result.sample_rate, subtype="PCM_16")
    m = result.metrics or {}
    print(f"you: {result.user_transcript}")
    print(f"agent: {result.transcript}")
    lat = m.get("turn_latency_ms")
    print(f"wrote {args.output}: {len(result.audio) / result.sample_rate:.2f} s in {time.perf_counter() - t0:.1f} s"
          + (f", turn latency {lat:.0f} ms" if lat is not None else ""), file=sys.stderr)
    return 0
