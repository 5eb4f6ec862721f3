"""G.711 against the ITU reference values and the resampler: chunked == offline, tones preserved."""

from __future__ import annotations

import numpy as np
import pytest

from realtime.codecs.g711 import alaw_decode, alaw_encode, ulaw_decode, ulaw_encode
from realtime.codecs.resample import StreamResampler, pack_pcm, resample, unpack_pcm


def _g191_ulaw(x: int) -> int:
    """Scalar transcription of ITU-T G.191's ulaw_compress, the normative reference."""
    absno = (((~x) >> 2) if x < 0 else (x >> 2)) + 33
    absno = min(absno, 0x1FFF)
    i, segno = absno >> 6, 1
    while i:
        segno, i = segno + 1, i >> 1
    out = ((8 - segno) << 4) | (15 - ((absno >> segno) & 15))
    return out | 0x80 if x >= 0 else out


def test_ulaw_known_values() -> None:
    x = np.array([0, -1, 1, 32767, -32768, 100, -100, 1000], dtype=np.int16)
    assert ulaw_encode(x).tolist() == [0xFF, 0x7F, 0xFF, 0x80, 0x00, 0xF2, 0x73, 0xCE]
    # decoding table anchors (G.711 table 2a): full scale ±32124, zero codes 0x7F/0xFF
    assert ulaw_decode(np.array([0x00, 0x80, 0x7F, 0xFF, 0xF2], dtype=np.uint8)).tolist() == \
        [-32124, 32124, 0, 0, 104]


def test_ulaw_equals_g191_on_every_sample() -> None:
    x = np.arange(-32768, 32768, 7, dtype=np.int64)
    ref = np.array([_g191_ulaw(int(v)) for v in x], dtype=np.uint8)
    assert np.array_equal(ulaw_encode(x.astype(np.int16)), ref)


def test_alaw_known_values() -> None:
    x = np.array([0, -1, 8, -8, 32767, -32768, 1000], dtype=np.int16)
    assert alaw_encode(x).tolist() == [0xD5, 0x55, 0xD5, 0x55, 0xAA, 0x2A, 0xFA]
    assert alaw_decode(np.array([0xD5, 0x55, 0xAA, 0x2A], dtype=np.uint8)).tolist() == [8, -8, 32256, -32256]


def test_companding_round_trip_and_monotonic() -> None:
    codes = np.arange(256, dtype=np.uint8)
    for enc, dec in ((ulaw_encode, ulaw_decode), (alaw_encode, alaw_decode)):
        lin = dec(codes)
        assert np.array_equal(dec(enc(lin)), lin)  # decode ∘ encode is the identity on the grid
        x = np.arange(-32768, 32768, dtype=np.int64).astype(np.int16)
        y = dec(enc(x)).astype(np.int64)
        assert np.all(np.diff(y) >= 0)  # quantiser is monotonic
        err = np.abs(y - x.astype(np.int64))
        assert err.max() <= 1100  # coarsest segment step /2 (+ the bias of the top segment)


@pytest.mark.parametrize("src, dst", [(22050, 24000), (22050, 8000), (24000, 16000), (16000, 48000), (24000, 24000)])
def test_resampler_chunked_equals_offline(src: int, dst: int) -> None:
    x = np.random.default_rng(0).standard_normal(src // 2).astype(np.float32)
    whole = resample(x, src, dst)
    assert len(whole) == -(-len(x) * dst // src)
    for size in (1, 7, 160, 999, 4000):
        r = StreamResampler(src, dst)
        parts = [r.process(x[i:i + size]) for i in range(0, len(x), size)] + [r.flush()]
        assert np.array_equal(np.concatenate(parts), whole)


@pytest.mark.parametrize("src, dst", [(22050, 24000), (22050, 8000), (16000, 48000)])
def test_resampler_preserves_a_tone(src: int, dst: int) -> None:
    t = np.arange(src) / src
    y = resample(np.sin(2 * np.pi * 440 * t).astype(np.float32), src, dst)
    ref = np.sin(2 * np.pi * 440 * np.arange(len(y)) / dst)
    assert np.abs(y[100:-100] - ref[100:-100]).max() < 1e-3


def test_resampler_removes_content_above_the_new_nyquist() -> None:
    t = np.arange(22050) / 22050
    y = resample(np.sin(2 * np.pi * 6000 * t).astype(np.float32), 22050, 8000)  # 6 kHz > 4 kHz Nyquist
    assert np.sqrt(np.mean(y[200:-200] ** 2)) < 0.01


@pytest.mark.parametrize("fmt", ["pcm_s16le", "pcm_f32le", "mulaw", "alaw"])
def test_pack_unpack(fmt: str) -> None:
    x = np.linspace(-0.9, 0.9, 101).astype(np.float32)
    back = unpack_pcm(pack_pcm(x, fmt), fmt)
    tol = {"pcm_f32le": 1e-7, "pcm_s16le": 1e-4, "mulaw": 0.04, "alaw": 0.04}[fmt]
    assert np.abs(back - x).max() < tol


def test_encoder_tables_equal_the_arithmetic_on_every_sample() -> None:
    from realtime.codecs.g711 import _alaw_encode_ref, _ulaw_encode_ref

    every = np.arange(-32768, 32768).astype(np.int16)
    assert np.array_equal(ulaw_encode(every), _ulaw_encode_ref(every))
    assert np.array_equal(alaw_encode(every), _alaw_encode_ref(every))


@pytest.mark.parametrize("fmt", ["pcm_s16le", "pcm_f32le", "mulaw", "alaw"])
def test_pack_rows_equals_pack_per_row(fmt: str) -> None:
    from realtime.codecs.resample import pack_pcm_rows

    rng = np.random.default_rng(3)
    x = rng.uniform(-1.3, 1.3, (16, 1920)).astype(np.float32)  # beyond full scale: clipped
    x[0, :5] = [1.0, -1.0, 0.0, 0.5 / 32767, -1.5 / 32767]  # the edges and rounding ties
    assert pack_pcm_rows(x, fmt) == [pack_pcm(row, fmt) for row in x]
    s16 = np.round(np.clip(x, -1.0, 1.0) * 32767.0).astype(np.int16)  # the per-sample definition
    want = {"pcm_s16le": s16.astype("<i2"), "pcm_f32le": np.clip(x, -1.0, 1.0).astype("<f4"),
            "mulaw": ulaw_encode(s16), "alaw": alaw_encode(s16)}[fmt]
    assert pack_pcm_rows(x, fmt) == [row.tobytes() for row in want]
