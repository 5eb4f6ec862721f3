"""The voice agent end to end on a real uvicorn server with the embedded models (Silero VAD +
Whisper tiny.en, SmolLM2, Piper): the official ``openai`` SDK's realtime client, a simulated
Twilio Media Streams peer, raw-WebSocket error handling, and the ``realtime agent`` CLI."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import websockets
from liveserver import serve

from realtime.agent import AgentConfig
from realtime.agent_service import AgentService
from realtime.asr_service import ASRService
from realtime.codecs.g711 import ulaw_decode
from realtime.codecs.resample import pack_pcm, resample
from realtime.config import ServerConfig
from realtime.server import create_app
from realtime.text_service import TextService

ASSET = Path(__file__).resolve().parents[1] / "assets" / "arctic_a0009.wav"
REPLY_TOKENS = 24  # the LLM is tiny and the CPU shared: short replies keep the file fast
METRICS = ("turn_latency_ms", "asr_final_ms", "llm_ttft_ms", "tts_ttfa_ms", "audio_ms", "played_ms", "underruns")


@pytest.fixture(scope="module")
def live(piper_backend):  # noqa: ANN001, ANN201
    cfg = ServerConfig(warmup=False)
    agent = AgentService(cfg, AgentConfig(max_tokens=REPLY_TOKENS, temperature=0.0, seed=0))
    app = create_app(cfg, tts=piper_backend,
                     services=[ASRService(cfg), TextService(cfg, n_slots=4, max_seq_len=1024), agent])
    with serve(app) as srv:
        srv.agent = agent
        yield srv


@pytest.fixture(scope="module")
def speech16() -> np.ndarray:
    audio, rate = sf.read(ASSET, dtype="float32")
    assert rate == 16000
    return audio


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64)))) if len(x) else 0.0


class Mic:
    """A live microphone: silence, and speech whenever ``say()`` queues it, at ``pace`` x real time."""

    def __init__(self, send, rate: int, fmt: str, frame_ms: int, pace: float = 1.0) -> None:  # noqa: ANN001
        self.send, self.rate, self.fmt, self.pace = send, rate, fmt, pace
        self.n = rate * frame_ms // 1000
        self.queue = np.zeros(0, np.float32)
        self.spoken = 0  # speech samples sent
        self.task: asyncio.Task | None = None

    def say(self, x: np.ndarray) -> None:
        self.queue = np.concatenate([self.queue, x.astype(np.float32)])

    def start(self) -> None:
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        t0, sent = time.monotonic(), 0
        while True:
            take = self.queue[: self.n]
            self.queue = self.queue[len(take):]
            self.spoken += len(take)
            frame = np.concatenate([take, np.zeros(self.n - len(take), np.float32)])
            await self.send(pack_pcm(frame, self.fmt))
            sent += self.n
            await asyncio.sleep(max(0.0, t0 + sent / self.rate / self.pace - time.monotonic()))

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


# ---- OpenAI Realtime through the official SDK ------------------------------------------------------

def test_openai_sdk_turn_then_barge_in(live, speech16) -> None:  # noqa: ANN001
    from openai import AsyncOpenAI

    speech = resample(speech16, 16000, 24000)

    async def run() -> None:
        client = AsyncOpenAI(api_key="x", websocket_base_url=f"{live.ws}/v1")
        async with client.realtime.connect(model="realtime-agent") as conn:
            created = await conn.recv()
            assert created.type == "session.created"
            await conn.session.update(session={
                "type": "realtime", "instructions": "You are a helpful assistant. Answer briefly.",
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                                    "turn_detection": {"type": "server_vad", "threshold": 0.5,
                                                       "prefix_padding_ms": 300, "silence_duration_ms": 500,
                                                       "interrupt_response": True}},
                          "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "alloy"}}})
            updated = await conn.recv()
            assert updated.type == "session.updated", updated
            assert updated.session.audio.input.turn_detection.interrupt_response is True
            assert updated.session.audio.output.format.type == "audio/pcm"

            async def send_audio(data: bytes) -> None:
                await conn.input_audio_buffer.append(audio=base64.b64encode(data).decode("ascii"))

            mic = Mic(send_audio, 24000, "pcm_s16le", 40, pace=2.0)
            mic.start()
            mic.say(speech)
            # ---- turn 1: speech in -> transcript -> streamed reply -> response.done with metrics
            seen: list[str] = []
            transcript = None
            audio: list[np.ndarray] = []
            done = None
            while done is None:
                ev = await asyncio.wait_for(conn.recv(), 60)
                seen.append(ev.type)
                if ev.type == "conversation.item.input_audio_transcription.completed":
                    transcript = ev.transcript
                elif ev.type == "response.output_audio.delta":
                    audio.append(np.frombuffer(base64.b64decode(ev.delta), "<i2") / 32768.0)
                elif ev.type == "response.done":
                    done = ev.response
                elif ev.type == "error":
                    raise AssertionError(ev.error)
            assert transcript is not None and "gregson" in transcript.lower(), transcript
            order = [seen.index(t) for t in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                                             "input_audio_buffer.committed", "response.created",
                                             "response.output_audio.delta", "response.done")]
            assert order == sorted(order), seen
            reply = np.concatenate(audio)
            assert len(reply) > 0.3 * 24000 and rms(reply) > 0.01  # real speech, not silence
            assert done.status == "completed", done.status_details
            m = done.model_extra["realtime_metrics"]
            assert all(k in m for k in METRICS), m
            assert 0 < m["turn_latency_ms"] < 30000 and m["llm_ttft_ms"] > 0 and m["tts_ttfa_ms"] > 0
            assert abs(m["audio_ms"] - 1000 * len(reply) / 24000) < 1.0
            assert done.usage.output_tokens > 0
            spoken1 = done.output[0].content[0].transcript
            assert spoken1

            # ---- turn 2: a long reply, interrupted by speech while it plays
            await conn.session.update(session={"type": "realtime", "max_output_tokens": 400})
            mic.say(speech)
            rid = item_id = None
            got_audio_ms = 0.0
            after_cancel = 0
            cancelled = None
            while cancelled is None:
                ev = await asyncio.wait_for(conn.recv(), 60)
                if ev.type == "response.created":
                    rid = ev.response.id
                elif ev.type == "response.output_audio.delta" and ev.response_id == rid:
                    if item_id is None:
                        item_id = ev.item_id
                        mic.say(speech)  # the user talks over the agent
                    got_audio_ms += len(base64.b64decode(ev.delta)) / 2 / 24.0
                elif ev.type == "response.done" and ev.response.id == rid:
                    cancelled = ev.response
                elif ev.type == "error":
                    raise AssertionError(ev.error)
            assert cancelled.status == "cancelled", cancelled.status
            assert cancelled.status_details.reason == "turn_detected"
            mc = cancelled.model_extra["realtime_metrics"]
            assert mc["interrupted"] is True and mc["played_ms"] <= mc["audio_ms"] + 1
            assert mc["llm_tokens"] < 400  # cut short, not run to its end
            # The client played only part of it: truncate, and the server's transcript follows.
            await conn.conversation.item.truncate(item_id=item_id, content_index=0,
                                                  audio_end_ms=int(min(got_audio_ms, 400)))
            truncated = None
            t_end = time.monotonic() + 30
            while truncated is None and time.monotonic() < t_end:
                ev = await asyncio.wait_for(conn.recv(), 30)
                if ev.type == "response.output_audio.delta" and ev.response_id == rid:
                    after_cancel += 1
                elif ev.type == "conversation.item.truncated":
                    truncated = ev
                elif ev.type == "error":
                    raise AssertionError(ev.error)
            assert truncated is not None and truncated.item_id == item_id
            assert after_cancel == 0  # audio of the cancelled reply stopped at once
            sess = next(s for s in live.agent.sessions.values() if any(t["response_id"] == rid for t in s.turns))
            hist = [h for h in sess.history.items if h["role"] == "assistant"]
            full = cancelled.output[0].content[0].transcript if cancelled.output[0].content else ""
            assert len(hist[-1]["content"]) <= len(full)
            assert hist[-1]["content"] == full[:len(hist[-1]["content"])].rstrip()
            await mic.stop()

    asyncio.run(run())


# ---- errors on /v1/realtime: an error event, never a disconnect --------------------------------------

def test_unsupported_events_get_error_events_and_the_session_goes_on(live) -> None:  # noqa: ANN001
    async def run() -> None:
        async with websockets.connect(f"{live.ws}/v1/realtime") as ws:
            first = json.loads(await ws.recv())
            assert first["type"] == "session.created"

            async def expect_error(frame: str, code: str) -> dict:
                await ws.send(frame)
                while True:
                    ev = json.loads(await asyncio.wait_for(ws.recv(), 10))
                    if ev["type"] == "error":
                        assert ev["error"]["code"] == code, ev
                        return ev
            ev = await expect_error(json.dumps({"type": "output_audio_buffer.clear", "event_id": "e1"}), "unsupported")
            assert ev["error"]["event_id"] == "e1"
            await expect_error(json.dumps({"type": "no.such.event"}), "unknown_event")
            await expect_error("{not json", "invalid_frame")
            await expect_error(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "audio": {"input": {"format": {"type": "audio/opus"}}}}}), "unsupported")
            await expect_error(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "audio": {"output": {"voice": "nobody"}}}}), "unsupported")
            # tiny.en hears English only: another transcription language is refused, not ignored
            ev = await expect_error(json.dumps({"type": "session.update", "session": {"type": "realtime", "audio": {
                "input": {"transcription": {"model": "whisper-1", "language": "fr"}}}}}), "unsupported")
            assert "'fr'" in ev["error"]["message"] and "en" in ev["error"]["message"], ev
            await expect_error(json.dumps({"type": "conversation.item.truncate", "item_id": "item_nope",
                                           "content_index": 0, "audio_end_ms": 10}), "item_not_found")
            await expect_error(json.dumps({"type": "conversation.item.delete", "item_id": "item_nope"}), "item_not_found")
            await expect_error(json.dumps({"type": "response.cancel"}), "response_cancel_not_active")
            await expect_error(json.dumps({"type": "input_audio_buffer.append", "audio": "%%%"}), "invalid_frame")
            # still open: a text turn in μ-law output gets a spoken reply
            await ws.send(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "audio": {"output": {"format": {"type": "audio/pcmu"}}}}}))
            await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}}))
            await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 12,
                                                                             "metadata": {"turn": "text"}}}))
            audio = bytearray()
            while True:
                ev = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if ev["type"] == "response.output_audio.delta":
                    audio += base64.b64decode(ev["delta"])
                elif ev["type"] == "response.done":
                    break
                elif ev["type"] == "error":
                    raise AssertionError(ev)
            resp = ev["response"]
            assert resp["status"] in ("completed", "incomplete") and resp["metadata"] == {"turn": "text"}
            assert resp["audio"]["output"]["format"]["type"] == "audio/pcmu"
            pcm = ulaw_decode(np.frombuffer(bytes(audio), np.uint8)) / 32768.0
            assert len(pcm) > 0.3 * 8000 and rms(pcm) > 0.01
            assert resp["realtime_metrics"]["turn_latency_ms"] is None  # no speech turn to measure from

    asyncio.run(run())


def test_deleted_item_leaves_what_the_model_sees(live) -> None:  # noqa: ANN001
    """conversation.item.delete: the server answers conversation.item.deleted, the next item's
    previous_item_id skips the deleted one, and the next response's prompt is shorter by the deleted
    item (usage.input_tokens falls although the conversation has grown by a reply); deleting it
    again is item_not_found."""
    long = "Remember these words for later: " + ", ".join(f"word{i}" for i in range(40)) + "."

    async def run() -> None:
        async with websockets.connect(f"{live.ws}/v1/realtime") as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"

            async def until(kind: str) -> dict:
                while True:
                    ev = json.loads(await asyncio.wait_for(ws.recv(), 60))
                    if ev["type"] == "error":
                        raise AssertionError(ev)
                    if ev["type"] == kind:
                        return ev

            async def create(iid: str, text: str) -> dict:
                await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                    "id": iid, "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}))
                return await until("conversation.item.done")

            async def respond() -> int:
                await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 2}}))
                done = (await until("response.done"))["response"]
                replies.append(done["output"][0])
                return done["usage"]["input_tokens"]

            replies: list[dict] = []

            await create("item_a", long)
            await create("item_b", "Say hello.")
            await ws.send(json.dumps({"type": "conversation.item.retrieve", "item_id": "item_b"}))
            got = (await until("conversation.item.retrieved"))["item"]
            assert got["id"] == "item_b" and got["role"] == "user" and got["content"] == [
                {"type": "input_text", "text": "Say hello."}]
            with_a = await respond()
            await ws.send(json.dumps({"type": "conversation.item.delete", "item_id": "item_a"}))
            assert (await until("conversation.item.deleted"))["item_id"] == "item_a"
            without_a = await respond()
            assert without_a < with_a - 40, (with_a, without_a)  # the 40 words left; a 2-token reply came in
            # a spoken reply comes back as an audio item with its transcript
            await ws.send(json.dumps({"type": "conversation.item.retrieve", "item_id": replies[0]["id"]}))
            got = (await until("conversation.item.retrieved"))["item"]
            assert got["role"] == "assistant" and got["content"][0]["type"] == "output_audio"
            assert got["content"][0]["transcript"] == replies[0]["content"][0]["transcript"]
            await ws.send(json.dumps({"type": "conversation.item.delete", "item_id": "item_a"}))
            err = json.loads(await asyncio.wait_for(ws.recv(), 10))
            assert err["type"] == "error" and err["error"]["code"] == "item_not_found"
            await ws.send(json.dumps({"type": "conversation.item.delete", "item_id": "item_c_missing"}))
            assert json.loads(await asyncio.wait_for(ws.recv(), 10))["error"]["code"] == "item_not_found"
            await ws.send(json.dumps({"type": "conversation.item.retrieve", "item_id": "item_a"}))  # (deleted)
            assert json.loads(await asyncio.wait_for(ws.recv(), 10))["error"]["code"] == "item_not_found"
            c = await create("item_c", "And goodbye.")
            assert c["previous_item_id"] not in ("item_a", None)

    asyncio.run(run())


def test_client_commit_mode_without_server_vad(live, speech16) -> None:  # noqa: ANN001
    """turn_detection null: no VAD events, the client commits, then asks for the response."""
    speech = resample(speech16, 16000, 24000)

    async def run() -> None:
        async with websockets.connect(f"{live.ws}/v1/realtime") as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "max_output_tokens": 8, "audio": {"input": {"turn_detection": None}}}}))
            upd = json.loads(await ws.recv())
            assert upd["type"] == "session.updated" and upd["session"]["audio"]["input"]["turn_detection"] is None
            pcm = pack_pcm(np.concatenate([speech, np.zeros(12000, np.float32)]), "pcm_s16le")
            for i in range(0, len(pcm), 48000):  # faster than real time: nothing waits for the VAD
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(pcm[i:i + 48000]).decode()}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            kinds, transcript = [], None
            while transcript is None:
                ev = json.loads(await asyncio.wait_for(ws.recv(), 60))
                kinds.append(ev["type"])
                if ev["type"] == "conversation.item.input_audio_transcription.completed":
                    transcript = ev["transcript"]
            assert "gregson" in transcript.lower(), transcript
            assert "input_audio_buffer.committed" in kinds
            assert not any(k.startswith("input_audio_buffer.speech") or k == "response.created" for k in kinds)
            await ws.send(json.dumps({"type": "response.create"}))
            while True:
                ev = json.loads(await asyncio.wait_for(ws.recv(), 60))
                assert ev["type"] != "error", ev
                if ev["type"] == "response.done":
                    break
            assert ev["response"]["status"] in ("completed", "incomplete")
            assert ev["response"]["usage"]["output_tokens"] <= 8

    asyncio.run(run())


def test_transcription_prompt_reaches_the_decodes(live, speech16) -> None:  # noqa: ANN001
    """A session.update's transcription prompt goes before the user's speech in the ASR's decodes
    (the running stream's next decode): in a style of its own (lower case, no punctuation), the
    turn's transcript takes that style."""
    speech = resample(speech16, 16000, 24000)
    prompt = "hello my name is bob and i like writing without capitals or punctuation"

    async def run() -> str:
        async with websockets.connect(f"{live.ws}/v1/realtime") as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
                "turn_detection": None, "transcription": {"model": "whisper-1", "prompt": prompt}}}}}))
            upd = json.loads(await ws.recv())
            assert upd["session"]["audio"]["input"]["transcription"]["prompt"] == prompt, upd
            await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
                "transcription": {"model": "whisper-1", "prompt": prompt, "language": "EN"}}}}}))
            upd = json.loads(await ws.recv())
            assert upd["session"]["audio"]["input"]["transcription"]["language"] == "en", upd
            pcm = pack_pcm(np.concatenate([speech, np.zeros(12000, np.float32)]), "pcm_s16le")
            for i in range(0, len(pcm), 48000):
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(pcm[i:i + 48000]).decode()}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            while True:
                ev = json.loads(await asyncio.wait_for(ws.recv(), 60))
                assert ev["type"] != "error", ev
                if ev["type"] == "conversation.item.input_audio_transcription.completed":
                    return ev["transcript"]

    transcript = asyncio.run(run())
    assert "turned sharply" in transcript and transcript == transcript.lower() and "." not in transcript, transcript


def test_history_is_bounded_and_truncation_cuts_at_words() -> None:
    from realtime.agent import History, _cut_words, _Response

    h = History(max_messages=4, max_chars=60)
    for i in range(6):
        h.add("user", f"question {i}")
        h.add("assistant", f"answer {i}")
    assert len(h.items) <= 4 and h.items[0]["role"] == "user" and h.items[-1]["content"] == "answer 5"
    h.add("user", "x" * 100, "item_x")  # one long message: everything older goes, the message stays
    assert [m["content"] for m in h.items] == ["x" * 100] and h.ids == ["item_x"]
    d = History(max_messages=8, max_chars=1000)  # deleted items leave, ids kept in step with them
    for i, role in enumerate(("user", "assistant", "user")):
        d.add(role, f"m{i}", f"item_{i}")
    assert d.delete("item_1") == (True, "item_0") and d.delete("item_1") == (False, None)
    assert [m["content"] for m in d.items] == ["m0", "m2"] and d.ids == ["item_0", "item_2"]
    d.add("assistant", "m3", "item_3")
    assert d.delete("item_2") == (True, "item_0") and d.ids == ["item_0", "item_3"]
    # the first user item gone: the assistant's reply stays in the conversation, but a chat template
    # wants a user turn first, so the model does not see it
    assert d.delete("item_0") == (True, None) and d.ids == ["item_3"]
    assert [m["content"] for m in d.messages("s")] == ["s", "Hello."]
    msgs = h.messages("system prompt")
    assert msgs[0] == {"role": "system", "content": "system prompt"} and len(msgs) == 2
    assert _cut_words("hello there world", 8) == "hello" and _cut_words("hello there", 99) == "hello there"
    r = _Response(id="r", item_id="i", t_turn_end=None, t_final=None, max_tokens=8)
    r.text, r.audio_ms, r.status = "one two three four", 4000.0, "completed"
    assert r.text_at(2000, 0.001) == "one two" and r.text_at(5000, 0.001) == "one two three four"
    r.status = "cancelled"  # cut short: the speaking rate decides, capped at what was written
    assert r.text_at(300, 0.015) == "one" and r.text_at(500, 0.015) == "one two" and r.text_at(60000, 0.015) == "one two three four"


# ---- Twilio Media Streams ---------------------------------------------------------------------------

class TwilioPeer:
    """What Twilio sends on a bidirectional <Connect><Stream>, and a caller's phone that plays the
    agent's audio in real time and echoes each mark when playback reaches it."""

    def __init__(self, ws) -> None:  # noqa: ANN001
        self.ws = ws
        self.sid = "MZ" + "0" * 30
        self.seq = 0
        self.chunk = 0
        self.media: list[bytes] = []
        self.marks: list[str] = []
        self.clears = 0
        self.playing_until = 0.0
        self.pending: list[tuple[float, str]] = []
        self.events: list[tuple[float, str]] = []

    def _next(self) -> str:
        self.seq += 1
        return str(self.seq)

    async def send(self, msg: dict) -> None:
        await self.ws.send(json.dumps(msg))

    async def connect(self) -> None:
        await self.send({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        await self.send({"event": "start", "sequenceNumber": self._next(), "streamSid": self.sid,
                         "start": {"accountSid": "AC" + "1" * 32, "streamSid": self.sid, "callSid": "CA" + "2" * 32,
                                   "tracks": ["inbound"], "customParameters": {"caller": "test"},
                                   "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}})

    async def send_media(self, payload: bytes) -> None:
        assert len(payload) == 160
        self.chunk += 1
        await self.send({"event": "media", "sequenceNumber": self._next(), "streamSid": self.sid,
                         "media": {"track": "inbound", "chunk": str(self.chunk), "timestamp": str(20 * (self.chunk - 1)),
                                   "payload": base64.b64encode(payload).decode("ascii")}})

    async def echo_due_marks(self) -> None:
        now = time.monotonic()
        while self.pending and self.pending[0][0] <= now:
            _, name = self.pending.pop(0)
            await self.send({"event": "mark", "sequenceNumber": self._next(), "streamSid": self.sid,
                             "mark": {"name": name}})

    async def receive(self) -> None:
        async for frame in self.ws:
            msg = json.loads(frame)
            now = time.monotonic()
            assert msg["streamSid"] == self.sid, msg
            self.events.append((now, msg["event"]))
            if msg["event"] == "media":
                data = base64.b64decode(msg["media"]["payload"])
                assert len(data) == 160  # 20 ms frames
                self.media.append(data)
                self.playing_until = max(now, self.playing_until) + 0.02
            elif msg["event"] == "mark":
                self.marks.append(msg["mark"]["name"])
                self.pending.append((max(now, self.playing_until), msg["mark"]["name"]))
            elif msg["event"] == "clear":
                self.clears += 1
                self.playing_until = now
                for _, name in self.pending:  # Twilio answers a clear with the pending marks
                    await self.send({"event": "mark", "sequenceNumber": self._next(), "streamSid": self.sid,
                                     "mark": {"name": name}})
                self.pending.clear()
            else:
                raise AssertionError(f"unexpected message {msg}")


def test_twilio_call_gets_media_mark_and_clear(live, speech16) -> None:  # noqa: ANN001
    speech8 = resample(speech16, 16000, 8000)

    async def run() -> None:
        async with websockets.connect(f"{live.ws}/v1/telephony/twilio") as ws:
            peer = TwilioPeer(ws)
            # bad messages are logged and skipped, the call stays up
            await ws.send("not json")
            await peer.send({"event": "media", "streamSid": peer.sid, "media": {"payload": "AAAA"}})  # before start
            await peer.connect()
            await peer.send({"event": "media", "streamSid": peer.sid, "media": {"payload": "@@@"}})
            await peer.send({"event": "bogus"})
            await peer.send({"event": "dtmf", "streamSid": peer.sid, "dtmf": {"track": "inbound_track", "digit": "5"}})
            rx = asyncio.create_task(peer.receive())

            async def send(data: bytes) -> None:
                await peer.send_media(data)
                await peer.echo_due_marks()

            mic = Mic(send, 8000, "mulaw", 20, pace=1.0)  # Twilio sends 20 ms every 20 ms
            mic.start()
            mic.say(speech8)
            t_end = time.monotonic() + 90
            while not peer.marks and time.monotonic() < t_end:  # turn 1: the whole reply, then a mark
                await asyncio.sleep(0.05)
                if rx.done():
                    rx.result()
            assert peer.marks, "no mark after the agent's utterance"
            n1 = len(peer.media)
            reply = ulaw_decode(np.frombuffer(b"".join(peer.media), np.uint8)) / 32768.0
            assert n1 * 0.02 > 0.3 and rms(reply) > 0.01  # real audio came back
            mark_at = max(t for t, e in peer.events if e == "mark")
            assert all(t <= mark_at for t, e in peer.events if e == "media")  # the mark follows the utterance
            while peer.pending and time.monotonic() < t_end:  # the caller hears the reply to its end
                await asyncio.sleep(0.05)
            assert not peer.pending and peer.clears == 0
            await asyncio.sleep(0.2)  # the echo reaches the server
            # turn 2: while the agent answers, the caller talks over it -> clear
            mic.say(speech8)
            while len(peer.media) == n1 and time.monotonic() < t_end:
                await asyncio.sleep(0.02)
            mic.say(speech8)
            while not peer.clears and time.monotonic() < t_end:
                await asyncio.sleep(0.05)
                if rx.done():
                    rx.result()
            assert peer.clears >= 1, "no clear on barge-in"
            sess = next(s for s in live.agent.sessions.values() if s.id == peer.sid)
            assert sess.turns[0]["interrupted"] is False and sess.turns[-1]["interrupted"] is True
            # cut while generating (cancelled) or, on a fast machine, while still playing: either
            # way the caller heard only part of it
            assert sess.turns[-1]["played_ms"] < sess.turns[-1]["audio_ms"]
            await mic.stop()
            await peer.send({"event": "stop", "sequenceNumber": peer._next(), "streamSid": peer.sid,
                             "stop": {"accountSid": "AC", "callSid": "CA" + "2" * 32}})
            await asyncio.wait_for(rx, 10)  # the server ends the call after 'stop'

    asyncio.run(run())


# ---- the CLI ---------------------------------------------------------------------------------------

def test_agent_cli_writes_a_spoken_reply(live, tmp_path) -> None:  # noqa: ANN001
    out = tmp_path / "reply.wav"
    r = subprocess.run([sys.executable, "-m", "realtime.cli", "agent", "--wav", str(ASSET), "-o", str(out),
                        "--url", f"{live.ws}/v1/realtime", "--max-tokens", "16"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "gregson" in r.stdout.lower(), r.stdout
    audio, rate = sf.read(out, dtype="float32")
    assert rate == 24000 and len(audio) > 0.3 * rate and rms(audio) > 0.01
    bad = subprocess.run([sys.executable, "-m", "realtime.cli", "agent", "--wav", str(tmp_path / "missing.wav"),
                          "-o", str(out), "--url", f"{live.ws}/v1/realtime"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "cannot read" in bad.stderr
    # the turn shows up in /metrics, and the agent in /v1/models
    import httpx

    text = httpx.get(f"{live.http}/metrics").text
    count = next(line for line in text.splitlines() if line.startswith("realtime_agent_turn_latency_seconds_count"))
    assert float(count.split()[-1]) >= 1
    kinds = {m["kind"] for m in httpx.get(f"{live.http}/v1/models").json()["data"]}
    assert {"tts", "asr", "text", "agent"} <= kinds


# ---- preemptive replies: the session driven with the ASR's own messages, in order ----------------

QUESTION = "What is the capital of France?"


async def _until(cond, timeout: float = 60.0) -> None:  # noqa: ANN001
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        await asyncio.sleep(0.01)


async def _events_until_finished(s) -> list:  # noqa: ANN001
    from realtime.agent import ResponseFinished

    out: list = []
    while not any(isinstance(e, ResponseFinished) for e in out):
        out += await asyncio.wait_for(s.next_events(), 60)
    return out


def _queued(s) -> list:  # noqa: ANN001
    out = []
    while not s._events.empty():
        out.append(s._events.get_nowait())
    return out


async def _turn(live, preemptive: bool) -> tuple[list, object]:  # noqa: ANN001
    """speech_started, [the preview when silence began,] speech_stopped, final: as the ASR sends them."""
    from realtime.agent import ResponseAudio

    s = live.agent.new_session(live.state, AgentConfig(max_tokens=REPLY_TOKENS, temperature=0.0, seed=0,
                                                       preemptive=preemptive))
    await s.start()
    try:
        await s._on_asr({"type": "speech_started", "at_ms": 300})
        await s._on_asr({"type": "final_preview", "text": QUESTION, "end_ms": 2000})
        spec = s._spec
        seen = []
        if preemptive:
            assert spec is not None and spec.speculative
            # it runs unheard: its audio waits, nothing of it reaches the client
            await _until(lambda: any(isinstance(e, ResponseAudio) for e in spec.held))
            assert spec.text_job.speculative and spec.tts_job.speculative  # it runs in the gaps
            seen = _queued(s)
            assert [type(e).__name__ for e in seen] == ["UserSpeechStarted"]
        else:
            assert spec is None
        await s._on_asr({"type": "speech_stopped", "at_ms": 2150})
        await s._on_asr({"type": "final", "text": QUESTION, "start_ms": 300, "end_ms": 2150})
        if spec is not None:  # committed: wanted now, its jobs ranked by their own deadlines
            assert not spec.speculative and not spec.text_job.speculative and not spec.tts_job.speculative
        events = seen + _queued(s) + await _events_until_finished(s)
        return events, s
    finally:
        await s.close()
        live.agent.end_session(s)


async def test_preemptive_reply_is_held_then_sent_as_the_turns_reply(live) -> None:  # noqa: ANN001
    from realtime.agent import ResponseAudio, ResponseFinished, ResponseText

    def committed() -> float:
        lines = live.state.metrics.render().splitlines()
        return float(next(x for x in lines if x.startswith('realtime_agent_preemptive_replies{outcome="committed"}'))
                     .split()[-1])

    before = committed() if live.agent._gauge else 0.0
    events, s = await _turn(live, preemptive=True)
    assert committed() == before + 1  # /metrics
    kinds = [type(e).__name__ for e in events]
    assert kinds[:4] == ["UserSpeechStarted", "UserSpeechStopped", "UserTurn", "ResponseStarted"], kinds
    assert kinds[-1] == "ResponseFinished" and kinds.count("ResponseStarted") == 1
    fin = events[-1]
    assert isinstance(fin, ResponseFinished) and fin.status == "completed"
    assert fin.metrics["preemptive_ms"] > 0 and fin.metrics["turn_latency_ms"] is not None
    assert s.spec_stats == {"started": 1, "committed": 1, "dropped": 0}
    text = "".join(e.delta for e in events if isinstance(e, ResponseText))
    assert text.strip() == fin.transcript and sum(e.duration_ms for e in events if isinstance(e, ResponseAudio)) > 0
    assert [m["role"] for m in s.history.items] == ["user", "assistant"]
    assert s.history.items[0]["content"] == QUESTION and s.history.items[1]["content"] == fin.spoken_transcript
    # the same prompt as a reply started after the final: greedy, so the same words
    events2, _ = await _turn(live, preemptive=False)
    fin2 = events2[-1]
    assert fin2.metrics["preemptive_ms"] is None and fin2.transcript == fin.transcript


async def test_preemptive_reply_is_dropped_unheard_when_the_user_goes_on(live) -> None:  # noqa: ANN001
    from realtime.agent import ResponseFinished, ResponseStarted

    s = live.agent.new_session(live.state, AgentConfig(max_tokens=REPLY_TOKENS, temperature=0.0, seed=0))
    await s.start()
    try:
        await s._on_asr({"type": "speech_started", "at_ms": 300})
        await s._on_asr({"type": "final_preview", "text": "What is the", "end_ms": 900})
        first = s._spec
        await _until(lambda: first.text_job is not None and first.tts_job is not None)
        await s._on_asr({"type": "speech_resumed"})  # a pause, not the end of the turn
        assert s._spec is None and not first.text_job.active and not first.tts_job.active
        await s._on_asr({"type": "final_preview", "text": "What is the capital of", "end_ms": 1800})
        second = s._spec
        assert second is not None and second is not first
        await s._on_asr({"type": "speech_stopped", "at_ms": 2150})
        await s._on_asr({"type": "final", "text": QUESTION, "start_ms": 300, "end_ms": 2150})  # not the preview
        assert second.task.done() and (second.text_job is None or not second.text_job.active)
        events = _queued(s) + await _events_until_finished(s)
        kinds = [type(e).__name__ for e in events]
        assert kinds[:4] == ["UserSpeechStarted", "UserSpeechStopped", "UserTurn", "ResponseStarted"], kinds
        assert sum(isinstance(e, ResponseStarted) for e in events) == 1
        fin = next(e for e in events if isinstance(e, ResponseFinished))
        assert fin.metrics["preemptive_ms"] is None and fin.status == "completed"
        assert s.spec_stats == {"started": 2, "committed": 0, "dropped": 2}
        assert [m["content"] for m in s.history.items] == [QUESTION, fin.spoken_transcript]
    finally:
        await s.close()
        live.agent.end_session(s)


async def test_no_preemptive_reply_while_text_slots_are_short(live) -> None:  # noqa: ANN001
    """A guess must not take the last free KV-cache slot from another caller's real reply."""
    text = live.state.services["text"]
    pool = text.prefill_lane.pool
    taken = [pool.take() for _ in range(pool.available() - 1)]  # as if other replies held them
    s = live.agent.new_session(live.state, AgentConfig(max_tokens=REPLY_TOKENS, temperature=0.0, seed=0))
    await s.start()
    try:
        assert text.free_slots() == 1
        await s._on_asr({"type": "speech_started", "at_ms": 300})
        await s._on_asr({"type": "final_preview", "text": QUESTION, "end_ms": 2000})
        assert s._spec is None and s.spec_stats["started"] == 0
        for slot in taken:
            pool.give(slot)
        taken = []
        await s._on_asr({"type": "final_preview", "text": QUESTION + " Please.", "end_ms": 2100})
        assert s._spec is not None and s.spec_stats["started"] == 1
    finally:
        for slot in taken:
            pool.give(slot)
        await s.close()
        live.agent.end_session(s)
    assert s.spec_stats == {"started": 1, "committed": 0, "dropped": 1}
