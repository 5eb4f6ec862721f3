"""Piper VITS: our PyTorch engine vs onnxruntime on the same .onnx voice, whole utterances.

    python bench/vits.py [--threads 2] [--rounds 20]
    python bench/vits.py --vocoder-layouts     # + the vocoder alone, NCW vs channels-last, alternating

Same phoneme ids, default scales, one utterance at a time; ours is generate (text encoder +
durations + flow) + vocode (HiFi-GAN). Warm-up first; medians and p95 of wall time; RTF = time ÷
audio duration. Prints a table and writes bench/results/vits.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from _common import commit  # bench/ is on sys.path when a script runs

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["Hello there, how are you today?",
         "The committee met on Tuesday to discuss the new budget for the library renovation."]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "vits.json"))
    ap.add_argument("--vocoder-layouts", action="store_true",
                    help="also time the vocoder alone on one seeded latent per text, NCW and channels-last in turn")
    args = ap.parse_args()
    import onnxruntime as ort

    from realtime.engines.vits import PiperVoice, embedded_voice_paths

    torch.set_num_threads(args.threads)
    voice = PiperVoice.load()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    sess = ort.InferenceSession(str(embedded_voice_paths()[0]), opts, providers=["CPUExecutionProvider"])
    cfg = voice.config
    scales = np.array([cfg.noise_scale, cfg.length_scale, cfg.noise_w], dtype=np.float32)
    rows = []
    for text in TEXTS:
        (ph,) = voice.phonemize(text)
        ids = voice.phoneme_ids(ph)
        feeds = {"input": np.array([ids], dtype=np.int64), "input_lengths": np.array([len(ids)], dtype=np.int64),
                 "scales": scales}
        x = torch.tensor([ids])

        def ours() -> int:
            with torch.inference_mode():
                return int(voice.vocode(voice.generate(x)).shape[-1])

        def ref() -> int:
            return int(sess.run(None, feeds)[0].size)

        for name, fn in (("ours (PyTorch)", ours), ("onnxruntime", ref)):
            for _ in range(args.warmup):
                fn()
            ts, n = [], 0
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                n = fn()
                ts.append(time.perf_counter() - t0)
            audio_s = n / voice.sample_rate
            rows.append({"text": text, "engine": name, "audio_s": audio_s, "p50_ms": float(np.median(ts) * 1000),
                         "p95_ms": float(np.percentile(ts, 95) * 1000), "rtf": float(np.median(ts) / audio_s)})
    layouts = _vocoder_layouts(voice, args) if args.vocoder_layouts else []
    res = {"date": time.strftime("%Y-%m-%d"), "commit": commit(), "threads": args.threads,
           "torch": torch.__version__, "onnxruntime": ort.__version__, "cpu_count": os.cpu_count(), "rows": rows,
           "vocoder_layouts": layouts}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"{'engine':<16}{'audio s':>8}{'p50 ms':>9}{'p95 ms':>9}{'RTF':>7}  text")
    for r in rows:
        print(f"{r['engine']:<16}{r['audio_s']:>8.2f}{r['p50_ms']:>9.1f}{r['p95_ms']:>9.1f}{r['rtf']:>7.3f}  {r['text'][:40]}")
    if layouts:
        print(f"\nvocoder alone (same latent, layouts alternating, {args.rounds} rounds each)")
        print(f"{'layout':<16}{'frames':>8}{'p50 ms':>9}{'p95 ms':>9}  text")
        for r in layouts:
            print(f"{r['layout']:<16}{r['frames']:>8}{r['p50_ms']:>9.1f}{r['p95_ms']:>9.1f}  {r['text'][:40]}")
    return 0


def _vocoder_layouts(voice, args) -> list[dict]:  # noqa: ANN001
    """The HiFi-GAN decoder alone on one seeded latent per text, in NCW and channels-last, the two
    runs interleaved round by round so that a noisy machine slows both alike."""
    dec = voice.model.dec
    out = []
    for text in TEXTS:
        (ph,) = voice.phonemize(text)
        with torch.inference_mode():
            z = voice.generate(torch.tensor([voice.phoneme_ids(ph)]), generator=torch.Generator().manual_seed(0))
        times: dict[str, list[float]] = {"NCW": [], "channels-last": []}
        for r in range(args.warmup + args.rounds):
            for layout in times:
                dec.channels_last = layout == "channels-last"
                t0 = time.perf_counter()
                voice.vocode(z)
                if r >= args.warmup:
                    times[layout].append(time.perf_counter() - t0)
        dec.channels_last = None
        for layout, ts in times.items():
            out.append({"text": text, "layout": layout, "frames": int(z.shape[-1]),
                        "p50_ms": float(np.median(ts) * 1000), "p95_ms": float(np.percentile(ts, 95) * 1000)})
    return out


if __name__ == "__main__":
    sys.exit(main())
