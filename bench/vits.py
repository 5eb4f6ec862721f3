"""Piper VITS: our PyTorch engine vs onnxruntime on the same .onnx voice, whole utterances.

    python bench/vits.py [--threads 2] [--rounds 20]
    python bench/vits.py --vocoder-layouts     # + the vocoder alone, NCW vs channels-last, alternating
    python bench/vits.py --vocoder-against REV  # + the vocoder alone, REV's code vs this tree's, alternating
    python bench/vits.py --new-lengths          # + the vocoder alone on lengths this process has not seen

Same phoneme ids, default scales, one utterance at a time; ours is generate (text encoder +
durations + flow) + vocode (HiFi-GAN). Warm-up first; medians and p95 of wall time; RTF = time ÷
audio duration. Prints a table and writes bench/results/vits.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from _common import commit, write_json  # bench/ is on sys.path when a script runs

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
    ap.add_argument("--vocoder-against", metavar="REV", default=None,
                    help="also time the vocoder alone as engines/vits.py at git REV runs it (its HifiGanDecoder and "
                         "ResBlock forwards, the rest this tree's) against this tree, in turn")
    ap.add_argument("--new-lengths", action="store_true",
                    help="also time the vocoder alone on 15 latent lengths this process has not run yet, then on "
                         "the same lengths again, and on one length repeated (the cost of a shape's first run)")
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
    if args.vocoder_against:
        layouts += _vocoder_against(voice, args, args.vocoder_against)
    new_lengths = _new_lengths(voice) if args.new_lengths else {}
    res = {"date": time.strftime("%Y-%m-%d"), "commit": commit(), "threads": args.threads,
           "torch": torch.__version__, "onnxruntime": ort.__version__, "cpu_count": os.cpu_count(), "rows": rows,
           "vocoder_layouts": layouts, "new_lengths": new_lengths}
    write_json(args.out, res)
    print(f"{'engine':<16}{'audio s':>8}{'p50 ms':>9}{'p95 ms':>9}{'RTF':>7}  text")
    for r in rows:
        print(f"{r['engine']:<16}{r['audio_s']:>8.2f}{r['p50_ms']:>9.1f}{r['p95_ms']:>9.1f}{r['rtf']:>7.3f}  {r['text'][:40]}")
    if layouts:
        print(f"\nvocoder alone (same latent, variants alternating, {args.rounds} rounds each)")
        print(f"{'variant':<16}{'frames':>8}{'p50 ms':>9}{'p95 ms':>9}  {'same PCM':<9} text")
        for r in layouts:
            print(f"{r['layout']:<16}{r['frames']:>8}{r['p50_ms']:>9.1f}{r['p95_ms']:>9.1f}  {str(r['same_pcm']):<9} "
                  f"{r['text'][:40]}")
    if new_lengths:
        r = new_lengths
        print(f"\nvocoder alone, {len(r['lengths'])} lengths of {r['lengths'][0]}..{r['lengths'][-1]} frames, p50 ms: "
              f"first run {r['first_ms']:.1f}, the same lengths again {r['again_ms']:.1f}, one length repeated "
              f"{r['repeated_ms']:.1f}")
    return 0


def _new_lengths(voice) -> dict:  # noqa: ANN001
    """The vocoder alone on latents of 15 lengths past any this run has vocoded (400..414 frames;
    the texts' utterances are under 400), each run once, then the same lengths again, then one
    length repeated: what a shape's first run costs (the CPU's conv library builds its kernels
    for each new shape). Seeded random latents; medians."""
    g = torch.Generator().manual_seed(0)
    lengths = list(range(400, 415))
    zs = [torch.randn(1, voice.latent_channels, f, generator=g) for f in lengths]

    def ms(z) -> float:  # noqa: ANN001
        t0 = time.perf_counter()
        with torch.inference_mode():
            voice.vocode(z)
        return (time.perf_counter() - t0) * 1000

    first = [ms(z) for z in zs]
    again = [ms(z) for z in zs]
    repeated = [ms(zs[0]) for _ in zs]
    return {"lengths": lengths, "first_ms": float(np.median(first)), "again_ms": float(np.median(again)),
            "repeated_ms": float(np.median(repeated)), "first_all_ms": first, "again_all_ms": again}


def _vocoder_layouts(voice, args) -> list[dict]:  # noqa: ANN001
    """The vocoder in NCW and channels-last (``HifiGanDecoder.channels_last``), alternating."""
    dec = voice.model.dec
    try:
        return _vocoder_alternating(voice, args, {
            "NCW": lambda: setattr(dec, "channels_last", False),
            "channels-last": lambda: setattr(dec, "channels_last", True)})
    finally:
        dec.channels_last = None


def _vocoder_against(voice, args, rev: str) -> list[dict]:  # noqa: ANN001
    """The vocoder as engines/vits.py at git ``rev`` runs it against this tree's: rev's
    HifiGanDecoder, ResBlock1 and ResBlock2 forwards (their helpers from rev's module, the
    modules it imports from this tree) on this tree's loaded weights, alternating."""
    import subprocess
    import types

    from realtime.engines import vits

    try:
        src = subprocess.check_output(["git", "show", f"{rev}:engines/vits.py"], cwd=ROOT, text=True,
                                      stderr=subprocess.PIPE)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(f"--vocoder-against: cannot read engines/vits.py at {rev!r}: {exc}") from exc
    name = f"_vits_at_{rev}"
    old = types.ModuleType(name)
    sys.modules[name] = old  # (dataclasses look their module up while the source runs)
    exec(compile(src, f"engines/vits.py@{rev}", "exec"), old.__dict__)
    classes = ("HifiGanDecoder", "ResBlock1", "ResBlock2")
    ours = {c: getattr(vits, c).forward for c in classes}
    theirs = {c: getattr(old, c).forward for c in classes}

    def use(forwards: dict) -> None:
        for c, f in forwards.items():
            getattr(vits, c).forward = f

    try:
        return _vocoder_alternating(voice, args, {rev: lambda: use(theirs), "this tree": lambda: use(ours)})
    finally:
        use(ours)


def _vocoder_alternating(voice, args, variants: dict) -> list[dict]:  # noqa: ANN001
    """The HiFi-GAN decoder alone, each variant (name -> a function that sets it up) in turn round by
    round, so that a noisy machine slows all alike; each variant's PCM is compared with the
    first's. Cases: each text's seeded latent whole, then as the served TTS lane vocodes it under
    load: a batch of 4 and of 8 windows of 64 frames (``vocode_batch``, context included)."""
    cases = []
    for text in TEXTS:
        (ph,) = voice.phonemize(text)
        with torch.inference_mode():
            z = voice.generate(torch.tensor([voice.phoneme_ids(ph)]), generator=torch.Generator().manual_seed(0))
        cases.append((text, int(z.shape[-1]), lambda z=z: [voice.vocode(z)]))
    n = int(z.shape[-1])  # (the longer text's latent)
    for b in (4, 8):
        items = [(z, s, min(n, s + 64)) for s in [(64 * i) % max(1, n - 64) for i in range(b)]]
        cases.append((f"{b} windows of 64 frames, one batch", sum(e - s for _, s, e in items),
                      lambda items=items: voice.vocode_batch(items)))
    out = []
    for label, frames, run in cases:
        times: dict[str, list[float]] = {name: [] for name in variants}
        pcm: dict[str, list[torch.Tensor]] = {}
        for r in range(args.warmup + args.rounds):
            for name, setup in variants.items():
                setup()
                t0 = time.perf_counter()
                with torch.inference_mode():
                    y = run()
                if r >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
                pcm.setdefault(name, y)
        first = next(iter(pcm.values()))
        for name, ts in times.items():
            out.append({"text": label, "layout": name, "frames": frames,
                        "p50_ms": float(np.median(ts) * 1000), "p95_ms": float(np.percentile(ts, 95) * 1000),
                        "same_pcm": all(torch.equal(a, b) for a, b in zip(pcm[name], first, strict=True)),
                        "max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(pcm[name], first, strict=True))})
    return out


if __name__ == "__main__":
    sys.exit(main())
