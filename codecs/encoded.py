"""Compressed audio for ``POST /v1/audio/speech``: mp3, opus (in OGG), flac and aac (ADTS), encoded as
the audio is made; mp3, opus and aac are sent as the encoder emits them, flac whole at the end.

libsndfile (through soundfile) does the encoding. It writes into a sink that hands out the bytes
appended since the last call. At close, libsndfile seeks back to fill in what it learns at the end
(MP3's Xing/LAME frame). Those bytes have already been sent, so the rewrite is dropped: the frame
stays a plain silent frame, and a decoder does not trim the encoder's delay (~70 ms of silence
before the speech). Latency: MP3 frames come every ~50 ms of audio; libsndfile writes an OGG page
of Opus about once a second, so the first opus bytes come after ~1 s of audio. A FLAC stream
whose STREAMINFO says "length unknown" is legal, but libsndfile's own reader fails on one, so
flac is held until the end and sent with its header filled in (length, MD5).

aac goes through an ffmpeg process (its native AAC encoder, ADTS frames on stdout): the binary the
imageio-ffmpeg package bundles, which the `video` extra installs; without it aac is refused. A
reader thread collects what ffmpeg writes, so a push never waits for the encoder; each push hands
out what has come so far, and the encoder's last frames come at close.
"""

from __future__ import annotations

import io
import subprocess
import threading
import weakref
from typing import IO, Any

import numpy as np

from realtime.errors import InternalError, UnsupportedError

# response_format -> (libsndfile format, subtype, extra settings, media type)
ENCODED: dict[str, tuple[str, str, dict[str, Any], str]] = {  # (flac: sent whole, see above)
    "mp3": ("MP3", "MPEG_LAYER_III", {"compression_level": 0.6, "bitrate_mode": "CONSTANT"}, "audio/mpeg"),  # ~64 kbit/s at 24 kHz
    "opus": ("OGG", "OPUS", {}, "audio/ogg"),  # libsndfile's default, ~40 kbit/s
    "flac": ("FLAC", "PCM_16", {}, "audio/flac"),
}
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
# response_format -> (ffmpeg's output arguments, media type); its input is s16le mono (FfmpegStream)
FFMPEG: dict[str, tuple[tuple[str, ...], str]] = {
    "aac": (("-c:a", "aac", "-b:a", "64k", "-f", "adts"), "audio/aac"),  # AAC-LC, 64 kbit/s
}
FORMATS = (*ENCODED, *FFMPEG)  # every response_format encoded here
VIDEO_EXTRA = "pip install 'realtime[video]'"


class _Sink(io.RawIOBase):
    """A write-only file for libsndfile that keeps only what has not been handed out yet."""

    def __init__(self, streaming: bool = True) -> None:
        super().__init__()
        self.streaming = streaming  # False: take() hands out nothing until take(final=True)
        self._pending = bytearray()  # bytes [sent, end) not handed out yet
        self.sent = 0  # bytes handed out
        self.end = 0  # the file's length
        self.pos = 0

    def readable(self) -> bool:
        return True  # (libsndfile's virtual IO asks for read; nothing is ever read back here)

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:  # noqa: ARG002
        return b""

    def readinto(self, b: Any) -> int:  # noqa: ARG002
        return 0

    def write(self, b: Any) -> int:
        data = bytes(b)
        start, stop = self.pos, self.pos + len(data)
        if stop > self.sent:  # (a rewrite of bytes already sent is dropped)
            lo = max(start, self.sent)
            if stop > self.end:
                self._pending.extend(b"\0" * (stop - self.end))
                self.end = stop
            self._pending[lo - self.sent:stop - self.sent] = data[lo - start:]
        self.pos = stop
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.end + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def take(self, final: bool = False) -> bytes:
        if not (self.streaming or final):
            return b""
        out = bytes(self._pending)
        self.sent += len(out)
        self._pending.clear()
        return out


def _ffmpeg() -> str | None:
    """The bundled ffmpeg binary's path, or None where imageio-ffmpeg is not installed."""
    try:
        import imageio_ffmpeg

        return imageio_ffmpeg.get_ffmpeg_exe()
    except (ImportError, RuntimeError):
        return None


def check(name: str, rate: int) -> None:
    """Raise UnsupportedError unless ``name`` can be encoded at ``rate`` here."""
    import soundfile as sf

    if name in FFMPEG:
        if _ffmpeg() is None:
            raise UnsupportedError(f"response_format '{name}' needs ffmpeg, which this server lacks: {VIDEO_EXTRA}")
        return
    fmt, sub, _, _ = ENCODED[name]
    if fmt not in sf.available_formats() or sub not in sf.available_subtypes(fmt):
        raise UnsupportedError(f"response_format '{name}' needs a libsndfile with {fmt} {sub}, which this server lacks")
    if name == "opus" and rate not in OPUS_RATES:
        raise UnsupportedError(f"opus takes a sample rate of {', '.join(map(str, OPUS_RATES))} Hz, not {rate}")


class EncodedStream:
    """s16le mono PCM in (any chunking), the encoded stream out as it is made."""

    def __init__(self, name: str, rate: int) -> None:
        import soundfile as sf

        check(name, rate)
        fmt, sub, extra, self.media_type = ENCODED[name]
        self._sink = _Sink(streaming=name != "flac")
        self._file = sf.SoundFile(self._sink, "w", samplerate=rate, channels=1, format=fmt, subtype=sub, **extra)
        self.closed = False

    def push(self, pcm: bytes) -> bytes:
        """Encode ``pcm`` (s16le); returns the bytes the encoder has finished (may be empty)."""
        assert not self.closed, "push after close"
        if pcm:
            self._file.write(np.frombuffer(pcm, dtype="<i2"))
        return self._sink.take()

    def close(self) -> bytes:
        """The rest of the stream (the encoder's buffered audio and trailer)."""
        if self.closed:
            return b""
        self.closed = True
        self._file.close()
        return self._sink.take(final=True)


def _collect(out: IO[bytes], buf: bytearray, lock: threading.Lock) -> None:
    """FfmpegStream's reader: ffmpeg's output into ``buf`` until it closes its stdout."""
    while chunk := out.read1(1 << 16):  # type: ignore[attr-defined]
        with lock:
            buf.extend(chunk)


def _stop(proc: subprocess.Popen) -> None:
    """An encoder dropped without close (a request that ended early): its process is killed."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


class FfmpegStream:
    """EncodedStream's interface for the FFMPEG formats: s16le mono PCM in, the stream out."""

    def __init__(self, name: str, rate: int) -> None:
        check(name, rate)
        args, self.media_type = FFMPEG[name]
        cmd = [_ffmpeg() or "ffmpeg", "-hide_banner", "-loglevel", "error", "-f", "s16le", "-ar", str(rate),
               "-ac", "1", "-i", "pipe:0", *args, "-flush_packets", "1", "pipe:1"]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL)
        self._buf, self._lock = bytearray(), threading.Lock()
        # (the reader holds no reference to self, so a dropped stream is collected and _stop runs)
        self._reader = threading.Thread(target=_collect, args=(self._proc.stdout, self._buf, self._lock),
                                        name=f"ffmpeg-{name}", daemon=True)
        self._reader.start()
        self._finalizer = weakref.finalize(self, _stop, self._proc)
        self.closed = False

    def _take(self) -> bytes:
        with self._lock:
            out = bytes(self._buf)
            self._buf.clear()
        return out

    def push(self, pcm: bytes) -> bytes:
        """Send ``pcm`` (s16le) to the encoder; returns the bytes it has finished so far."""
        assert not self.closed, "push after close"
        if pcm:
            try:
                self._proc.stdin.write(pcm)  # type: ignore[union-attr]
                self._proc.stdin.flush()  # type: ignore[union-attr]
            except OSError:  # (ffmpeg exited: its exit status is the error)
                self.close()
        return self._take()

    def close(self) -> bytes:
        """The rest of the stream: ffmpeg's input ends, and everything it writes until it exits."""
        if self.closed:
            return b""
        self.closed = True
        try:
            self._proc.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _stop(self._proc)
        self._reader.join(timeout=10)
        self._finalizer.detach()
        if self._proc.returncode != 0:
            raise InternalError(f"the {self.media_type} encoder (ffmpeg) exited with {self._proc.returncode}")
        return self._take()


def encoder(name: str, rate: int) -> EncodedStream | FfmpegStream:
    """The encoder of response_format ``name`` (one of FORMATS) at ``rate`` Hz."""
    return FfmpegStream(name, rate) if name in FFMPEG else EncodedStream(name, rate)
