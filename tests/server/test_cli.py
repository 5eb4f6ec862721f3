"""The `realtime` command against a real server and in process."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import soundfile as sf
from liveserver import serve

from realtime.config import ServerConfig
from realtime.server import create_app


def test_say_through_server_and_local(piper_backend, tmp_path) -> None:  # noqa: ANN001
    app = create_app(ServerConfig(warmup=False), tts=piper_backend, services=[])
    with serve(app) as live:
        out = tmp_path / "hello.wav"
        r = subprocess.run([sys.executable, "-m", "realtime.cli", "say", "Hello there, how are you today?",
                            "-o", str(out), "--url", f"{live.ws}/v1/tts"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "ttfa" in r.stdout
        mp3 = tmp_path / "hello.mp3"  # the format by the suffix; a suffix it cannot write is a clear error
        r = subprocess.run([sys.executable, "-m", "realtime.cli", "say", "Hello there.", "-o", str(mp3),
                            "--url", f"{live.ws}/v1/tts"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and mp3.read_bytes()[:2] in (b"ID", b"\xff\xfb", b"\xff\xf3"), r.stderr[-2000:]
        with sf.SoundFile(mp3) as f:
            assert f.samplerate == 24000 and f.format == "MP3" and f.frames > 12000
        aac = tmp_path / "hello.aac"  # (ADTS frames: the bundled ffmpeg reads them back)
        r = subprocess.run([sys.executable, "-m", "realtime.cli", "say", "Hello there.", "-o", str(aac),
                            "--url", f"{live.ws}/v1/tts"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and aac.read_bytes()[:2] == b"\xff\xf1", r.stderr[-2000:]
        import imageio_ffmpeg

        dec = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-loglevel", "error", "-i", str(aac), "-f", "s16le",
                              "-ac", "1", "pipe:1"], capture_output=True, check=True)
        assert len(dec.stdout) // 2 > 12000  # over half a second at 24 kHz
        r = subprocess.run([sys.executable, "-m", "realtime.cli", "say", "Hi.", "-o", str(tmp_path / "x.wma"),
                            "--url", f"{live.ws}/v1/tts"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and ".wma" in r.stderr and "Traceback" not in r.stderr
    audio, rate = sf.read(out)
    assert rate == 24000 and 1.0 < len(audio) / rate < 5.0
    assert np.sqrt(np.mean(audio ** 2)) > 0.02
    local = tmp_path / "local.wav"
    r = subprocess.run([sys.executable, "-m", "realtime.cli", "say", "Hello there.", "-o", str(local), "--local"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    audio, rate = sf.read(local)
    assert rate == 22050 and len(audio) > rate // 2


def test_say_reports_a_missing_server(tmp_path) -> None:  # noqa: ANN001
    r = subprocess.run([sys.executable, "-m", "realtime.cli", "say", "Hi.", "-o", str(tmp_path / "x.wav"),
                        "--url", "ws://127.0.0.1:9/v1/tts"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr


def test_serve_refuses_public_bind_without_key() -> None:
    r = subprocess.run([sys.executable, "-m", "realtime.cli", "serve", "--host", "0.0.0.0", "--no-asr", "--no-text"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "api-key" in r.stderr
