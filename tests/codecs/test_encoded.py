"""mp3 / opus / flac encoding for /v1/audio/speech (codecs/encoded.py): chunked == offline.

The stream must not depend on how the PCM was cut: every chunking gives the same bytes as one
push of the whole signal (opus: the same decoded samples, since each Ogg stream gets a random
serial number, and the page checksums cover it), and decodes back to the signal (flac exactly; mp3
after its encoder delay, opus closely)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from realtime.codecs.encoded import ENCODED, EncodedStream, check
from realtime.errors import UnsupportedError

RATE = 24000


def _signal() -> np.ndarray:
    t = np.arange(int(RATE * 2.3)) / RATE
    return (8000 * np.sin(2 * np.pi * 440 * t) * np.sin(2 * np.pi * 3 * t)).astype("<i2")


def _decode(data: bytes) -> np.ndarray:
    with sf.SoundFile(io.BytesIO(data)) as f:
        return f.read(dtype="int16")


def _encode(name: str, pcm: bytes, chunk: int) -> tuple[bytes, int]:
    enc, out, parts = EncodedStream(name, RATE), b"", 0
    for i in range(0, len(pcm), chunk):
        got = enc.push(pcm[i:i + chunk])
        out, parts = out + got, parts + bool(got)
    return out + enc.close(), parts


@pytest.mark.parametrize("name", sorted(ENCODED))
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
        elif chunk <= 3840:
            assert parts > 1  # sent as the encoder emits it
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
        EncodedStream("aac", RATE)
