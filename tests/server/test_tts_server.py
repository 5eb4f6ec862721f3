"""A real uvicorn server on loopback with the embedded Piper voice and real websockets clients."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess

import httpx
import msgpack
import numpy as np
import pytest
import websockets

from realtime.clients.tts import TTSStream, synthesize_async
from realtime.codecs.resample import unpack_pcm
from realtime.config import ServerConfig
from realtime.errors import ConfigError
from realtime.protocol.frames import WireFormat
from realtime.server import create_app

from liveserver import serve

SENTENCES = ["Hello there, ", "how are you today? ", "I hope the weather ", "is kind to you. ", "Goodbye."]


@pytest.fixture(scope="module")
def live(piper_backend):  # noqa: ANN001, ANN201
    app = create_app(ServerConfig(max_frame_bytes=64 * 1024), tts=piper_backend)
    with serve(app) as srv:
        yield srv


async def test_text_in_pieces_while_audio_streams(live) -> None:  # noqa: ANN001
    async with TTSStream(f"{live.ws}/v1/tts", format="pcm_s16le", sample_rate=24000) as s:
        assert s.ready is not None and s.ready["sample_rate"] == 24000 and s.ready["frame_samples"] == 960
        await s.send_text(SENTENCES[0])
        await s.send_text(SENTENCES[1])
        chunks = []
        it = s.__aiter__()
        chunks.append(await it.__anext__())  # audio is flowing before the rest of the text is sent
        for piece in SENTENCES[2:]:
            await s.send_text(piece)
            await asyncio.sleep(0.05)
        await s.stop()
        chunks += [c async for c in it]
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    audio = np.concatenate([c.samples("pcm_s16le") for c in chunks])
    duration = len(audio) / 24000
    assert 3.0 < duration < 12.0, duration
    assert np.sqrt(np.mean(audio ** 2)) > 0.02  # speech, not silence
    assert all(c.duration_ms == pytest.approx(40.0) for c in chunks[:-1])
    assert abs(chunks[-1].start_ms + chunks[-1].duration_ms - duration * 1000) < 1.0
    st = s.stats
    assert st is not None
    assert st["audio_ms"] == pytest.approx(duration * 1000, abs=1.0)
    for key in ("ttfa_ms", "audio_ms", "frames", "rtf", "underruns", "underrun_ms", "max_underrun_ms"):
        assert key in st
    assert st["ttfa_ms"] > 0 and st["frames"] > 0 and st["rtf"] > 0


async def test_json_frames_mulaw_8k(live) -> None:  # noqa: ANN001
    async with TTSStream(f"{live.ws}/v1/tts", format="mulaw", sample_rate=8000, chunk_ms=20,
                         wire=WireFormat.JSON) as s:
        await s.send_text("Testing the telephone line.")
        await s.flush()
        await s.stop()
        chunks = [c async for c in s]
    assert all(len(c.audio) == 160 for c in chunks[:-1])  # 20 ms of 8 kHz μ-law = 160 bytes
    audio = np.concatenate([unpack_pcm(c.audio, "mulaw") for c in chunks])
    assert np.sqrt(np.mean(audio ** 2)) > 0.02


async def test_stream_matches_offline_synthesis(live, piper_backend) -> None:  # noqa: ANN001
    """What the server streams (with a seed) is the engine's whole-utterance output."""
    text = "The quick brown fox jumps over the lazy dog."
    audio, _ = await synthesize_async(f"{live.ws}/v1/tts", text, sample_rate=22050, extra={"seed": 7})
    import torch

    voice = piper_backend.voice
    gen = torch.Generator().manual_seed(7)
    parts = []
    for ph in voice.phonemize(text):
        z = voice.generate(torch.tensor([voice.phoneme_ids(ph)]), generator=gen)
        parts.append(voice.vocode(z).reshape(-1).numpy())
    ref = np.concatenate(parts)
    assert len(audio) == len(ref)
    assert np.abs(audio - ref).max() < 1e-3  # f32 on the wire; chunked vocoder == whole


def test_long_sentence_flow_hands_over_its_head_first(piper_backend) -> None:  # noqa: ANN001
    """With nothing queued for the stream, a long sentence's first frames are published before the
    rest of its flow runs, enough for the first two windows (8 and 16 frames) and no more; the
    parts equal the whole flow. A short sentence, or one with audio queued before it, is one part."""
    import torch

    from realtime.protocol.tts import StartParams
    from realtime.tts_piper import FIRST_WINDOW, HEAD_FRAMES

    b = piper_backend
    ctx = b.vocoder.vocoder_context
    params = StartParams(voice=None, format="pcm_f32le", sample_rate=b.native_rate, chunk_ms=None)
    text = "The quick brown fox jumps over the lazy dog. Hello."
    seen: list[tuple[int, int, bool]] = []

    def publish(utt, grown=False) -> None:  # noqa: ANN001
        seen.append((utt.made, utt.frames, grown))
        if not grown and utt.made < utt.frames:  # what the codec worker may decode at this moment
            v = b.vocoder
            assert utt.vocodable(0, v) >= FIRST_WINDOW and utt.vocodable(FIRST_WINDOW, v) >= HEAD_FRAMES
            for start in range(0, utt.made):  # the furthest window whose slice lies in the made frames
                end = utt.vocodable(start, v)
                assert end == start or sum(v.window_slice(utt.frames, start, end)) <= utt.made
                assert sum(v.window_slice(utt.frames, start, end + 1)) > utt.made

    utts = b.synthesize_latents(text, params, torch.Generator().manual_seed(3), publish=publish, head=True)
    first = HEAD_FRAMES + 2 * ctx
    (long_f, short_f) = (u.frames for u in utts)
    assert long_f > first + b.voice.flow_context >= short_f
    assert seen == [(first, long_f, False), (long_f, long_f, True), (short_f, short_f, False)]
    whole = b.synthesize_latents(text, params, torch.Generator().manual_seed(3), head=True)  # no publish: one part
    for u, w in zip(utts, whole, strict=True):
        assert (u.z - w.z).abs().max().item() <= 1e-4
    seen.clear()
    b.synthesize_latents(text, params, torch.Generator().manual_seed(3), publish=publish, head=False)
    assert seen == [(long_f, long_f, False), (short_f, short_f, False)]


async def _raw(live, frames: list[bytes | str]) -> tuple[list[dict], int | None]:  # noqa: ANN001
    async with websockets.connect(f"{live.ws}/v1/tts", max_size=None) as ws:
        for f in frames:
            await ws.send(f)
        got = []
        try:
            while True:
                data = await asyncio.wait_for(ws.recv(), 10)
                got.append(msgpack.unpackb(data) if isinstance(data, bytes) else json.loads(data))
        except websockets.ConnectionClosed:
            pass
        return got, ws.close_code


@pytest.mark.parametrize("frames, code, close", [
    ([msgpack.packb({"type": "hello"})], "unknown_type", 1008),
    ([msgpack.packb({"type": "text", "text": "hi"})], "bad_state", 1008),
    ([b"\xc1\xc1"], "invalid_frame", 1007),
    (["{oops"], "invalid_frame", 1007),
    ([msgpack.packb({"type": "start", "sample_rate": 44100})], "unsupported", 1003),
    ([msgpack.packb({"type": "start", "format": "opus"})], "unsupported", 1003),
    ([msgpack.packb({"type": "start", "voice": "nobody"})], "unsupported", 1003),
    ([msgpack.packb({"type": "start"}), msgpack.packb({"type": "text"})], "missing_field", 1008),
    ([msgpack.packb({"type": "start"}), msgpack.packb({"type": "text", "text": "x" * 70_000})], "too_large", 1009),
])
async def test_bad_input_gets_error_and_close_code(live, frames, code, close) -> None:  # noqa: ANN001
    got, close_code = await _raw(live, frames)
    errors = [g for g in got if g.get("type") == "error"]
    assert len(errors) == 1 and errors[0]["code"] == code, got
    assert "Traceback" not in errors[0]["message"] and "File " not in errors[0]["message"]
    assert close_code == close
    assert await live.wait_idle() < 3.0


async def test_disconnect_mid_stream_frees_the_slot(live) -> None:  # noqa: ANN001
    ws = await websockets.connect(f"{live.ws}/v1/tts", max_size=None)
    await ws.send(msgpack.packb({"type": "start"}))
    await ws.recv()  # ready
    await ws.send(msgpack.packb({"type": "text", "text": "This is a long story. " * 40}))
    await ws.recv()  # first audio: the job is busy
    assert live.state.scheduler.active == 1
    ws.transport.abort()  # no close handshake: the client just vanishes
    waited = await live.wait_idle()
    assert live.state.scheduler.active == 0
    # "within one step": a Piper step is well under a second on this CPU
    assert waited < 2.0, waited


async def test_cancel_stops_at_once(live) -> None:  # noqa: ANN001
    async with TTSStream(f"{live.ws}/v1/tts") as s:
        await s.send_text("This is a long story that goes on and on. " * 20)
        it = s.__aiter__()
        await it.__anext__()
        await s.cancel()
        rest = [c async for c in it]
    assert s.stats is not None and s.stats["cancelled"] is True
    assert len(rest) < 50  # at most what was already in flight
    assert await live.wait_idle() < 2.0


async def test_health_metrics_models_and_speech(live) -> None:  # noqa: ANN001
    async with httpx.AsyncClient(base_url=live.http, timeout=60) as client:
        h = (await client.get("/health")).json()
        assert h["status"] == "ok"
        m = (await client.get("/metrics")).text
        assert "realtime_tts_ttfa_seconds_bucket" in m and "realtime_active_streams" in m
        assert "realtime_tts_underruns_total" in m and 'realtime_lane_ready{lane="piper.vocode"}' in m
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["kind"] == "tts"
        body = {"model": "tts-1", "input": "Hello from the speech endpoint.", "voice": "alloy",
                "response_format": "wav"}
        got = b""
        async with client.stream("POST", "/v1/audio/speech", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
            async for part in r.aiter_bytes():
                got += part
        assert got[:4] == b"RIFF" and len(got) > 44 + 22050  # > 0.5 s of 16-bit audio
        pcm = np.frombuffer(got[44:], dtype="<i2")
        assert np.abs(pcm).max() > 1000
        r = await client.post("/v1/audio/speech", json={"input": "x", "response_format": "wma"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported"
        # OpenAI's error shape, as its SDKs read it
        assert r.json()["error"]["type"] == "invalid_request_error" and "wma" in r.json()["error"]["message"]
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        # stream_format: OpenAI's "sse" gives the same audio as base64 events, then the usage
        body = {"input": "Hello there. How are you?", "response_format": "pcm", "seed": 5}
        plain = (await client.post("/v1/audio/speech", json={**body, "stream_format": "audio", "instructions": ""})).content
        r = await client.post("/v1/audio/speech", json={**body, "stream_format": "sse"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-audio-media-type"] == "audio/pcm"
        events = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: ")]
        assert [e["type"] for e in events[-1:]] == ["speech.audio.done"] and len(events) >= 3
        assert {e["type"] for e in events[:-1]} == {"speech.audio.delta"}
        assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == plain and len(plain) > 24000
        u = events[-1]["usage"]
        # Piper reads ~1 phoneme id a character (with pads between them), and makes ~86 latent frames a second
        assert 20 <= u["input_tokens"] <= 120 and u["output_tokens"] >= 0.5 * len(plain) / 2 / 24000 * 80
        assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
        r = await client.post("/v1/audio/speech", json={"input": "x", "stream_format": "chunks"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported"
        r = await client.post("/v1/audio/speech", json={"input": "x", "instructions": "Speak like a pirate."})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported"
        # an endpoint this server was started without, an unknown one, a wrong method: the same shape
        r = await client.post("/v1/images/generations", json={"prompt": "3"})
        assert r.status_code == 404 and "--image-model" in r.json()["error"]["message"]
        r = await client.get("/v1/nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = await client.get("/v1/audio/speech")
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
        r = await client.post("/v1/audio/speech", content=b"not json")
        assert r.status_code == 400
        r = await client.post("/v1/audio/speech", json={"input": ""})
        assert r.status_code == 400


async def test_speech_in_mp3_opus_and_flac(live) -> None:  # noqa: ANN001
    """/v1/audio/speech's compressed formats, decoded again (one seed: the same voice run each time):
    flac is the wav's samples exactly; mp3, opus and aac are the 24 kHz pcm's audio (after the mp3
    and aac encoders' delay), and mp3 arrives in parts before the reply ends."""
    import io

    import soundfile as sf

    text = "Compressed speech for the browser."

    async def fetch(client: httpx.AsyncClient, fmt: str) -> tuple[bytes, str, int]:
        body = {"model": "tts-1", "input": text, "voice": "alloy", "response_format": fmt, "seed": 7}
        got, parts = b"", 0
        async with client.stream("POST", "/v1/audio/speech", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for part in r.aiter_bytes():
                got, parts = got + part, parts + 1
        return got, r.headers["content-type"], parts

    async with httpx.AsyncClient(base_url=live.http, timeout=60) as client:
        wav = (await fetch(client, "wav"))[0]
        pcm = np.frombuffer((await fetch(client, "pcm"))[0], dtype="<i2").astype(np.float64)
        native = np.frombuffer(wav[44:], dtype="<i2")
        flac, media, _ = await fetch(client, "flac")
        assert media == "audio/flac" and flac[:4] == b"fLaC"
        samples, rate = sf.read(io.BytesIO(flac), dtype="int16")
        assert rate == live.state.tts.native_rate and np.array_equal(samples, native)  # lossless, the same voice run
        for fmt, media_type, magic in (("mp3", "audio/mpeg", None), ("opus", "audio/ogg", b"OggS"),
                                       ("aac", "audio/aac", b"\xff\xf1")):
            data, media, parts = await fetch(client, fmt)
            assert media == media_type and (magic is None or data[:len(magic)] == magic)
            assert len(data) < len(pcm) * 2 / 4  # compressed (pcm: 2 bytes a sample)
            if fmt == "mp3":
                assert parts > 1  # streamed as encoded, not whole at the end
            if fmt == "aac":  # (ADTS; libsndfile reads no AAC: the bundled ffmpeg decodes it)
                import imageio_ffmpeg

                dec = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-loglevel", "error", "-f", "aac", "-i", "pipe:0",
                                      "-f", "s16le", "-ac", "1", "pipe:1"], input=data, capture_output=True, check=True)
                y = np.frombuffer(dec.stdout, "<i2").astype(np.float64)
            else:
                with sf.SoundFile(io.BytesIO(data)) as f:
                    assert f.samplerate == 24000
                    y = f.read(dtype="float64") * 32768
            lag = max(range(0, 3000, 3), key=lambda s: float(np.dot(y[s:s + 12000], pcm[:12000])))
            n = min(len(y) - lag, len(pcm))
            assert n > len(pcm) - 3000
            corr = float(np.corrcoef(y[lag:lag + n], pcm[:n])[0, 1])
            assert corr > 0.9, (fmt, corr)


async def test_concurrent_streams_have_no_long_gaps(live) -> None:  # noqa: ANN001
    async def one(i: int) -> dict:
        _, stats = await synthesize_async(f"{live.ws}/v1/tts", f"Stream number {i} is speaking now.")
        return stats

    stats = await asyncio.gather(*(one(i) for i in range(4)))
    for st in stats:
        assert st["audio_ms"] > 1000 and st["client_gaps"]["chunks"] == st["chunks"]


def test_auth_required_off_loopback() -> None:
    with pytest.raises(ConfigError, match="api-key"):
        create_app(ServerConfig(host="0.0.0.0"))
    create_app(ServerConfig(host="0.0.0.0", api_key="k"))  # fine with a key


async def test_api_key(piper_backend) -> None:  # noqa: ANN001
    app = create_app(ServerConfig(api_key="sekrit", warmup=False), tts=piper_backend)
    with serve(app) as srv:
        with pytest.raises(websockets.InvalidStatus):
            async with websockets.connect(f"{srv.ws}/v1/tts"):
                pass
        async with TTSStream(f"{srv.ws}/v1/tts", api_key="sekrit") as s:
            assert s.ready is not None
        async with TTSStream(f"{srv.ws}/v1/tts?token=sekrit") as s:
            assert s.ready is not None
        with pytest.raises(websockets.InvalidStatus):
            async with websockets.connect(f"{srv.ws}/v1/tts?token=wrong"):
                pass
        async with httpx.AsyncClient(base_url=srv.http) as client:
            r = await client.get("/metrics")
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            r = await client.get("/metrics", headers={"Authorization": "Bearer sekrit"})
            assert r.status_code == 200
            assert (await client.get("/health")).status_code == 200  # probes stay open


async def test_startup_objects_are_frozen_out_of_the_collector(live) -> None:  # noqa: ANN001
    """What the server loads before it accepts (models, the scheduler, the app state) sits in the
    collector's permanent generation: a full collection no longer walks ~10^5 startup objects while
    holding the GIL (~80 ms measured on the CPU, a stall of every stream at once)."""
    import gc

    state = live.state
    tracked = {id(o) for o in gc.get_objects()}  # the permanent generation is not listed
    for obj in (state, state.tts, state.scheduler):
        assert gc.is_tracked(obj) and id(obj) not in tracked, type(obj).__name__
    assert gc.get_freeze_count() > 0
    # the collections that remain are timed for /metrics
    before = state.metrics.gc_pause.counts[:]
    gc.collect()
    assert sum(state.metrics.gc_pause.counts) > sum(before) and state.metrics.gc.max_s > 0
    async with httpx.AsyncClient(base_url=live.http, timeout=30) as client:
        text = (await client.get("/metrics")).text
    count = [ln for ln in text.splitlines() if ln.startswith("realtime_gc_pause_seconds_count")]
    assert count and float(count[0].split()[1]) >= 1
