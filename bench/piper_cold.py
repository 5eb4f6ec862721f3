"""The embedded Piper voice's first stream after a server start: the first part of a long
sentence's split flow (``flow head``), then each of the vocoder lane's first windows (8, 16, 32, 64
frames), timed in fresh processes after the backend's warm-up
(``PiperBackend.warmup``, as ``realtime serve`` runs it) and, alternating, after a warm-up of one
utterance only (the warm-up before 2026-12-07). On the CPU the conv library builds its kernels for
each new shape on first use, so a cold shape costs the first stream.

    python bench/piper_cold.py [--runs 3] [--threads 2]

Prints a table (medians over the runs) and writes bench/results/piper_cold.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import commit, write_json  # bench/ is on sys.path when a script runs

ROOT = Path(__file__).resolve().parents[1]
WINDOWS = (8, 16, 32, 64)
TEXT = "Hello there, how are you today?"
LONG = "The committee met on Tuesday to discuss the new budget."  # ~250 frames: its flow is split


def child(mode: str, threads: int) -> dict:
    """One fresh process: load, warm up (``mode``), then the first stream's windows, ms."""
    import torch

    from realtime.protocol.tts import StartParams
    from realtime.tts_piper import HEAD_FRAMES, MAX_WINDOW, PiperBackend

    torch.set_num_threads(threads)
    b = PiperBackend()
    params = StartParams(voice=None, format="pcm_f32le", sample_rate=b.native_rate, chunk_ms=None)
    t0 = time.perf_counter()
    if mode == "warmup":
        b.warmup()
    else:  # one utterance through both stages, nothing else
        for u in b.synthesize_latents("Warming up.", params, None):
            b.vocode_batch([(u.z, 0, min(u.frames, MAX_WINDOW))])
    out = {"warmup_ms": (time.perf_counter() - t0) * 1000}
    v = b.voice
    z_p = v.prior(torch.tensor([v.phoneme_ids(v.phonemize(LONG)[0])]), generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    v.flow(z_p, 0, HEAD_FRAMES + 2 * b.vocoder.vocoder_context)
    out["flow head"] = (time.perf_counter() - t0) * 1000
    (u,) = b.synthesize_latents(TEXT, params, torch.Generator().manual_seed(1))
    s = 0
    for n in WINDOWS:
        t0 = time.perf_counter()
        b.vocode_batch([(u.z, s, s + n)])
        out[str(n)] = (time.perf_counter() - t0) * 1000
        s += n
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="fresh processes a warm-up (alternating)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "piper_cold.json"))
    ap.add_argument("--child", choices=["warmup", "utterance"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.threads)))
        return 0
    runs: dict[str, list[dict]] = {"utterance": [], "warmup": []}
    for r in range(args.runs):
        for mode in runs:
            print(f"[{time.strftime('%H:%M:%S')}] run {r + 1}/{args.runs}: warm-up '{mode}' in a fresh process",
                  flush=True)
            res = subprocess.run([sys.executable, __file__, "--child", mode, "--threads", str(args.threads)],
                                 capture_output=True, text=True, check=True)
            runs[mode].append(json.loads(res.stdout.strip().splitlines()[-1]))
    med = {mode: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for mode, rs in runs.items()}
    names = {"utterance": "one utterance", "warmup": "PiperBackend.warmup"}
    print(f"\n{'warm-up':<22}{'warm-up ms':>11}{'flow head ms':>14}" + "".join(f"{f'{n}-frame ms':>14}" for n in WINDOWS))
    for mode, m in med.items():
        print(f"{names[mode]:<22}{m['warmup_ms']:>11.1f}{m['flow head']:>14.1f}"
              + "".join(f"{m[str(n)]:>14.1f}" for n in WINDOWS))
    res = {"date": time.strftime("%Y-%m-%d"), "commit": commit(), "threads": args.threads, "text": TEXT,
           "windows": list(WINDOWS), "median_ms": med, "runs": runs}
    write_json(args.out, res)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
