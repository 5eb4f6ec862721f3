"""Streaming band-limited resampling between the service's rates (8–48 kHz), and PCM packing.

A polyphase windowed-sinc resampler for a rational ratio L/M (after reducing the rates by their
gcd: 22050 → 24000 is 160/147). Output sample n sits at input position n·M/L; it is the dot product
of ``TAPS`` input samples around that position with one of L precomputed filter phases. The
streaming object keeps the input tail it still needs, so feeding audio in any chunking gives the
same samples as one call on the whole signal (tested), at a latency of TAPS/2 input samples.
"""

from __future__ import annotations

import functools
from math import gcd

import numpy as np

from realtime.codecs.g711 import alaw_encode, ulaw_encode

HALF_TAPS = 16  # zero crossings each side: ~0.7 ms at 22 kHz, stopband well below 16-bit noise
KAISER_BETA = 8.6


@functools.lru_cache(maxsize=16)
def _filters(up: int, down: int) -> np.ndarray:
    """Filter bank [up, 2*HALF_TAPS]: phase p serves output positions with fraction p/up."""
    cutoff = min(1.0, up / down)  # low-pass at the lower Nyquist
    k = np.arange(-HALF_TAPS + 1, HALF_TAPS + 1, dtype=np.float64)  # tap offsets from floor(pos)
    frac = np.arange(up, dtype=np.float64)[:, None] / up
    t = k[None, :] - frac  # distance from the output position, in input samples
    window = np.kaiser(2 * HALF_TAPS + 1, KAISER_BETA)
    # evaluate the (continuous) Kaiser window at t by interpolation over [-HALF_TAPS, HALF_TAPS]
    w = np.interp(t, np.linspace(-HALF_TAPS, HALF_TAPS, 2 * HALF_TAPS + 1), window, left=0.0, right=0.0)
    h = cutoff * np.sinc(cutoff * t) * w
    h /= h.sum(axis=1, keepdims=True)  # unit DC gain in every phase: no ripple at the frame rate
    h = h.astype(np.float32)
    h.flags.writeable = False
    return h


@functools.lru_cache(maxsize=32)  # a plan of P outputs holds P·2·HALF_TAPS indices and weights
def _plan(up: int, down: int, n_out: int, buf_start: int, available: int) -> tuple[np.ndarray, np.ndarray, int] | None:
    """The outputs n_out.. that inputs [.., available) determine, for a history starting at input
    ``buf_start``: (their taps as indices into the history [P, 2·HALF_TAPS], the taps' weights
    [P, 2·HALF_TAPS], the next output index), or None when there are none yet."""
    # output n needs inputs floor(n*down/up) - HALF_TAPS + 1 .. floor(n*down/up) + HALF_TAPS
    # largest n with base(n) + HALF_TAPS <= available - 1
    last = (available - 1 - HALF_TAPS + 1) * up // down + 1
    while last >= 0 and (last * down // up) + HALF_TAPS > available - 1:
        last -= 1
    if last < n_out:
        return None
    n = np.arange(n_out, last + 1, dtype=np.int64)
    base = n * down // up
    phase = n * down - base * up
    idx = (base - HALF_TAPS + 1 - buf_start)[:, None] + np.arange(2 * HALF_TAPS)[None, :]
    weights = _filters(up, down)[phase]
    idx.flags.writeable = weights.flags.writeable = False
    return idx, weights, last + 1


class StreamResampler:
    """Resample a mono float32 stream from ``src`` Hz to ``dst`` Hz, chunk-invariantly."""

    def __init__(self, src: int, dst: int) -> None:
        g = gcd(src, dst)
        self.up, self.down = dst // g, src // g
        self.identity = self.up == self.down
        self.bank = _filters(self.up, self.down) if not self.identity else None  # shared, read-only
        # Input history: starts with HALF_TAPS-1 zeros so the first outputs see a silent past.
        self.buf = np.zeros(HALF_TAPS - 1, dtype=np.float32)
        self.buf_start = -(HALF_TAPS - 1)  # absolute input index of buf[0]
        self.n_out = 0  # next output sample index
        self.n_in = 0  # input samples received

    def _emit(self, available: int) -> np.ndarray:
        """All outputs whose taps lie within inputs [.., available)."""
        # Shift by whole periods (q·up outputs = q·down inputs) so the plan's positions are small and
        # repeat: every 80 ms frame of a stream in steady state, and every stream in the same phase,
        # reuses one cached plan (its index arithmetic cost more than the dot products).
        q = self.n_out // self.up
        plan = _plan(self.up, self.down, self.n_out - q * self.up, self.buf_start - q * self.down,
                     available - q * self.down)
        if plan is None:
            return np.zeros(0, dtype=np.float32)
        idx, weights, end = plan
        out = np.einsum("nt,nt->n", self.buf[idx], weights)
        self.n_out = end + q * self.up
        # drop history no future output needs
        keep_from = (self.n_out * self.down // self.up) - HALF_TAPS + 1
        drop = keep_from - self.buf_start
        if drop > 0:
            self.buf = self.buf[drop:]
            self.buf_start += drop
        return out.astype(np.float32)

    def process(self, x: np.ndarray) -> np.ndarray:
        """Feed input samples [N]; returns the output samples that are now fully determined."""
        x = np.asarray(x, dtype=np.float32)
        if self.identity:
            self.n_in += len(x)
            return x
        self.buf = np.concatenate([self.buf, x])
        self.n_in += len(x)
        return self._emit(self.n_in)

    def flush(self) -> np.ndarray:
        """End of stream: pad with silence and return the remaining outputs (total = ceil(N·L/M))."""
        if self.identity:
            return np.zeros(0, dtype=np.float32)
        total = -(-self.n_in * self.up // self.down)
        pad = HALF_TAPS + 1
        self.buf = np.concatenate([self.buf, np.zeros(pad, dtype=np.float32)])
        out = self._emit(self.n_in + pad)
        extra = self.n_out - total
        return out[: len(out) - extra] if extra > 0 else out


def resample(x: np.ndarray, src: int, dst: int) -> np.ndarray:
    """Offline resampling of a whole signal (same result as the streaming path)."""
    r = StreamResampler(src, dst)
    return np.concatenate([r.process(x), r.flush()])


def pack_pcm(x: np.ndarray, fmt: str) -> bytes:
    """float32 samples in [-1, 1] → wire bytes in ``fmt`` (pcm_s16le, pcm_f32le, mulaw, alaw)."""
    return _pack(x, fmt).tobytes()


def pack_pcm_rows(x: np.ndarray, fmt: str) -> list[bytes]:
    """``pack_pcm`` of every row of float32 [B, N], in one numpy pass over the batch → B chunks."""
    return [row.tobytes() for row in _pack(x, fmt)]


def _pack(x: np.ndarray, fmt: str) -> np.ndarray:
    """float32 [...] → the wire samples as an array of the wire dtype (same shape)."""
    y = np.clip(np.asarray(x, dtype=np.float32), -1.0, 1.0)  # a new array: scaled in place below
    if fmt == "pcm_f32le":
        return y.astype("<f4", copy=False)
    np.multiply(y, np.float32(32767.0), out=y)
    s16 = np.rint(y, out=y).astype(np.int16)
    if fmt == "pcm_s16le":
        return s16.astype("<i2", copy=False)
    if fmt == "mulaw":
        return ulaw_encode(s16)
    if fmt == "alaw":
        return alaw_encode(s16)
    raise ValueError(f"unknown audio format {fmt!r}")


def unpack_pcm(data: bytes, fmt: str) -> np.ndarray:
    """Wire bytes → float32 samples in [-1, 1]."""
    from realtime.codecs.g711 import alaw_decode, ulaw_decode

    if fmt == "pcm_f32le":
        if len(data) % 4:
            raise ValueError("pcm_f32le data must be a multiple of 4 bytes")
        return np.frombuffer(data, dtype="<f4").astype(np.float32)
    if fmt == "pcm_s16le":
        if len(data) % 2:
            raise ValueError("pcm_s16le data must be a multiple of 2 bytes")
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
    codes = np.frombuffer(data, dtype=np.uint8)
    if fmt == "mulaw":
        return ulaw_decode(codes).astype(np.float32) / 32768.0
    if fmt == "alaw":
        return alaw_decode(codes).astype(np.float32) / 32768.0
    raise ValueError(f"unknown audio format {fmt!r}")


BYTES_PER_SAMPLE = {"pcm_s16le": 2, "pcm_f32le": 4, "mulaw": 1, "alaw": 1}
