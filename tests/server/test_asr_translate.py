"""Translation (Whisper's translate task) through the served pipeline: ``/v1/audio/translations``
and ``/v1/asr``'s ``task: translate``, on a multilingual Whisper (random weights in Hugging Face's
format, with tiny.en's tokenizer to turn its tokens into text) behind a real uvicorn server. The
embedded tiny.en is English-only and refuses to translate."""

from __future__ import annotations

import asyncio
import io
import shutil
import subprocess
import sys

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch
from liveserver import serve
from test_asr_server import stream
from whisper_random import save_random_whisper

from realtime.asr_service import ASRService
from realtime.config import ServerConfig
from realtime.engines.whisper import default_model_dir
from realtime.server import create_app

ASSET = "tests/assets/arctic_a0009.wav"


@pytest.fixture(scope="module")
def multi(tmp_path_factory, piper_backend):  # noqa: ANN001, ANN201
    d = tmp_path_factory.mktemp("whisper_multi")
    save_random_whisper(d, multilingual=True)
    shutil.copy(default_model_dir() / "tokenizer.json", d / "tokenizer.json")
    cfg = ServerConfig(asr_model=str(d))
    with serve(create_app(cfg, tts=piper_backend, services=[ASRService(cfg)])) as srv:
        yield srv


def _speech() -> np.ndarray:
    audio, _ = sf.read(ASSET, dtype="float32")
    return np.concatenate([np.zeros(4800, np.float32), audio, np.zeros(16000, np.float32)])


def _wav(audio: np.ndarray) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, audio, 16000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@torch.inference_mode()
def _decode(w, audio: np.ndarray, task: str) -> str:  # noqa: ANN001
    """The served decode of one final's audio, run directly: its log-mel, greedy with the task,
    the decode lane's token bound for its length."""
    x = torch.from_numpy(audio)[None]
    ids = w.decode_greedy(w.encode(w.log_mel(x)), language=None, task=task,
                          max_tokens=int(min(224, 16 + 8 * len(audio) / 16000)))[0]
    return " ".join(w.decode_text(ids).split())


async def test_translations_endpoint_decodes_with_the_translate_task(multi) -> None:  # noqa: ANN001
    """The endpoint's text is the translate task's decode of the segment's audio, and differs from
    the transcribe task's (the task reached the decoder); verbose_json says task translate."""
    audio = _speech()
    async with httpx.AsyncClient(base_url=multi.http, timeout=120) as c:
        files = {"file": ("a.wav", _wav(audio))}
        r = await c.post("/v1/audio/translations", files=files, data={"response_format": "verbose_json"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["task"] == "translate" and body["language"] == "en" and len(body["segments"]) == 1
        t = await c.post("/v1/audio/transcriptions", files=files, data={"response_format": "verbose_json"})
        assert t.status_code == 200 and t.json()["task"] == "transcribe", t.text
        bad = await c.post("/v1/audio/translations", files=files,
                           data={"response_format": "verbose_json", "timestamp_granularities[]": "word"})
        assert bad.status_code == 400 and "word" in bad.json()["error"]["message"], bad.text
    seg = body["segments"][0]
    x = (np.round(audio * 32767) / 32767).astype(np.float32)  # (the WAV's 16-bit samples)
    x = x[round(seg["start"] * 16000):round(seg["end"] * 16000)]
    w = multi.state.services["asr"].whisper
    assert body["text"] == _decode(w, x, "translate"), (body["text"], _decode(w, x, "translate"))
    assert t.json()["text"] == _decode(w, x, "transcribe") != body["text"]


async def test_socket_task_translate(multi, tmp_path) -> None:  # noqa: ANN001
    """``task: translate`` in /v1/asr's start (and ``realtime transcribe --translate``, which sends
    it): the final is the translation the HTTP endpoint gives. /v1/models lists both tasks."""
    res = await stream(f"{multi.ws}/v1/asr", _speech(), pace=None, interim=False, task="translate")
    (final,) = res.of("final")
    async with httpx.AsyncClient(base_url=multi.http, timeout=120) as c:
        r = await c.post("/v1/audio/translations", files={"file": ("a.wav", _wav(_speech()))})
        models = (await c.get("/v1/models")).json()["data"]
    assert r.status_code == 200 and final["text"] == r.json()["text"], (final, r.text)
    assert [d["tasks"] for d in models if d["kind"] == "asr"] == [["transcribe", "translate"]]
    path = tmp_path / "speech.wav"
    path.write_bytes(_wav(_speech()))
    cli = await asyncio.create_subprocess_exec(sys.executable, "-m", "realtime.cli", "transcribe", str(path), "--url",
                                               f"{multi.ws}/v1/asr", "--translate", stdout=asyncio.subprocess.PIPE,
                                               stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(cli.communicate(), 120)
    assert cli.returncode == 0 and out.decode().strip() == final["text"], err.decode()[-2000:]


def test_cli_local_translate_needs_a_multilingual_model() -> None:
    r = subprocess.run([sys.executable, "-m", "realtime.cli", "transcribe", ASSET, "--local", "--translate"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "multilingual" in r.stderr and "Traceback" not in r.stderr


async def test_english_only_model_refuses_to_translate(piper_backend) -> None:  # noqa: ANN001
    cfg = ServerConfig()
    with serve(create_app(cfg, tts=piper_backend, services=[ASRService(cfg)])) as srv:
        async with httpx.AsyncClient(base_url=srv.http, timeout=60) as c:
            r = await c.post("/v1/audio/translations", files={"file": ("a.wav", _wav(_speech()))})
        assert r.status_code == 400 and "English-only" in r.json()["error"]["message"], r.text
        res = await stream(f"{srv.ws}/v1/asr", _speech()[:16000], pace=None, task="translate", expect_ready=False)
        assert res.of("error") and "English-only" in res.of("error")[0]["message"], res.messages


# (the SDK marks audio.translations deprecated; it still sends the request, and servers still take it)
@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")
def test_openai_sdk_translations_and_word_timestamps(multi, tmp_path) -> None:  # noqa: ANN001
    """The official ``openai`` SDK against the served endpoints: translations (text, and
    verbose_json's task), and transcriptions with word timestamps (its ``words``)."""
    from openai import OpenAI

    path = tmp_path / "speech.wav"
    path.write_bytes(_wav(_speech()))
    client = OpenAI(base_url=f"{multi.http}/v1", api_key="unused-on-loopback")
    with path.open("rb") as f:
        text = client.audio.translations.create(model="whisper-1", file=f)
    with path.open("rb") as f:
        verbose = client.audio.translations.create(model="whisper-1", file=f, response_format="verbose_json")
    assert text.text == verbose.text and verbose.task == "translate"
    with path.open("rb") as f:
        words = client.audio.transcriptions.create(model="whisper-1", file=f, response_format="verbose_json",
                                                   timestamp_granularities=["word"])
    assert words.words and all(w.start <= w.end for w in words.words)  # (random weights: some are 0 long)
    assert "".join(w.word for w in words.words) == words.text.replace(" ", "")
