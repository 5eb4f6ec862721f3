"""Streaming ASR benchmark: final-after-end-of-speech latency and real-time factor per stream.

    python bench/asr.py                                   # tiny.en on the CPU, 1 and 4 streams, ours
                                                          # served default and --asr-exact
    python bench/asr.py --device cuda --dtype float16     # on a GPU (the reference on the same GPU)
    python bench/asr.py --streams 1 4 16 --utterances 6
    python bench/asr.py --save-clips /tmp/clips           # write the default clips as WAVs and exit
    python bench/asr.py --clips /tmp/clips --tts-model /path/to/csm   # no Piper voice needed

Ours: a real uvicorn server in this process (ASRService on the one scheduler), real WebSocket
clients streaming 16 kHz s16 in 20 ms chunks at real-time pace; each stream plays a sequence of
utterances (the CMU ARCTIC clip and sentences spoken by the embedded Piper voice), each followed
by ``--gap-s`` of silence. Latency is measured on the client: the moment it sent the last sample
of an utterance's clip → the ``final`` for it received. This includes the VAD's silence hangover
(500 ms) that any endpointing streaming recogniser needs; "after VAD end" subtracts it (final
received − moment the audio at the final's ``end_ms`` was sent). RTF per stream is the server's
``done.stats.rtf`` (share of worker time / audio time).

Clips: ``--save-clips DIR`` computes the default clips (needs the Piper voice) and writes them as
16 kHz PCM16 WAVs ``00.wav, 01.wav, ...`` into DIR, then exits; ``--clips DIR`` reads the first
``--utterances`` WAVs of DIR (sorted by name; other rates are resampled to 16 kHz, several
channels averaged) instead of synthesising, so a machine without the Piper voice can run the
benchmark. The server under test also serves TTS (unused here): the Piper voice by default, or
with ``--tts-model PATH`` a CSM checkpoint folder loaded by the server itself (eager, no CUDA
graphs, so it starts fast), and then Piper is never imported.

Reference (``--reference``, default ``auto``): faster-whisper on the same model.bin, beam 1, no
timestamps, no VAD, when ``import faster_whisper`` works; otherwise (or with ``ctranslate2``)
CTranslate2 directly, faster-whisper's own engine, called the way faster-whisper calls it: the
log-mel of the utterance (our front end, on audio + 160 zero samples as faster-whisper does), its
content frames zero-padded to 3000, the prompt [<|startoftranscript|>, <|notimestamps|>] (.en) or
[sot, <|en|>, <|transcribe|>, <|notimestamps|>] (multilingual) and the same generate() options;
only faster-whisper's temperature fallback is left out (greedy only). Both run on the same
utterance clips in the same run: an utterance is transcribed whole the moment it ends
(``--streams`` threads at once), so its latency is the decode time alone — a non-streaming lower
bound with perfect endpointing. RTF per stream = decode time / audio time.

Prints a table and writes bench/results/asr.json (with the reference used and its transcripts).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from _common import ARCTIC_CLIP, ARCTIC_TEXT, commit, log, write_json  # bench/ is on sys.path when a script runs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "server"))

RATE = 16000
SENTENCES = ["The weather is nice today.", "The train leaves at noon.", "She reads a book every night.",
             "The market opens early in the morning.", "They moved to a new house last year.",
             "Thank you for your patience."]




def wer(args: argparse.Namespace, texts: list[list[str]]) -> float | None:
    """Word error rate of every stream's finals against the default clips' texts (None for --clips)."""
    if args.clips is not None:
        return None
    import re

    import jiwer

    def norm(t: str) -> str:
        return " ".join(re.sub(r"[^\w' ]+", " ", t.lower()).split())

    ref = norm(" ".join([ARCTIC_TEXT] + SENTENCES[: args.utterances - 1]))
    return round(float(jiwer.wer([ref] * len(texts), [norm(" ".join(t)) for t in texts])), 4)


def pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 1) if xs else None


def read_wav(path: Path) -> np.ndarray:
    """A WAV file -> float32 mono 16 kHz [N] (channels averaged, other rates resampled)."""
    import soundfile as sf

    from realtime.codecs.resample import resample

    x, rate = sf.read(path, dtype="float32", always_2d=True)
    x = x.mean(axis=1).astype(np.float32)
    return x if rate == RATE else resample(x, rate, RATE).astype(np.float32)


def clips(n: int) -> list[np.ndarray]:
    """The default clips: the ARCTIC recording, then Piper sentences (needs the Piper voice)."""
    from realtime.codecs.resample import resample
    from realtime.tts_piper import PiperBackend

    out = [read_wav(ARCTIC_CLIP)]
    if n > 1:
        voice = PiperBackend().voice
        for s in SENTENCES[: n - 1]:
            out.append(resample(voice.synthesize(s).astype(np.float32), voice.sample_rate, RATE))
    return out[:n]


def load_clips(folder: Path, n: int) -> list[np.ndarray]:
    """The first ``n`` WAVs of ``folder`` by name (fewer if it holds fewer)."""
    files = sorted(folder.glob("*.wav"))
    if not files:
        raise ValueError(f"--clips {folder}: no .wav files")
    if len(files) < n:
        log(f"--clips {folder}: {len(files)} clips, fewer than --utterances {n}; using them all")
    return [read_wav(f) for f in files[:n]]


def save_clips(folder: Path, utts: list[np.ndarray]) -> None:
    import soundfile as sf

    folder.mkdir(parents=True, exist_ok=True)
    for i, u in enumerate(utts):
        sf.write(folder / f"{i:02d}.wav", np.clip(u, -1.0, 1.0), RATE, subtype="PCM_16")
    log(f"wrote {len(utts)} clips ({sum(len(u) for u in utts) / RATE:.1f} s) to {folder}")


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
    """Our server, once per CPU numerics (the default: bf16 encoder products where the CPU has
    them; ``--asr-exact``: float32 throughout) unless ``--no-exact``; once on a GPU."""
    from realtime.config import ServerConfig

    cfg = ServerConfig(generator_device=args.device, codec_device=args.device, dtype=args.dtype,
                       asr_model=args.model, max_streams=max(args.streams) + 8)
    rows = bench_server(args, utts, cfg, "")
    if args.device == "cpu" and not args.no_exact:
        rows += bench_server(args, utts, replace(cfg, asr_exact=True), ", --asr-exact")
    return rows


def bench_server(args: argparse.Namespace, utts: list[np.ndarray], cfg, label: str) -> list[dict]:  # noqa: ANN001
    from liveserver import serve

    from realtime.asr_service import ASRService
    from realtime.server import create_app

    if args.tts_model is None:
        from realtime.tts_piper import PiperBackend

        tts = PiperBackend()
    else:  # the server loads the CSM folder itself (load_tts); eager, since TTS is idle here
        cfg = replace(cfg, tts_model=args.tts_model, cuda_graphs=False)
        tts = None
    asr = ASRService(cfg)
    app = create_app(cfg, tts=tts, services=[asr])
    rows = []
    with serve(app) as live:
        args.server_tts = live.state.tts.name
        native = asr.whisper is not None and asr.whisper.cpu_native
        label = label or (", bf16 encoder products" if native else "")
        log(f"server up (tts={args.server_tts}{label})")
        for n in args.streams:
            log(f"ours{label}: {n} stream(s)")

            async def run() -> list[dict]:
                # streams start 0.37 s apart so their utterance ends do not all coincide
                return await asyncio.gather(*[one_stream(f"{live.ws}/v1/asr", utts, args.gap_s, 0.37 * i % 1.5)
                                              for i in range(n)])

            res = asyncio.run(run())
            sp = [x for r in res for x in r["after_speech_ms"]]
            vd = [x for r in res for x in r["after_vad_ms"]]
            rtf = [r["rtf"] for r in res]
            rows.append({"engine": f"realtime (ours, streaming{label})", "streams": n,
                         "final_after_speech_ms_p50": pct(sp, 50), "final_after_speech_ms_p95": pct(sp, 95),
                         "final_after_vad_ms_p50": pct(vd, 50), "final_after_vad_ms_p95": pct(vd, 95),
                         "rtf_per_stream_mean": round(float(np.mean(rtf)), 4),
                         "finals": sum(r["finals"] for r in res), "utterances": sum(r["utterances"] for r in res),
                         "texts": res[0]["texts"], "wer": wer(args, [r["texts"] for r in res])})
    return rows


class CT2Whisper:
    """faster-whisper's engine called directly: CTranslate2 Whisper + our log-mel, the same
    features, prompt and generate() options as ``WhisperModel.transcribe(beam_size=1,
    without_timestamps=True, language="en", condition_on_previous_text=False)`` for one
    window (utterances < 30 s), without the temperature fallback."""

    def __init__(self, path: str, device: str, compute_type: str, inter_threads: int, intra_threads: int) -> None:
        import ctranslate2
        import torch
        from tokenizers import Tokenizer

        from realtime.engines.mel import LogMel, MelConfig

        dev, _, idx = device.partition(":")
        self.ct2 = ctranslate2
        self.model = ctranslate2.models.Whisper(path, device=dev, device_index=int(idx or 0),
                                                compute_type=compute_type, inter_threads=inter_threads,
                                                intra_threads=intra_threads)
        self.tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
        self.cfg = MelConfig(n_mels=self.model.n_mels)
        self.mel = LogMel(self.cfg)
        self.torch = torch
        tid = self.tok.token_to_id
        self.eot = tid("<|endoftext|>")
        sot = [tid("<|startoftranscript|>")]
        if self.model.is_multilingual:
            sot += [tid("<|en|>"), tid("<|transcribe|>")]
        self.prompt = sot + [tid("<|notimestamps|>")]
        assert None not in self.prompt and self.eot is not None, "tokenizer.json lacks Whisper's special tokens"

    def features(self, audio: np.ndarray) -> np.ndarray:
        """Audio [N] float32 16 kHz -> log-mel [1, n_mels, 3000], as faster-whisper builds it: the
        mel of audio + one hop of zeros, its N // hop content frames, zeros (log-mel) after them."""
        torch = self.torch
        hop, frames = self.cfg.hop_length, self.cfg.n_frames
        x = torch.from_numpy(np.pad(audio.astype(np.float32), (0, hop)))[None]
        with torch.no_grad():
            mel = self.mel(x)  # [1, M, N // hop + 1]
        content = min(mel.shape[-1] - 1, frames)
        mel = torch.nn.functional.pad(mel[..., :content], (0, frames - content))
        return np.ascontiguousarray(mel.numpy())

    def transcribe(self, audio: np.ndarray) -> str:
        feats = self.ct2.StorageView.from_array(self.features(audio))
        res = self.model.generate(feats, [self.prompt], beam_size=1, patience=1, length_penalty=1,
                                  repetition_penalty=1, no_repeat_ngram_size=0, max_length=448,
                                  return_scores=True, return_no_speech_prob=True, suppress_blank=True,
                                  suppress_tokens=[-1], max_initial_timestamp_index=50)[0]
        return self.tok.decode([t for t in res.sequences_ids[0] if t < self.eot]).strip()


def pick_reference(choice: str) -> str:
    if choice != "auto":
        return choice
    try:
        import faster_whisper  # noqa: F401
    except ImportError:
        return "ctranslate2"
    return "faster-whisper"


def reference_transcriber(kind: str, path: str, device: str, compute_type: str, n: int, threads: int = 2):  # noqa: ANN201
    """A thread-safe ``audio [N] -> text`` for ``n`` concurrent callers (``threads`` per caller on a CPU)."""
    threads = 0 if device.startswith("cuda") else threads
    if kind == "ctranslate2":
        return CT2Whisper(path, device, compute_type, n, threads).transcribe
    from faster_whisper import WhisperModel

    dev, _, idx = device.partition(":")
    model = WhisperModel(path, device=dev, device_index=int(idx or 0), compute_type=compute_type,
                         num_workers=n, cpu_threads=threads)

    def transcribe(audio: np.ndarray) -> str:
        segs, _ = model.transcribe(audio, beam_size=1, without_timestamps=True, language="en",
                                   condition_on_previous_text=False, vad_filter=False)
        return " ".join(s.text.strip() for s in segs)  # the generator decodes lazily

    return transcribe


REFERENCE_LABEL = {"faster-whisper": "faster-whisper (offline per utterance)",
                   "ctranslate2": "ctranslate2 (faster-whisper's engine, offline per utterance)"}


def bench_reference(args: argparse.Namespace, utts: list[np.ndarray]) -> list[dict]:
    from realtime.engines.whisper import default_model_dir

    path = args.model or str(default_model_dir())
    dev = args.reference_device or ("cuda" + args.device[4:] if args.device.startswith("cuda") else "cpu")
    # On a CPU also CTranslate2's int8 (faster-whisper's usual CPU setting), beside float32.
    ctypes = [args.dtype] if dev.startswith("cuda") else ["float32", "int8"]
    rows = []
    for ctype, n in ((c, n) for c in ctypes for n in args.streams):
        log(f"{args.reference} {ctype} on {dev}: {n} stream(s)")
        transcribe = reference_transcriber(args.reference, path, dev, ctype, n, args.reference_threads)
        transcribe(utts[0])  # warm-up
        lat: list[list[float]] = [[] for _ in range(n)]
        busy = [0.0] * n
        texts: list[list[str]] = [[] for _ in range(n)]

        def worker(i: int) -> None:
            for u in utts:
                t = time.perf_counter()
                texts[i].append(transcribe(u))
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
        rows.append({"engine": f"{REFERENCE_LABEL[args.reference]} {ctype} on {dev}", "streams": n,
                     "final_after_speech_ms_p50": None, "final_after_speech_ms_p95": None,
                     "final_after_vad_ms_p50": pct(flat, 50), "final_after_vad_ms_p95": pct(flat, 95),
                     "rtf_per_stream_mean": round(float(np.mean(busy)) / audio_s, 4),
                     "finals": len(flat), "utterances": len(flat), "texts": texts[0], "wer": wer(args, texts)})
    return rows


def plot(out: dict, path: str) -> None:
    """Final latency after the VAD end (p50 solid, p95 dashed) against concurrent streams."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    engines = list(dict.fromkeys(r["engine"] for r in out["rows"]))
    for i, name in enumerate(engines):
        rows = sorted((r for r in out["rows"] if r["engine"] == name), key=lambda r: r["streams"])
        n = [r["streams"] for r in rows]
        color = f"C{i}"
        ax.plot(n, [r["final_after_vad_ms_p50"] for r in rows], "o-", color=color, label=name)
        ax.plot(n, [r["final_after_vad_ms_p95"] for r in rows], "--", color=color, alpha=0.6)
    ax.set_yscale("log")
    ax.set_xticks(sorted({r["streams"] for r in out["rows"]}))
    ax.set_xlabel("concurrent streams (real-time pace)")
    ax.set_ylabel("VAD end → final, ms (p50 solid, p95 dashed)")
    ax.set_title(f"streaming ASR, {out['model']} on {out['device']} ({out.get('date', '')}, {out.get('commit', '')})",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    log(f"plot: {path}")


def reference_version(kind: str) -> str:
    import ctranslate2

    if kind == "faster-whisper":
        import faster_whisper

        return f"faster-whisper {faster_whisper.__version__}, ctranslate2 {ctranslate2.__version__}"
    return f"ctranslate2 {ctranslate2.__version__}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--model", default=None, help="a Whisper CTranslate2 folder (default: embedded tiny.en)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--utterances", type=int, default=4, help="utterances per stream")
    ap.add_argument("--gap-s", type=float, default=1.0, help="silence after each utterance")
    ap.add_argument("--clips", type=Path, default=None, help="read the utterances from the WAVs in this folder")
    ap.add_argument("--save-clips", type=Path, default=None,
                    help="write the default clips as 16 kHz PCM16 WAVs 00.wav, 01.wav, ... here and exit")
    ap.add_argument("--tts-model", default=None,
                    help="a CSM folder for the server's (idle) TTS instead of the Piper voice")
    ap.add_argument("--reference", default="auto", choices=["auto", "faster-whisper", "ctranslate2"],
                    help="auto: faster-whisper if installed, else CTranslate2 directly")
    ap.add_argument("--reference-device", default=None,
                    help="where the reference runs (default: --device). CTranslate2's wheel needs CUDA 12's "
                         "cuBLAS: on a CUDA-13-only machine run it on the host's cpu")
    ap.add_argument("--reference-threads", type=int, default=2, help="CPU threads per reference stream")
    ap.add_argument("--plot", default=None, help="the PNG (default docs/asr_<device>.png; 'none': no plot)")
    ap.add_argument("--from-json", type=Path, default=None, help="only plot this results JSON")
    ap.add_argument("--no-exact", action="store_true",
                    help="on a CPU, skip the second run of ours in float32 (--asr-exact)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "asr.json"))
    args = ap.parse_args()
    if args.from_json is not None:
        import json

        plot(json.loads(args.from_json.read_text()), args.plot or str(ROOT / "docs" / "asr_cpu.png"))
        return 0
    t0 = time.time()
    if args.save_clips is not None:
        save_clips(args.save_clips, clips(args.utterances))
        return 0
    utts = load_clips(args.clips, args.utterances) if args.clips is not None else clips(args.utterances)
    args.reference = pick_reference(args.reference)
    rows = bench_ours(args, utts) + bench_reference(args, utts)
    hdr = (f"{'engine':62s} {'streams':>7s} {'speech->final p50/p95 ms':>26s} {'VAD end->final p50/p95 ms':>27s}"
           f" {'rtf/stream':>10s} {'WER':>6s}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        sp = (f"{r['final_after_speech_ms_p50']}/{r['final_after_speech_ms_p95']}"
              if r["final_after_speech_ms_p50"] else "-")
        vd = f"{r['final_after_vad_ms_p50']}/{r['final_after_vad_ms_p95']}"
        w = "-" if r["wer"] is None else f"{r['wer']:.3f}"
        print(f"{r['engine']:62s} {r['streams']:>7d} {sp:>26s} {vd:>27s} {r['rtf_per_stream_mean']:>10.4f} {w:>6s}")
    import torch

    out = {"rows": rows, "device": args.device, "dtype": args.dtype, "model": args.model or "tiny.en (embedded)",
           "utterances_per_stream": len(utts), "gap_s": args.gap_s, "torch": torch.__version__,
           "clips": str(args.clips) if args.clips else "arctic_a0009 + Piper sentences",
           "clip_seconds": [round(len(u) / RATE, 2) for u in utts],
           "server_tts": args.server_tts, "reference": args.reference,
           "reference_device": args.reference_device or args.device, "reference_threads": args.reference_threads,
           "reference_version": reference_version(args.reference),
           "machine": platform.platform(), "cpu_threads": torch.get_num_threads(),
           "date": time.strftime("%Y-%m-%d"), "commit": commit(),
           "wall_s": round(time.time() - t0, 1),
           "note": f"{args.reference} latency is the decode time of a whole utterance after it ends (no VAD "
                   "hangover, no partials); ours is measured on a live WebSocket stream"}
    write_json(args.out, out)
    log(f"wrote {args.out} in {out['wall_s']} s")
    if args.plot != "none":
        plot(out, args.plot or str(ROOT / "docs" / f"asr_{args.device.split(':')[0]}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
