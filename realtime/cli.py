"""The ``realtime`` command: serve, say (and, as engines land, transcribe / chat / agent)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np


def _add_devices(p: argparse.ArgumentParser) -> None:
    p.add_argument("--generator-device", default="cpu", help="device of the generator stage (cpu, cuda:0)")
    p.add_argument("--codec-device", default=None, help="device of the codec/vocoder stage (default: same)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from realtime.config import ServerConfig
    from realtime.errors import ConfigError
    from realtime.server import create_app

    cfg = ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key or os.environ.get("REALTIME_API_KEY") or None,
        allow_no_auth=args.no_auth, max_frame_bytes=args.max_frame_bytes, max_streams=args.max_streams,
        generator_device=args.generator_device, codec_device=args.codec_device or args.generator_device,
        dtype=args.dtype, tts_model=args.tts_model, warmup=not args.no_warmup,
        tts_slots=args.tts_slots, cuda_graphs=not args.eager,
        text_slots=args.text_slots, text_context=args.text_context, text_exact=args.text_exact,
        asr_exact=args.asr_exact,
        text_prefix_reuse=not args.no_prefix_reuse,
        asr_model=args.asr_model, text_model=args.text_model, image_model=args.image_model,
        video_model=args.video_model,
        enable_asr=not args.no_asr and _have("realtime.asr_service"),
        enable_text=not args.no_text and _have("realtime.text_service"),
    )
    try:
        app = create_app(cfg)
    except ConfigError as exc:
        print(f"realtime: {exc.message}", file=sys.stderr)
        return 2
    # No permessage-deflate: the frames are audio, which zlib barely shrinks, and compressing each
    # chunk cost more server CPU than everything else per stream-frame (docs/speed_notes.md).
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=args.log_level,
                ws_max_size=max(cfg.max_frame_bytes * 2, 1 << 16), ws_ping_interval=20, ws_ping_timeout=20,
                ws_per_message_deflate=False)
    return 0


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# Services that add their own subcommands (transcribe, chat, agent, image) via add_cli(subparsers).
CLI_MODULES = ("realtime.asr_service", "realtime.text_service", "realtime.agent_service", "realtime.image_service")


# an output file's suffix -> its format: wav, or one of codecs/encoded.py's
AUDIO_SUFFIXES = {".wav": "wav", ".flac": "flac", ".mp3": "mp3", ".ogg": "opus", ".opus": "opus", ".aac": "aac"}


def _write_audio(path: str, audio: np.ndarray, rate: int) -> None:
    """Write by the file's suffix: .wav (16-bit), or .flac, .mp3, .ogg / .opus, .aac as
    /v1/audio/speech encodes them."""
    import soundfile as sf

    from realtime.codecs.encoded import ENCODED, FFMPEG, check, encoder
    from realtime.errors import UnsupportedError

    name = AUDIO_SUFFIXES.get(Path(path).suffix.lower())
    if name is None:
        raise ValueError(f"cannot write '{Path(path).suffix}': use {', '.join(AUDIO_SUFFIXES)}")
    if name == "wav":
        sf.write(path, audio, rate, format="WAV", subtype="PCM_16")
        return
    try:
        check(name, rate)
    except UnsupportedError as exc:
        hint = " (--sample-rate 24000 takes one)" if name == "opus" else ""
        raise ValueError(exc.message + hint) from None
    if name in FFMPEG:  # (aac: the stream's encoder, its PCM as the server's s16le)
        enc = encoder(name, rate)
        pcm = (np.clip(np.asarray(audio, np.float32), -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()
        Path(path).write_bytes(enc.push(pcm) + enc.close())
        return
    fmt, sub, extra, _ = ENCODED[name]  # (a file libsndfile can seek in: mp3 gets its Xing frame)
    with sf.SoundFile(path, "w", samplerate=rate, channels=1, format=fmt, subtype=sub, **extra) as f:
        f.write(audio)


def _say(args: argparse.Namespace) -> int:
    text = args.text if args.text != "-" else sys.stdin.read()
    if not text.strip():
        print("realtime say: nothing to say", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    if args.local:
        from realtime.config import ServerConfig
        from realtime.local import synthesize_local
        from realtime.server import load_tts

        cfg = ServerConfig(generator_device=args.generator_device,
                           codec_device=args.codec_device or args.generator_device,
                           dtype=args.dtype, tts_model=args.model)
        backend = load_tts(cfg)
        if args.save_codes and hasattr(backend, "keep_codes"):
            backend.keep_codes = True
        rate = args.sample_rate or backend.native_rate
        audio = synthesize_local(text, backend, rate, cfg)
        stats = {}
        if args.save_codes:
            codes = getattr(backend, "last_codes", None)
            if codes is None:
                print("realtime say: --save-codes needs a codec model (CSM)", file=sys.stderr)
                return 2
            np.save(args.save_codes, codes)
    else:
        from realtime.clients.tts import ServerError, synthesize

        rate = args.sample_rate or 24000
        try:
            audio, stats = synthesize(args.url, text, sample_rate=rate,
                                      api_key=args.api_key or os.environ.get("REALTIME_API_KEY"))
        except (ServerError, OSError) as exc:
            print(f"realtime say: {exc}", file=sys.stderr)
            return 1
    try:
        _write_audio(args.output, audio, rate)
    except (ValueError, OSError, RuntimeError) as exc:  # (soundfile's errors are RuntimeErrors)
        print(f"realtime say: {exc}", file=sys.stderr)
        return 2
    dur = len(audio) / rate
    extra = f", ttfa {stats['client_ttfa_ms']:.0f} ms" if stats.get("client_ttfa_ms") is not None else ""
    print(f"wrote {args.output}: {dur:.2f} s at {rate} Hz in {time.perf_counter() - t0:.2f} s{extra}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``realtime`` command line: serve, say, and the subcommands of the installed services."""
    parser = argparse.ArgumentParser(prog="realtime", description="Real-time streaming speech service")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run the WebSocket/HTTP service")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or env REALTIME_API_KEY)")
    s.add_argument("--no-auth", action="store_true", help="allow a non-loopback bind without a key")
    s.add_argument("--tts-model", default=None, help="a CSM checkpoint folder or a Piper .onnx (default: embedded voice)")
    s.add_argument("--asr-model", default=None, help="Whisper folder (HF or CTranslate2); default: embedded tiny.en")
    s.add_argument("--text-model", default=None, help="Llama/Qwen3 folder or .gguf; default: embedded SmolLM2")
    s.add_argument("--image-model", default=None, help="DiT folder with transformer/ and vae/")
    s.add_argument("--video-model", default=None,
                   help="/v1/video: a checkpoint folder (a DiT folder runs frame by frame; needs realtime[video])")
    s.add_argument("--no-asr", action="store_true", help="do not serve speech recognition")
    s.add_argument("--no-text", action="store_true", help="do not serve text generation")
    s.add_argument("--text-exact", action="store_true",
                   help="CPU text: dequantize every weight to float32 (transformers' numbers, ~2.6x slower than the "
                        "default, which runs a GGUF's own Q4_0/Q4_1 codes and bfloat16 products)")
    s.add_argument("--asr-exact", action="store_true",
                   help="CPU ASR: Whisper in float32 throughout (the reference's numbers, ~2x slower than the "
                        "default, which runs the encoder and the vocabulary projection on bfloat16 products "
                        "where the CPU has them: AVX512-BF16 or AMX)")
    s.add_argument("--no-prefix-reuse", action="store_true",
                   help="CPU text: never reuse the K/V of a prompt prefix that another request left in a slot "
                        "(on by default: the replies are the same either way, but a shared prefix answers sooner)")
    s.add_argument("--tts-slots", type=int, default=16, help="CSM: concurrent streams (KV-cache slots)")
    s.add_argument("--eager", action="store_true", help="no CUDA graphs (debugging)")
    s.add_argument("--text-slots", type=int, default=None, help="text decode: concurrent requests")
    s.add_argument("--text-context", type=int, default=None, help="text decode: tokens per request")
    s.add_argument("--max-frame-bytes", type=int, default=1 << 20)
    s.add_argument("--max-streams", type=int, default=256)
    s.add_argument("--no-warmup", action="store_true")
    s.add_argument("--log-level", default="info")
    _add_devices(s)
    s.set_defaults(fn=_serve)

    y = sub.add_parser("say", help="speak TEXT into an audio file (wav, flac, mp3, ogg)")
    y.add_argument("text", help="the text ('-' reads stdin)")
    y.add_argument("-o", "--output", required=True, help="a .wav, .flac, .mp3, .ogg/.opus or .aac file (by its suffix)")
    y.add_argument("--url", default="ws://127.0.0.1:8000/v1/tts")
    y.add_argument("--api-key", default=None)
    y.add_argument("--local", action="store_true", help="synthesize in this process (no server)")
    y.add_argument("--model", default=None, help="with --local: a CSM folder or Piper .onnx")
    y.add_argument("--sample-rate", type=int, default=None)
    y.add_argument("--save-codes", default=None, help="with --local and CSM: save codec codes (.npy)")
    _add_devices(y)
    y.set_defaults(fn=_say)

    for name in CLI_MODULES:
        if _have(name):
            importlib.import_module(name).add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
