"""mp3 / opus / flac / aac encoding for /v1/audio/speech (codecs/encoded.py): chunked == offline.

The stream must not depend on how the PCM was cut: every chunking gives the same bytes as one
push of the whole signal (opus: the same decoded samples, since each Ogg stream gets a random
serial number, and the page checksums cover it), and decodes back to the signal (flac exactly; mp3
and aac after their encoder delay, opus closely). aac is decoded by the same bundled ffmpeg."""

from __future__ import annotations

import io
import subprocess
import time

import numpy as np
import pytest
import soundfile as sf

from realtime.codecs.encoded import ENCODED, FFMPEG, FORMATS, FfmpegStream, check, encoder
from realtime.errors import UnsupportedError

RATE = 24000


def _signal() -> np.ndarray:
    t = np.arange(int(RATE * 2.3)) / RATE
    return (8000 * np.sin(2 * np.pi * 440 * t) * np.sin(2 * np.pi * 3 * t)).astype("<i2")


def _decode(data: bytes) -> np.ndarray:
    with sf.SoundFile(io.BytesIO(data)) as f:
        return f.read(dtype="int16")


def _decode_aac(data: bytes) -> np.ndarray:
    import imageio_ffmpeg

    r = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-loglevel", "error", "-f", "aac", "-i",
                        "pipe:0", "-f", "s16le", "-ac", "1", "-ar", str(RATE), "pipe:1"], input=data, capture_output=True,
                       check=True)
    return np.frombuffer(r.stdout, "<i2")


def _encode(name: str, pcm: bytes, chunk: int) -> tuple[bytes, int]:
    enc, out, parts = encoder(name, RATE), b"", 0
    for i in range(0, len(pcm), chunk):
        got = enc.push(pcm[i:i + chunk])
        out, parts = out + got, parts + bool(got)
    return out + enc.close(), parts


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_chunked_equals_offline_and_decodes_back(name: str) -> None:
    x = _signal()
    pcm = x.tobytes()
    offline, _ = _encode(name, pcm, len(pcm))
    for chunk in (2, 1922, 3840, 15554):  # one sample, odd cuts, 80 ms, ~0.3 s
        streamed, parts = _encode(name, pcm, chunk)
        if name == "opus":
            assert len(streamed) == len(offline) and np.array_equal(_decode(streamed), _decode(offline)), chunk
        else:
            assert streamed == offline, (name, chunk)
        if name == "flac":
            assert parts == 0  # held whole until the end (its header then has the length and MD5)
        elif chunk <= 3840 and name not in FFMPEG:
            assert parts > 1  # sent as the encoder emits it (aac's: see the test below)
    if name in FFMPEG:
        y = _decode_aac(offline)
    else:
        with sf.SoundFile(io.BytesIO(offline)) as f:
            assert f.samplerate == RATE and f.format == ENCODED[name][0]
            y = f.read(dtype="int16")
    if name == "flac":
        assert np.array_equal(y, x)
        return
    lag = max(range(0, 3000), key=lambda s: float(np.dot(y[s:s + 12000].astype(float), x[:12000].astype(float))))
    n = min(len(y) - lag, len(x))
    assert n > len(x) - 2000
    assert np.corrcoef(y[lag:lag + n].astype(float), x[:n].astype(float))[0, 1] > 0.99


def test_opus_rates_and_unknown_names() -> None:
    with pytest.raises(UnsupportedError):
        check("opus", 22050)
    check("mp3", 22050)
    with pytest.raises(KeyError):
        encoder("ogg", RATE)


def test_aac_without_ffmpeg_is_refused_with_the_extra_to_install(monkeypatch) -> None:  # noqa: ANN001
    import realtime.codecs.encoded as encoded

    monkeypatch.setattr(encoded, "_ffmpeg", lambda: None)
    with pytest.raises(UnsupportedError, match=r"realtime\[video\]"):
        encoder("aac", RATE)


def test_aac_comes_while_pushed_and_a_dropped_encoder_ends_its_ffmpeg() -> None:
    """ADTS frames come back from pushes before close (the reader thread collects them while the
    audio goes in), and an encoder dropped without close does not leave its ffmpeg running."""
    pcm = _signal().tobytes()
    enc, early = FfmpegStream("aac", RATE), b""
    for i in range(0, len(pcm), 3840):  # 80 ms a push, paced a little as speech comes
        early += enc.push(pcm[i:i + 3840])
        time.sleep(0.005)
    assert early[:2] == b"\xff\xf1" and len(early) > 2000  # an ADTS sync word, MPEG-4, no CRC
    assert (early + enc.close()).startswith(early)
    dropped = FfmpegStream("aac", RATE)
    dropped.push(pcm[:3840])
    proc = dropped._proc
    del dropped
    assert proc.wait(timeout=10) is not None and proc.returncode != 0  # killed, not left waiting
