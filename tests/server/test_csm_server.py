"""CSM (tiny random weights, saved with transformers' save_pretrained) served over /v1/tts by a real
uvicorn: frame-sized chunks, gap stats, streamed audio == offline generate + Mimi decode, and
concurrent streams batched in one step each equal their solo output."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import numpy as np
import pytest
import soundfile as sf
import torch
from liveserver import serve
from tiny_csm import tiny_csm

from realtime.clients.tts import ServerError, TTSStream, synthesize_async
from realtime.config import ServerConfig
from realtime.server import create_app

transformers = pytest.importorskip("transformers")

@pytest.fixture(scope="module")
def csm_live(tmp_path_factory):  # noqa: ANN001, ANN201
    from realtime.tts_csm import CSMBackend

    folder = tmp_path_factory.mktemp("csm")
    tiny_csm(folder)
    backend = CSMBackend(str(folder), n_slots=4, max_seq_len=512)
    app = create_app(ServerConfig(), tts=backend, services=[])
    with serve(app) as live:
        yield live, backend


def _offline(backend, text: str) -> np.ndarray:  # noqa: ANN001
    csm, mimi = backend.csm, backend.mimi
    prompt = csm.build_prompt(text, 0)
    n = max(25, int(len(text) * 2.0))
    codes = csm.generate_codes(prompt, max_frames=n, greedy=True)
    with torch.no_grad():
        audio = mimi.decode(codes.t()[None]).reshape(-1).numpy()
    return np.clip(audio, -1.0, 1.0)  # the wire format is full-scale PCM: random weights overshoot


async def test_csm_streams_frames_equal_to_offline(csm_live) -> None:  # noqa: ANN001
    live, backend = csm_live
    text = "hello world."
    async with TTSStream(f"{live.ws}/v1/tts", format="pcm_f32le", sample_rate=24000,
                         extra={"temperature": 0, "seed": 1}) as s:
        assert s.ready is not None and s.ready["frame_samples"] == 1920  # 80 ms at 24 kHz
        await s.send_text(text)
        await s.stop()
        chunks = [c async for c in s]
    audio = np.concatenate([c.samples("pcm_f32le") for c in chunks])
    ref = _offline(backend, text)
    assert len(audio) == len(ref)
    assert np.abs(audio - ref).max() < 1e-4
    st = s.stats
    assert st is not None and st["frames"] == len(ref) // backend.mimi.frame_size
    for key in ("ttfa_ms", "underruns", "underrun_ms", "max_underrun_ms", "rtf"):
        assert key in st
    assert s.gaps.chunks == len(chunks)


async def test_concurrent_csm_streams_batch_and_match_solo(csm_live) -> None:  # noqa: ANN001
    live, backend = csm_live
    texts = ["one two three.", "a different sentence here.", "short."]
    lane = next(ln for ln in live.state.scheduler.lanes() if ln.name == "csm.frame")
    steps_before = lane.steps
    results = await asyncio.gather(*(synthesize_async(f"{live.ws}/v1/tts", t, extra={"temperature": 0})
                                     for t in texts))
    frames = sum(st["frames"] for _, st in results)
    assert lane.steps - steps_before < frames  # frames of different streams shared steps
    for text, (audio, _) in zip(texts, results, strict=True):
        ref = _offline(backend, text)
        assert len(audio) == len(ref)
        assert np.abs(audio - ref).max() < 1e-4


async def test_voice_reference_is_accepted_and_bad_one_refused(csm_live) -> None:  # noqa: ANN001
    live, _ = csm_live
    buf = io.BytesIO()
    t = np.arange(7200) / 24000  # 0.3 s: this tiny Mimi makes 750 frames a second
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 24000, format="WAV")
    ref = {"audio": buf.getvalue(), "text": "a reference voice"}
    audio, st = await synthesize_async(f"{live.ws}/v1/tts", "speak like that.", reference=ref)
    assert len(audio) > 0 and st["frames"] > 0
    with pytest.raises(ServerError) as exc:
        await synthesize_async(f"{live.ws}/v1/tts", "x.", reference={"audio": b"not a wav", "text": "t"})
    assert exc.value.code == "unsupported" and exc.value.close_code == 1003
    buf = io.BytesIO()
    sf.write(buf, np.zeros(24000 * 2, dtype=np.float32), 24000, format="WAV")  # 1500 frames: too long here
    with pytest.raises(ServerError) as exc:
        await synthesize_async(f"{live.ws}/v1/tts", "x.", reference={"audio": buf.getvalue(), "text": "t"})
    assert exc.value.code == "unsupported" and "context" in exc.value.message


async def test_a_stream_whose_prompt_does_not_fit_fails_alone(csm_live) -> None:  # noqa: ANN001
    """New streams are prefilled together; one whose voice reference overflows the context is
    refused without costing the streams that start beside it their audio."""
    live, backend = csm_live
    buf = io.BytesIO()
    sf.write(buf, np.zeros(24000 * 2, dtype=np.float32), 24000, format="WAV")  # too long for 512 positions
    bad = {"audio": buf.getvalue(), "text": "t"}
    texts = ["first good one.", "second good one."]
    results = await asyncio.gather(
        synthesize_async(f"{live.ws}/v1/tts", texts[0], extra={"temperature": 0}),
        synthesize_async(f"{live.ws}/v1/tts", "x.", reference=bad),
        synthesize_async(f"{live.ws}/v1/tts", texts[1], extra={"temperature": 0}),
        return_exceptions=True)
    assert isinstance(results[1], ServerError) and results[1].code == "unsupported"
    for text, got in zip(texts, (results[0], results[2]), strict=True):
        assert not isinstance(got, BaseException), got
        ref = _offline(backend, text)
        assert len(got[0]) == len(ref) and np.abs(got[0] - ref).max() < 1e-4


def test_cli_say_local_with_csm_saves_codes(csm_live, tmp_path) -> None:  # noqa: ANN001
    import subprocess
    import sys

    live, backend = csm_live
    folder = tmp_path / "model"
    folder.mkdir()
    tiny_csm(folder)
    out, codes = tmp_path / "out.wav", tmp_path / "codes.npy"
    r = subprocess.run([sys.executable, "-m", "realtime.cli", "say", "hello there.", "--local", "--model", str(folder),
                        "-o", str(out), "--save-codes", str(codes)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    saved = np.load(codes)
    audio, rate = sf.read(out)
    assert rate == 24000 and saved.ndim == 2 and saved.shape[1] == 4
    assert len(audio) == saved.shape[0] * backend.mimi.frame_size


async def test_openai_speech_endpoint_with_csm(csm_live) -> None:  # noqa: ANN001
    import httpx

    live, backend = csm_live
    body = {"model": "csm", "input": "hello world.", "voice": "alloy", "response_format": "pcm"}
    async with httpx.AsyncClient(base_url=live.http, timeout=120) as client:
        got = b""
        async with client.stream("POST", "/v1/audio/speech", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"] == "audio/pcm"
            async for part in r.aiter_bytes():
                got += part
        frames = max(25, int(len("hello world.") * 2.0))  # the utterance cap (random weights rarely stop)
        assert 0 < len(got) // 2 <= frames * backend.mimi.frame_size  # 24 kHz s16le, at most the cap
        r = await client.post("/v1/audio/speech", json={**body, "speed": 1.5})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported"
        # as server-sent events: the usage counts the prompt's positions and the frames made
        r = await client.post("/v1/audio/speech", json={**body, "stream_format": "sse"})
        events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: ")]
        assert events[-1]["type"] == "speech.audio.done", events[-1]
        n = sum(len(base64.b64decode(e["audio"])) for e in events[:-1]) // 2
        u = events[-1]["usage"]
        prompt = len(backend.csm.build_prompt("hello world.", 0, []))
        assert u["input_tokens"] == prompt and u["output_tokens"] * backend.mimi.frame_size == n, (u, n, prompt)
