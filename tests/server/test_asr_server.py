"""Streaming ASR through the one scheduler: a real uvicorn server, real tiny.en and Silero weights,
real websockets / httpx clients."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import jiwer
import msgpack
import numpy as np
import pytest
import soundfile as sf
import torch
import websockets
from liveserver import serve

from realtime.asr_service import ASRJob, ASRService, DecodeLane, Utterance, VadLane
from realtime.codecs.resample import pack_pcm, resample
from realtime.config import ServerConfig
from realtime.engines.asr_policy import LocalAgreementPolicy
from realtime.protocol.asr import ASRParams
from realtime.scheduler import pick
from realtime.server import create_app

ASSET = Path(__file__).resolve().parents[1] / "assets" / "arctic_a0009.wav"
ARCTIC = "He turned sharply, and faced Gregson across the table."

SENTENCES = [
    "The weather is nice today.", "Please open the window.", "I would like a cup of coffee.",
    "The train leaves at noon.", "She reads a book every night.", "We walked along the river.",
    "My brother plays the guitar.", "The children are playing outside.", "Turn left at the next corner.",
    "He forgot his keys at home.", "The market opens early in the morning.", "Can you help me with this?",
    "The dog is sleeping on the sofa.", "They moved to a new house last year.", "Dinner will be ready soon.",
    "I lost my phone yesterday.", "The meeting starts in ten minutes.", "Water boils at a high temperature.",
    "She painted the door green.", "Thank you for your patience.",
]


def norm(text: str) -> str:
    return " ".join(re.sub(r"[^\w' ]+", " ", text.lower()).split())


@pytest.fixture(scope="module")
def live(piper_backend):  # noqa: ANN001, ANN201
    cfg = ServerConfig(warmup=True)
    app = create_app(cfg, tts=piper_backend, services=[ASRService(cfg)])
    with serve(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def arctic() -> np.ndarray:
    audio, rate = sf.read(ASSET, dtype="float32")
    assert rate == 16000
    return audio


@pytest.fixture(scope="module")
def spoken(piper_backend) -> list[np.ndarray]:  # noqa: ANN001
    """SENTENCES spoken by the embedded Piper voice, float32 at its 22.05 kHz."""
    return [piper_backend.voice.synthesize(s).astype(np.float32) for s in SENTENCES]


@dataclass
class Result:
    messages: list[tuple[float, dict]] = field(default_factory=list)  # (client monotonic time, message)
    t0: float = 0.0  # send time of stream sample 0 (paced streams)
    pace: float = 1.0
    close_code: int | None = None

    def of(self, kind: str) -> list[dict]:
        return [m for _, m in self.messages if m["type"] == kind]

    def sent_at(self, ms: float) -> float:
        return self.t0 + ms / 1000 / self.pace


async def stream(url: str, audio: np.ndarray, rate: int = 16000, fmt: str = "pcm_s16le", chunk_ms: int = 20,
                 pace: float | None = 1.0, interim: bool = True, json_frames: bool = False,
                 preview: bool = False, words: bool = False, task: str | None = None,
                 expect_ready: bool = True, prompt: str | None = None) -> Result:
    """Send ``audio`` (float, at ``rate``) in chunks at ``pace`` x real time, then stop; collect replies."""
    res = Result(pace=pace or 1.0)

    def enc(msg: dict) -> bytes | str:
        if json_frames:
            return json.dumps({k: base64.b64encode(v).decode() if isinstance(v, bytes) else v
                               for k, v in msg.items()})
        return msgpack.packb(msg)

    async with websockets.connect(url, max_size=1 << 22) as ws:
        asked = {"preview": preview, "words": words, "task": task, "prompt": prompt}
        start = {"type": "start", "sample_rate": rate, "format": fmt, "interim": interim,
                 **{k: v for k, v in asked.items() if v}}
        await ws.send(enc(start))
        ready = await ws.recv()
        ready = json.loads(ready) if isinstance(ready, str) else msgpack.unpackb(ready)
        res.messages.append((time.monotonic(), ready))
        if not expect_ready:  # (a start the server refuses: its error, then the close)
            with contextlib.suppress(websockets.ConnectionClosed):
                await ws.recv()
            res.close_code = ws.close_code
            return res
        assert ready["type"] == "ready", ready

        async def send() -> None:
            n = rate * chunk_ms // 1000
            res.t0 = time.monotonic()
            for i in range(0, len(audio), n):
                await ws.send(enc({"type": "audio", "audio": pack_pcm(audio[i:i + n], fmt)}))
                if pace:
                    await asyncio.sleep(max(0.0, res.t0 + (i + n) / rate / pace - time.monotonic()))
            await ws.send(enc({"type": "stop"}))

        sender = asyncio.create_task(send())
        async for frame in ws:
            msg = json.loads(frame) if isinstance(frame, str) else msgpack.unpackb(frame)
            res.messages.append((time.monotonic(), msg))
        await sender
        res.close_code = ws.close_code
    return res


def speech(audio: np.ndarray, lead_s: float = 0.3, tail_s: float = 1.0, rate: int = 16000) -> np.ndarray:
    return np.concatenate([np.zeros(int(lead_s * rate), np.float32), audio.astype(np.float32),
                           np.zeros(int(tail_s * rate), np.float32)])


async def test_realtime_stream_partials_then_final(live, arctic) -> None:  # noqa: ANN001
    before = live.state.metrics.asr_final.counts[:]
    lane = live.state.services["asr"].decode_lane
    steps0, busy0 = lane.steps, lane.busy_s
    audio = speech(arctic)
    res = await stream(f"{live.ws}/v1/asr", audio, chunk_ms=20, pace=1.0)
    step = (lane.busy_s - busy0) / max(1, lane.steps - steps0)  # this run's decode step (shared CPU)
    assert res.close_code == 1000
    kinds = [m["type"] for _, m in res.messages]
    assert kinds[0] == "ready" and kinds[-1] == "done"
    assert kinds.count("speech_started") == 1 and kinds.count("speech_stopped") == 1
    assert kinds.index("speech_started") < kinds.index("partial") < kinds.index("speech_stopped")
    assert "final_preview" not in kinds and "speech_resumed" not in kinds  # only when asked for
    finals = res.of("final")
    assert len(finals) == 1
    assert norm(finals[0]["text"]) == norm(ARCTIC)
    end_ms = 300 + len(arctic) / 16
    speech_end = res.sent_at(end_ms)  # the client sent the last speech sample here
    partials = [(t, m) for t, m in res.messages if m["type"] == "partial"]
    assert partials and partials[0][1]["end_ms"] < end_ms - 500  # decoded from audio mid-speech
    if step < 1.0:  # wall clock: only meaningful when the shared CPU is not oversubscribed
        assert partials[0][0] < speech_end, (partials[0][0] - speech_end, step)  # while still talking
    t_final = next(t for t, m in res.messages if m["type"] == "final")
    assert speech_end < t_final < speech_end + max(3.0, 0.7 + 4 * step), (t_final - speech_end, step)
    f = finals[0]
    assert 0 <= f["start_ms"] <= 400 and 3000 < f["end_ms"] <= 300 + len(arctic) / 16 + 400
    assert "words" not in f  # only when the start asks for them
    # partials are prefixes in the making: the last one before the final covers most of it
    assert norm(res.of("partial")[-1]["text"]).split()[0] == "he"
    stats = res.of("done")[0]["stats"]
    assert stats["finals"] == 1 and stats["audio_ms"] == pytest.approx(len(audio) / 16, abs=1)
    assert 0 < stats["rtf"] < 1.0 and stats["final_latency_ms_p50"] > 0
    assert sum(live.state.metrics.asr_final.counts) == sum(before) + 1
    assert "realtime_asr_final_latency_seconds_count" in live.state.metrics.render()


async def test_four_streams_keep_up_in_real_time(live, arctic) -> None:  # noqa: ANN001
    # Each stream: the sentence twice with a pause; four at once, in real time, 20 ms chunks.
    one = speech(arctic, lead_s=0.3, tail_s=1.0)
    audio = np.concatenate([one, one])
    lane = live.state.services["asr"].decode_lane
    t0 = time.monotonic()
    results = await asyncio.gather(*[stream(f"{live.ws}/v1/asr", audio, pace=1.0) for _ in range(4)])
    wall = time.monotonic() - t0
    steps = [s for s in lane.history if s[0] >= t0]
    # This CPU is shared with other test runs, so waits are counted in decode steps: after its end
    # of speech was heard, a final waits for the step in flight, perhaps one step of partials that
    # were due before the VAD saw the silence, and its own step (none when the decode at the onset
    # of silence already was the final). More steps between would be a queue building up.
    longest = max(b - a for a, b in steps)
    bound = max(3.0, 0.7 + 3 * longest)  # seconds, for the same chain of steps at their slowest
    assert wall < len(audio) / 16000 + bound + 1.0  # the last final came soon after the audio ended
    lags, waits = [], []
    for res in results:
        finals = res.of("final")
        assert [norm(f["text"]) for f in finals] == [norm(ARCTIC)] * 2
        for f in finals:
            # end_ms is the VAD end (speech end + pad), confirmed after ~0.5 s of silence
            heard = res.sent_at(f["end_ms"])
            got = next(t for t, m in res.messages if m is f)
            lags.append(got - heard)
            waits.append(sum(heard < b <= got for _, b in steps))
        stats = res.of("done")[0]["stats"]
        assert stats["rtf"] < 1.0, stats  # each stream costs less than real time
    assert all(0 < x < bound for x in lags), (lags, bound)
    assert max(waits) <= 3, (waits, lags, steps)
    print(f"4 streams: final lag after VAD end {np.median(lags):.2f} s median, {max(lags):.2f} s max "
          f"(bound {bound:.2f} s from the longest decode step, {longest:.2f} s); decode steps waited "
          f"{waits}; rtf {[r.of('done')[0]['stats']['rtf'] for r in results]}")


def test_finals_go_before_partials(live, arctic) -> None:  # noqa: ANN001
    """The scheduling the live test above relies on, decided without a clock race: a stream whose
    utterance ended is picked before streams whose partials fell due up to final_boost_s earlier,
    before their new audio too, and its step carries no plain partials; a re-decode after a step of
    d seconds waits partial_gap * d."""
    svc = live.state.services["asr"]
    cfg = svc.cfg
    vad_lane, lane = VadLane(svc.vad, cfg), DecodeLane(svc.whisper, cfg)  # not the server's: no race
    one = speech(arctic, lead_s=0.3, tail_s=0.0)
    now = time.monotonic()

    def job(ended: bool) -> ASRJob:
        j = svc.new_job(ASRParams())
        j.append(one)
        pol = LocalAgreementPolicy(j.policy_cfg)
        pol.start(0)
        u = Utterance(0, pol)
        if ended:
            u.end, u.ended_at = len(one), now
        else:
            j.partial_due_at = now - 0.9 * cfg.final_boost_s  # due well before the end was heard
            j.push_audio(arctic[:320])  # and new audio waits for the VAD, since just as long
            j.inbox_since = now - 0.9 * cfg.final_boost_s
        j.utts.append(u)
        for ln in (vad_lane, lane):
            ln.add(j)
        return j

    talking = [job(False), job(False)]
    ended = job(True)
    choice = pick([vad_lane, lane], now)
    assert choice is not None and choice.lane is lane and choice.jobs[0] is ended
    assert set(choice.jobs) == {ended, *talking}  # the due partials ride along in the batch...
    lane.run(choice.jobs)
    assert len(lane.history) == 1
    t0, t1 = lane.history[0]
    out = list(ended.output.items)
    assert [m["type"] for m in out] == ["final"] and norm(out[0]["text"]) == norm(ARCTIC)
    assert not ended.utts
    for j in talking:  # ... but are not decoded in the final's step: their partials wait
        assert not j.output.items and j.utts[0].policy.last_decode_ms == 0
        assert j.partial_due_at == now - 0.9 * cfg.final_boost_s
    assert ended.next_partial_at == pytest.approx(t1 + cfg.partial_gap * (t1 - t0), abs=0.05)


def test_final_preview_when_silence_begins_and_speech_resumed(live, arctic) -> None:  # noqa: ANN001
    """For the voice agent's preemptive replies: with ``preview`` on, the decode made when silence
    begins is sent as a ``final_preview``; ``speech_resumed`` says it was a pause, and the final that
    follows the last preview says what that preview said. Stepped as the scheduler would, 20 ms of
    audio at a time, on lanes of our own (no clock race with the server)."""
    svc = live.state.services["asr"]
    vad_lane, lane = VadLane(svc.vad, svc.cfg), DecodeLane(svc.whisper, svc.cfg)
    job = svc.new_job(ASRParams(interim=False, preview=True))
    for ln in (vad_lane, lane):
        ln.add(job)
    z = lambda s: np.zeros(int(s * 16000), np.float32)  # noqa: E731
    core = arctic[int(0.15 * 16000):int(2.95 * 16000)]  # the clip's speech (0.2-2.88 s), little silence
    audio = np.concatenate([z(0.3), core, z(0.25), core, z(1.2)])  # a pause under the VAD's 0.5 s
    msgs: list[dict] = []
    for i in range(0, len(audio), 320):
        job.push_audio(audio[i:i + 320])
        while (choice := pick([vad_lane, lane], time.monotonic())) is not None:
            choice.lane.run(choice.jobs)
        msgs += list(job.output.items)
        job.output.items.clear()
    kinds = [m["type"] for m in msgs]
    assert kinds.count("speech_started") == 1 and kinds.count("final") == 1, kinds
    assert "partial" not in kinds  # interim off: the previews are no partials
    assert "speech_resumed" in kinds and kinds.index("final_preview") < kinds.index("speech_resumed")
    last = max(i for i, k in enumerate(kinds) if k == "final_preview")
    assert kinds.index("speech_resumed", kinds.index("final_preview")) < last < kinds.index("final")
    assert "speech_resumed" not in kinds[last:]
    final = msgs[kinds.index("final")]
    assert msgs[last]["text"] == final["text"] and norm(final["text"]).count("turned sharply and faced") == 2
    # previews come only where silence began: the first pause's covers the first sentence or less
    first = msgs[kinds.index("final_preview")]
    assert len(norm(first["text"]).split()) <= len(norm(ARCTIC).split()) + 1
    print(f"previews: {[(m['end_ms'], m['text']) for m in msgs if m['type'] == 'final_preview']}")


async def test_preview_over_the_socket(live, arctic) -> None:  # noqa: ANN001
    """``preview`` in the start: the decode made when silence began arrives as a final_preview
    before the VAD's end, and the final that follows says the same."""
    lane = live.state.services["asr"].decode_lane
    steps0, busy0 = lane.steps, lane.busy_s
    res = await stream(f"{live.ws}/v1/asr", speech(arctic, tail_s=1.2), pace=1.0, interim=False, preview=True)
    step = (lane.busy_s - busy0) / max(1, lane.steps - steps0)
    kinds = [m["type"] for _, m in res.messages]
    assert kinds.count("final") == 1 and "partial" not in kinds and "speech_resumed" not in kinds, kinds
    final = res.of("final")[0]
    previews = res.of("final_preview")
    if step < 0.5 or previews:  # a machine this slow may reach the VAD's end before the decode
        assert previews and kinds.index("final_preview") < kinds.index("speech_stopped"), (kinds, step)
        assert previews[-1]["text"] == final["text"] and norm(final["text"]) == norm(ARCTIC)
        assert previews[-1]["end_ms"] <= final["end_ms"]


def test_served_numerics_and_asr_exact(live) -> None:  # noqa: ANN001
    """The server runs Whisper with bf16 encoder products where the CPU has them (these tests'
    transcripts come from that path); ``asr_exact`` (``--asr-exact``) keeps float32."""
    from realtime.cli import build_parser
    from realtime.engines.whisper import cpu_has_bf16

    assert live.state.services["asr"].whisper.cpu_native == cpu_has_bf16()
    exact = ASRService(ServerConfig(asr_exact=True))
    exact.load()
    assert not exact.whisper.cpu_native and exact.whisper.dtype == torch.float32
    assert build_parser().parse_args(["serve", "--asr-exact"]).asr_exact


async def test_piper_round_trip_wer(live, piper_backend, spoken) -> None:  # noqa: ANN001
    rate = piper_backend.voice.sample_rate
    gap = np.zeros(int(0.8 * rate), np.float32)
    per_stream = [SENTENCES[i::4] for i in range(4)]
    audios = [np.concatenate([np.concatenate([gap, spoken[j]]) for j in range(i, len(SENTENCES), 4)] + [gap])
              for i in range(4)]
    # 22.05 kHz s16 on the wire (resampled in the server), 10x faster than real time, 4 at once
    results = await asyncio.gather(*[stream(f"{live.ws}/v1/asr", a, rate=rate, chunk_ms=100, pace=10.0,
                                            interim=False) for a in audios])
    refs, hyps = [], []
    for group, res in zip(per_stream, results, strict=True):
        assert res.close_code == 1000 and not res.of("partial")
        finals = [f["text"] for f in res.of("final")]
        assert len(finals) == len(group), finals
        refs += [norm(s) for s in group]
        hyps += [norm(t) for t in finals]
    wer = jiwer.wer(refs, hyps)
    assert wer <= 0.10, (wer, list(zip(refs, hyps, strict=True)))


async def test_speech_longer_than_whisper_window_is_cut(live, piper_backend, spoken) -> None:  # noqa: ANN001
    # ~50 s of speech with pauses shorter than the VAD's 500 ms: one utterance, past the 35 s
    # buffer and Whisper's 30 s window. The service cuts it at agreed words and carries the rest.
    rate = piper_backend.voice.sample_rate
    pause = np.zeros(int(0.25 * rate), np.float32)

    def trimmed(x: np.ndarray) -> np.ndarray:  # Piper's own edge silence would lengthen the pauses
        loud = np.nonzero(np.abs(x) > 0.02)[0]
        return x[loud[0]:loud[-1] + 1]

    order = list(range(len(spoken))) + list(range(6))  # > 36 s once the edge silence is gone
    audio = np.concatenate([np.concatenate([trimmed(spoken[i]), pause]) for i in order])
    assert len(audio) / rate > 36
    res = await stream(f"{live.ws}/v1/asr", audio, rate=rate, chunk_ms=250, pace=None, interim=False)
    assert res.close_code == 1000
    kinds = [m["type"] for _, m in res.messages]
    assert kinds.count("speech_started") == 1 and kinds.count("speech_stopped") == 1
    finals = res.of("final")
    assert len(finals) >= 2
    assert all(a["end_ms"] <= b["start_ms"] for a, b in zip(finals, finals[1:]))  # consecutive pieces
    assert all(f["end_ms"] - f["start_ms"] <= 30000 for f in finals)
    wer = jiwer.wer(norm(" ".join(SENTENCES[i] for i in order)), norm(" ".join(f["text"] for f in finals)))
    assert wer <= 0.15, (wer, [f["text"] for f in finals])


async def test_finalize_ends_the_utterance_now_and_json_frames(live, arctic) -> None:  # noqa: ANN001
    url = f"{live.ws}/v1/asr"
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "start", "sample_rate": 8000, "format": "mulaw", "interim": False}))
        ready = json.loads(await ws.recv())
        assert ready["type"] == "ready" and ready["model"] == "tiny.en" and ready["sample_rate"] == 8000
        x = resample(np.concatenate([np.zeros(4000, np.float32), arctic]), 16000, 8000)
        for i in range(0, len(x), 1600):  # no trailing silence: only finalize ends the speech
            chunk = base64.b64encode(pack_pcm(x[i:i + 1600], "mulaw")).decode()
            await ws.send(json.dumps({"type": "audio", "audio": chunk}))
        await ws.send(json.dumps({"type": "finalize"}))
        got = []
        while not any(m["type"] == "final" for m in got):
            got.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
        assert "speech_stopped" in [m["type"] for m in got]
        final = next(m for m in got if m["type"] == "final")
        assert jiwer.wer(norm(ARCTIC), norm(final["text"])) <= 0.25, final  # 8 kHz mu-law, still recognised
        await ws.send(json.dumps({"type": "stop"}))
        rest = [json.loads(f) async for f in ws]
        assert rest[-1]["type"] == "done" and rest[-1]["stats"]["finals"] == 1
        assert ws.close_code == 1000


async def drain(ws) -> list[dict]:  # noqa: ANN001
    out = []
    try:
        async for f in ws:
            out.append(msgpack.unpackb(f))
    except websockets.ConnectionClosed:  # closed with an error code: the error message came first
        pass
    return out


@pytest.mark.parametrize("msgs, code, close", [
    ([{"type": "audio", "audio": b"\x00\x00"}], "bad_state", 1008),
    ([{"type": "start", "format": "opus"}], "unsupported", 1003),
    ([{"type": "start", "sample_rate": 44100}], "unsupported", 1003),
    ([{"type": "start", "language": "fr"}], "unsupported", 1003),
    ([{"type": "start"}, {"type": "audio", "audio": b"\x00\x00\x00"}], "bad_audio", 1008),
    ([{"type": "start"}, {"type": "transcribe"}], "unknown_type", 1008),
    ([{"type": "start"}, {"type": "start"}], "bad_state", 1008),
    ([{"type": "start", "sample_rate": 16000, "format": "pcm_f32le"}, {"type": "audio", "audio": b"\x00" * 6}],
     "bad_audio", 1008),
])
async def test_bad_input_gets_error_and_close_code(live, msgs, code, close) -> None:  # noqa: ANN001
    async with websockets.connect(f"{live.ws}/v1/asr") as ws:
        for msg in msgs:
            await ws.send(msgpack.packb(msg))
        replies = await drain(ws)
        assert replies[-1]["type"] == "error" and replies[-1]["code"] == code, replies
        assert ws.close_code == close


async def test_garbage_frame(live) -> None:  # noqa: ANN001
    async with websockets.connect(f"{live.ws}/v1/asr") as ws:
        await ws.send(b"\xc1\xff")
        replies = await drain(ws)
        assert replies[-1]["code"] == "invalid_frame" and ws.close_code == 1007


def _wav(audio: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, audio, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


async def test_transcriptions_endpoint(live, arctic) -> None:  # noqa: ANN001
    url = f"{live.http}/v1/audio/transcriptions"
    wav = _wav(speech(arctic, 0.2, 0.3), 16000)
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(url, files={"file": ("a.wav", wav, "audio/wav")}, data={"model": "whisper-1"})
        assert r.status_code == 200, r.text
        assert norm(r.json()["text"]) == norm(ARCTIC)
        # stereo 48 kHz FLAC, text format
        x48 = resample(speech(arctic, 0.2, 0.3), 16000, 48000)
        buf = io.BytesIO()
        sf.write(buf, np.stack([x48, x48], 1), 48000, format="FLAC")
        r = await c.post(url, files={"file": ("a.flac", buf.getvalue())},
                         data={"response_format": "text", "language": "en"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        assert norm(r.text) == norm(ARCTIC)
        r = await c.post(url, files={"file": ("a.wav", wav)}, data={"response_format": "verbose_json"})
        body = r.json()
        assert body["duration"] == pytest.approx(len(arctic) / 16000 + 0.5, abs=0.01)
        assert len(body["segments"]) == 1 and body["segments"][0]["start"] < body["segments"][0]["end"]
        bad = await c.post(url, files={"file": ("a.wav", b"RIFF not really a wav")})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "unsupported"
        missing = await c.post(url, data={"model": "whisper-1"})
        assert missing.status_code == 400 and missing.json()["error"]["code"] in ("missing_field", "bad_request")
        # subtitles: the segment's times as verbose_json has them
        seg = body["segments"][0]
        r = await c.post(url, files={"file": ("a.wav", wav)}, data={"response_format": "srt"})
        cue = r.text.split("\n")
        assert r.status_code == 200 and cue[0] == "1" and norm(cue[2]) == norm(ARCTIC), r.text
        start, end = (sum(float(p) * k for p, k in zip(t.replace(",", ".").split(":"), (3600, 60, 1)))
                      for t in cue[1].split(" --> "))
        assert (start, end) == (pytest.approx(seg["start"], abs=1e-3), pytest.approx(seg["end"], abs=1e-3))
        r = await c.post(url, files={"file": ("a.wav", wav)}, data={"response_format": "vtt"})
        assert r.headers["content-type"].startswith("text/vtt") and r.text.startswith("WEBVTT\n\n")
        assert cue[1].replace(",", ".") in r.text and norm(r.text.split("\n")[3]) == norm(ARCTIC)
        # MP3, the commonest upload
        buf = io.BytesIO()
        sf.write(buf, speech(arctic, 0.2, 0.3), 16000, format="MP3")
        r = await c.post(url, files={"file": ("a.mp3", buf.getvalue(), "audio/mpeg")})
        assert r.status_code == 200 and norm(r.json()["text"]) == norm(ARCTIC), r.text
        r = await c.post(url, files={"file": ("a.wav", wav)},
                         data={"response_format": "verbose_json", "timestamp_granularities[]": "segment"})
        assert r.status_code == 200 and len(r.json()["segments"]) == 1
        fmt = await c.post(url, files={"file": ("a.wav", wav)}, data={"response_format": "xml"})
        assert fmt.status_code == 400 and fmt.json()["error"]["code"] == "unsupported"
        lang = await c.post(url, files={"file": ("a.wav", wav)}, data={"language": "fr"})
        assert lang.status_code == 400 and lang.json()["error"]["code"] == "unsupported"
        models = (await c.get(f"{live.http}/v1/models")).json()["data"]
        assert any(d["kind"] == "asr" and d["id"] == "tiny.en" and d["tasks"] == ["transcribe"] for d in models)


async def test_transcriptions_word_timestamps(live, arctic, monkeypatch) -> None:  # noqa: ANN001
    """verbose_json with timestamp_granularities[] word: the final's words with their times in the
    file (seconds), as OpenAI's ``words``; segments too only when they are asked for as well."""
    from realtime.engines.whisper_align import word_timestamps

    url = f"{live.http}/v1/audio/transcriptions"

    async def post(c: httpx.AsyncClient, audio: np.ndarray, grains: list[str],
                   fmt: str = "verbose_json") -> httpx.Response:
        return await c.post(url, files={"file": ("a.wav", _wav(audio, 16000))},
                            data={"response_format": fmt, "timestamp_granularities[]": grains})

    async with httpx.AsyncClient(timeout=60) as c:
        r = await post(c, speech(arctic, 0.2, 0.3), ["word"])
        assert r.status_code == 200, r.text
        body = r.json()
        assert "segments" not in body and norm(body["text"]) == norm(ARCTIC)
        words = body["words"]
        assert [set(w) for w in words] == [{"word", "start", "end"}] * len(words)
        assert "".join(w["word"] for w in words) == body["text"].replace(" ", "")
        times = [t for w in words for t in (w["start"], w["end"])]
        assert times == sorted(times) and all(w["start"] < w["end"] for w in words)
        assert 0 <= times[0] and times[-1] <= body["duration"]

        # Both granularities, the speech 1.2 s into the file: segments and words, the words in
        # their segment and equal to the served engine's alignment of the segment's audio, offset
        # by the segment's start: the file's time.
        audio = speech(arctic, 1.2, 0.3)
        r = await post(c, audio, ["segment", "word"])
        assert r.status_code == 200, r.text
        (seg,), words = r.json()["segments"], r.json()["words"]
        # (word times are rounded to 10 ms, segment times to 1 ms)
        assert 1.0 < seg["start"] <= words[0]["start"] + 0.005 and words[-1]["end"] <= seg["end"]
        w = live.state.services["asr"].whisper
        lo, hi = round(seg["start"] * 16000), round(seg["end"] * 16000)
        ids = w.tokenizer.encode(" " + seg["text"], add_special_tokens=False).ids
        expected = word_timestamps(w, audio[lo:hi], ids, offset_s=seg["start"])
        assert words == [{"word": x.word.strip(), "start": x.start, "end": x.end} for x in expected]

        for fmt in ("json", "srt"):
            bad = await post(c, speech(arctic, 0.2, 0.3), ["word"], fmt)
            assert bad.status_code == 400 and "verbose_json" in bad.json()["error"]["message"], bad.text
        bad = await post(c, speech(arctic, 0.2, 0.3), ["phoneme"])
        assert bad.status_code == 400 and "phoneme" in bad.json()["error"]["message"], bad.text

        # An alignment that breaks fails its own request (500, nothing internal said), not the
        # decode batch it ran in: a request sent with it, decoded beside it, is answered.
        import realtime.engines.whisper_align as align

        def broken(*_a, **_k):  # noqa: ANN002, ANN003, ANN202
            raise RuntimeError("secret internal detail")

        with monkeypatch.context() as m:
            m.setattr(align, "word_timestamps", broken)
            r, other = await asyncio.gather(post(c, speech(arctic, 0.2, 0.3), ["word"]),
                                            post(c, speech(arctic, 0.2, 0.3), ["segment"]))
        assert r.status_code == 500 and "secret" not in r.text, r.text
        assert other.status_code == 200 and norm(other.json()["text"]) == norm(ARCTIC), other.text
        r = await post(c, speech(arctic, 0.2, 0.3), ["word"])
        assert r.status_code == 200 and r.json()["words"], r.text


async def test_words_over_the_socket(live, arctic) -> None:  # noqa: ANN001
    """``words`` in the start: each final carries its words with their times in the stream (ms),
    inside the final's span, the words joined being its text."""
    res = await stream(f"{live.ws}/v1/asr", speech(arctic, lead_s=0.8), pace=None, interim=False, words=True)
    (final,) = res.of("final")
    words = final["words"]
    assert [set(w) for w in words] == [{"word", "start_ms", "end_ms"}] * len(words) and len(words) > 5
    assert "".join(w["word"] for w in words) == final["text"].replace(" ", "")
    times = [t for w in words for t in (w["start_ms"], w["end_ms"])]
    assert times == sorted(times) and all(w["start_ms"] < w["end_ms"] for w in words)
    # (the speech starts 800 ms in; the alignment's times are whole 10 ms steps)
    assert 700 <= final["start_ms"] <= times[0] + 10 and times[-1] <= final["end_ms"] + 10, (final, times)
    assert all(t % 10 == 0 for t in times)


def test_streamed_transcript_with_the_openai_sdk(live, arctic) -> None:  # noqa: ANN001
    """``stream=true``: a transcript.text.delta event as each utterance ends, then
    transcript.text.done with the whole text, which is the unstreamed reply's; read by the official
    SDK. Streaming takes no timestamps."""
    from openai import BadRequestError, OpenAI

    two = np.concatenate([speech(arctic, 0.2, 1.5), speech(arctic, 0.0, 0.3)])  # two utterances
    client = OpenAI(base_url=f"{live.http}/v1", api_key="unused-on-loopback")
    wav = _wav(two, 16000)
    events = list(client.audio.transcriptions.create(model="whisper-1", file=("a.wav", wav), stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["transcript.text.delta"] * 2 + ["transcript.text.done"], kinds
    done = events[-1].text
    assert "".join(e.delta for e in events[:-1]) == done
    assert done == client.audio.transcriptions.create(model="whisper-1", file=("a.wav", wav)).text
    assert norm(done) == norm(ARCTIC + " " + ARCTIC)
    with pytest.raises(BadRequestError, match="streamed"):
        client.audio.transcriptions.create(model="whisper-1", file=("a.wav", wav), stream=True,
                                           response_format="verbose_json")


async def test_file_finals_put_as_the_job_ends_are_not_lost() -> None:
    """The race a file request had: its consumer took the first final, the worker then put the
    last final and END and finished the job, and the consumer, seeing the job ended, stopped
    without the last final. Here the job finishes exactly between the take and that check."""
    from types import SimpleNamespace

    from realtime.asr_service import END as ASR_END
    from realtime.scheduler import OutputChannel

    out = OutputChannel()
    wake = asyncio.Event()
    out.bind(asyncio.get_running_loop(), wake)

    class Job:  # the worker's side at the moment it matters: one final out, then the rest and END
        def __init__(self) -> None:
            self.output, self.checks = out, 0

        @property
        def active(self) -> bool:  # (the first look after the first take: the job ends just now)
            self.checks += 1
            if self.checks == 1:
                out.put({"type": "final", "text": "two"})
                out.put(ASR_END)
            return False

    st = SimpleNamespace(scheduler=SimpleNamespace(wake=lambda: None, cancel=lambda job: None))
    out.put({"type": "final", "text": "one"})
    got = [f["text"] async for f in ASRService._finals(st, Job())]
    assert got == ["one", "two"]


async def test_prompt_goes_before_the_decodes(live, arctic) -> None:  # noqa: ANN001
    """A prompt (the form's field, the start's over the socket) conditions the decodes: in a style
    of its own (lower case, no punctuation), the transcript takes that style, the same both ways."""
    prompt = "hello my name is bob and i like writing without capitals or punctuation"
    wav = _wav(speech(arctic, 0.2, 0.3), 16000)
    url = f"{live.http}/v1/audio/transcriptions"
    async with httpx.AsyncClient(timeout=60) as c:
        plain = (await c.post(url, files={"file": ("a.wav", wav)})).json()["text"]
        r = await c.post(url, files={"file": ("a.wav", wav)}, data={"prompt": prompt})
        assert r.status_code == 200, r.text
        long = await c.post(url, files={"file": ("a.wav", wav)}, data={"prompt": "x" * 2001})
        assert long.status_code == 400 and "prompt" in long.json()["error"]["message"], long.text
    text = r.json()["text"]
    assert norm(plain) == norm(ARCTIC) and text != plain and text == text.lower() and "." not in text
    res = await stream(f"{live.ws}/v1/asr", speech(arctic, 0.2, 0.3), pace=None, interim=False, prompt=prompt)
    assert [m["text"] for m in res.of("final")] == [text]


def test_transcribe_cli_against_live_server(live) -> None:  # noqa: ANN001
    r = subprocess.run([sys.executable, "-m", "realtime.cli", "transcribe", str(ASSET), "--url", f"{live.ws}/v1/asr"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert norm(r.stdout) == norm(ARCTIC)
    local = subprocess.run([sys.executable, "-m", "realtime.cli", "transcribe", str(ASSET), "--local"],
                           capture_output=True, text=True, timeout=120)
    assert local.returncode == 0, local.stderr[-2000:]
    assert norm(local.stdout) == norm(ARCTIC)
    srt = subprocess.run([sys.executable, "-m", "realtime.cli", "transcribe", str(ASSET), "--url", f"{live.ws}/v1/asr",
                          "--format", "srt"], capture_output=True, text=True, timeout=120)
    cue = srt.stdout.split("\n")
    assert srt.returncode == 0 and cue[0] == "1" and " --> " in cue[1] and norm(cue[2]) == norm(ARCTIC), srt.stdout
    # a line a word, start and end in seconds: from the server's finals, and --local over the file
    lines = {}
    for where in (["--url", f"{live.ws}/v1/asr"], ["--local"]):
        r = subprocess.run([sys.executable, "-m", "realtime.cli", "transcribe", str(ASSET), *where, "--format", "words"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        lines[where[0]] = [(float(a), float(b), w) for a, b, w in (ln.split("\t") for ln in r.stdout.splitlines())]
    served, local = lines["--url"], lines["--local"]
    assert norm(" ".join(w for *_, w in served)) == norm(ARCTIC) and [w for *_, w in local] == [w for *_, w in served]
    assert all(a < b for a, b, _ in served) and [a for a, *_ in served] == sorted(a for a, *_ in served)
    # (the server aligns the VAD's segment, --local the whole file: each pads its window alike but
    # not the same audio, and the times move by a frame or three)
    assert max(abs(x[i] - y[i]) for x, y in zip(served, local) for i in (0, 1)) <= 0.1, (served, local)
    bad = subprocess.run([sys.executable, "-m", "realtime.cli", "transcribe", str(ASSET), "--url",
                          "ws://127.0.0.1:9/v1/asr"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
