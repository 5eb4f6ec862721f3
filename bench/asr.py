"""Streaming ASR benchmark: final-after-end-of-speech latency and real-time factor per stream.

    python bench/asr.py                                   # tiny.en on the CPU, 1 and 4 streams
    python bench/asr.py --device cuda --dtype float16     # on a GPU (faster-whisper on the same GPU)
    python bench/asr.py --streams 1 4 16 --utterances 6

Ours: a real uvicorn server in this process (ASRService on the one scheduler), real WebSocket
clients streaming 16 kHz s16 in 20 ms chunks at real-time pace; each stream plays a sequence of
utterances (the CMU ARCTIC clip and sentences spoken by the embedded Piper voice), each followed
by ``--gap-s`` of silence. Latency is measured on the client: the moment it sent the last sample
of an utterance's clip → the ``final`` for it received. This includes the VAD's silence hangover
(500 ms) that any endpointing streaming recogniser needs; "after VAD end" subtracts it (final
received − moment the audio at the final's ``end_ms`` was sent). RTF per stream is the server's
``done.stats.rtf`` (share of worker time / audio time).

Reference: faster-whisper (CTranslate2) on the same model.bin, beam 1, no timestamps, no VAD,
measured in the same run on the same utterance clips: an utterance is transcribed whole the
moment it ends (``--streams`` threads at once), so its latency is the decode time alone — a
non-streaming lower bound with perfect endpointing. RTF per stream = decode time / audio time.

Prints a table and writes bench/results/asr.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "server"))

RATE = 16000
SENTENCES = ["The weather is nice today.", "The train leaves at noon.", "She reads a book every night.",
             "The market opens early in the morning.", "They moved to a new house last year.",
             "Thank you for your patience."]


def pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 1) if xs else None


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def clips(n: int) -> list[np.ndarray]:
    import soundfile as sf

    from realtime.codecs.resample import resample
    from realtime.tts_piper import PiperBackend

    arctic, rate = sf.read(ROOT / "tests" / "assets" / "arctic_a0009.wav", dtype="float32")
    assert rate == RATE
    voice = PiperBackend().voice
    out = [arctic.astype(np.float32)]
    for s in SENTENCES[: max(0, n - 1)]:
        out.append(resample(voice.synthesize(s).astype(np.float32), voice.sample_rate, RATE))
    return out[:n]


async def one_stream(url: str, utts: list[np.ndarray], gap_s: float, offset_s: float) -> dict:
    import msgpack
    import websockets

    from realtime.codecs.resample import pack_pcm

    await asyncio.sleep(offset_s)
    gap = np.zeros(int(gap_s * RATE), np.float32)
    lead = np.zeros(int(0.3 * RATE), np.float32)
    parts, ends = [lead], []
    pos = len(lead)
    for u in utts:
        parts += [u, gap]
        pos += len(u)
        ends.append(pos * 1000 / RATE)
        pos += len(gap)
    audio = np.concatenate(parts)
    recv: list[tuple[float, dict]] = []
    async with websockets.connect(url, max_size=1 << 22) as ws:
        await ws.send(msgpack.packb({"type": "start", "sample_rate": RATE, "format": "pcm_s16le", "interim": True}))
        assert msgpack.unpackb(await ws.recv())["type"] == "ready"
        t0 = time.monotonic()

        async def send() -> None:
            n = RATE // 50
            for i in range(0, len(audio), n):
                await ws.send(msgpack.packb({"type": "audio", "audio": pack_pcm(audio[i:i + n], "pcm_s16le")}))
                await asyncio.sleep(max(0.0, t0 + (i + n) / RATE - time.monotonic()))
            await ws.send(msgpack.packb({"type": "stop"}))

        task = asyncio.create_task(send())
        async for frame in ws:
            recv.append((time.monotonic(), msgpack.unpackb(frame)))
        await task
    finals = [(t, m) for t, m in recv if m["type"] == "final"]
    after_speech, after_vad = [], []
    for t, m in finals:
        # the utterance this final belongs to: the last clip ending before the final's end
        cand = [e for e in ends if e <= m["end_ms"] + 50]
        if cand:
            after_speech.append((t - (t0 + cand[-1] / 1000)) * 1000)
        after_vad.append((t - (t0 + m["end_ms"] / 1000)) * 1000)
    stats = next(m for _, m in recv if m["type"] == "done")["stats"]
    return {"after_speech_ms": after_speech, "after_vad_ms": after_vad, "rtf": stats["rtf"],
            "finals": len(finals), "utterances": len(utts), "texts": [m["text"] for _, m in finals]}


def bench_ours(args: argparse.Namespace, utts: list[np.ndarray]) -> list[dict]:
    from liveserver import serve

    from realtime.asr_service import ASRService
    from realtime.config import ServerConfig
    from realtime.server import create_app
    from realtime.tts_piper import PiperBackend

    cfg = ServerConfig(generator_device=args.device, codec_device=args.device, dtype=args.dtype,
                       asr_model=args.model, max_streams=max(args.streams) + 8)
    app = create_app(cfg, tts=PiperBackend(), services=[ASRService(cfg)])
    rows = []
    with serve(app) as live:
        for n in args.streams:
            log(f"ours: {n} stream(s)")

            async def run() -> list[dict]:
                # streams start 0.37 s apart so their utterance ends do not all coincide
                return await asyncio.gather(*[one_stream(f"{live.ws}/v1/asr", utts, args.gap_s, 0.37 * i % 1.5)
                                              for i in range(n)])

            res = asyncio.run(run())
            sp = [x for r in res for x in r["after_speech_ms"]]
            vd = [x for r in res for x in r["after_vad_ms"]]
            rtf = [r["rtf"] for r in res]
            rows.append({"engine": "realtime (ours, streaming)", "streams": n,
                         "final_after_speech_ms_p50": pct(sp, 50), "final_after_speech_ms_p95": pct(sp, 95),
                         "final_after_vad_ms_p50": pct(vd, 50), "final_after_vad_ms_p95": pct(vd, 95),
                         "rtf_per_stream_mean": round(float(np.mean(rtf)), 4),
                         "finals": sum(r["finals"] for r in res), "utterances": sum(r["utterances"] for r in res),
                         "sample_text": res[0]["texts"][:2]})
    return rows


def bench_faster_whisper(args: argparse.Namespace, utts: list[np.ndarray]) -> list[dict]:
    from faster_whisper import WhisperModel

    from realtime.engines.whisper import default_model_dir

    path = args.model or str(default_model_dir())
    ctype = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}[args.dtype]
    dev = "cuda" if args.device.startswith("cuda") else "cpu"
    rows = []
    for n in args.streams:
        log(f"faster-whisper: {n} stream(s)")
        model = WhisperModel(path, device=dev, compute_type=ctype, num_workers=n,
                             cpu_threads=0 if dev == "cuda" else 2)
        model.transcribe(utts[0], beam_size=1, without_timestamps=True)  # warm-up
        lat: list[list[float]] = [[] for _ in range(n)]
        busy = [0.0] * n

        def worker(i: int) -> None:
            for u in utts:
                t = time.perf_counter()
                segs, _ = model.transcribe(u, beam_size=1, without_timestamps=True, language="en",
                                           condition_on_previous_text=False, vad_filter=False)
                " ".join(s.text for s in segs)  # the generator decodes lazily
                dt = time.perf_counter() - t
                lat[i].append(dt * 1000)
                busy[i] += dt

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        audio_s = sum(len(u) for u in utts) / RATE
        flat = [x for xs in lat for x in xs]
        rows.append({"engine": "faster-whisper (offline per utterance)", "streams": n,
                     "final_after_speech_ms_p50": None, "final_after_speech_ms_p95": None,
                     "final_after_vad_ms_p50": pct(flat, 50), "final_after_vad_ms_p95": pct(flat, 95),
                     "rtf_per_stream_mean": round(float(np.mean(busy)) / audio_s, 4),
                     "finals": len(flat), "utterances": len(flat)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--model", default=None, help="a Whisper CTranslate2 folder (default: embedded tiny.en)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--utterances", type=int, default=4, help="utterances per stream")
    ap.add_argument("--gap-s", type=float, default=1.0, help="silence after each utterance")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "asr.json"))
    args = ap.parse_args()
    t0 = time.time()
    utts = clips(args.utterances)
    rows = bench_ours(args, utts) + bench_faster_whisper(args, utts)
    hdr = (f"{'engine':40s} {'streams':>7s} {'speech->final p50/p95 ms':>26s} {'VAD end->final p50/p95 ms':>27s}"
           f" {'rtf/stream':>10s}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        sp = (f"{r['final_after_speech_ms_p50']}/{r['final_after_speech_ms_p95']}"
              if r["final_after_speech_ms_p50"] else "-")
        vd = f"{r['final_after_vad_ms_p50']}/{r['final_after_vad_ms_p95']}"
        print(f"{r['engine']:40s} {r['streams']:>7d} {sp:>26s} {vd:>27s} {r['rtf_per_stream_mean']:>10.4f}")
    import torch

    out = {"rows": rows, "device": args.device, "dtype": args.dtype, "model": args.model or "tiny.en (embedded)",
           "utterances_per_stream": args.utterances, "gap_s": args.gap_s, "torch": torch.__version__,
           "machine": platform.platform(), "cpu_threads": torch.get_num_threads(),
           "wall_s": round(time.time() - t0, 1),
           "note": "faster-whisper latency is the decode time of a whole utterance after it ends (no VAD "
                   "hangover, no partials); ours is measured on a live WebSocket stream"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    log(f"wrote {args.out} in {out['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
