"""POST /v1/audio/speech in each response format against a real server on loopback: the delay to the
first audio bytes and the whole reply's time, per format, next to pcm (no encoder) in the same run.

    python bench/speech_formats.py [--rounds 10] [--warmup 3] [--out JSON] [--plot PNG|none]

The server runs the embedded Piper voice (or --tts-model) in this process. Each round asks for every
format once, in an order that rotates by round, so that the formats share any drift of the machine.
Every reply is decoded again and its audio length checked against pcm's. "First audio" is the
arrival of the first body part that holds audio: wav and opus send their header first, as a part
of its own (44 bytes; Ogg's two header pages), so for them it is the second part.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

from _common import ROOT, commit, log, pct, write_json

sys.path.insert(0, str(ROOT / "tests" / "server"))

FORMATS = ("pcm", "wav", "mp3", "opus", "flac", "mulaw")
HEADER_PARTS = {"wav": 1, "opus": 1}  # body parts before the first audio
TEXT = ("The quick brown fox jumps over the lazy dog. Then it runs into the forest, "
        "where the trees are tall and the air is cool.")


def _seconds(fmt: str, body: bytes, native_rate: int) -> float:
    """The reply's audio length, decoded again."""
    import soundfile as sf

    if fmt == "pcm":
        return len(body) / 2 / 24000
    if fmt == "mulaw":
        return len(body) / 8000
    if fmt == "wav":
        return (len(body) - 44) / 2 / native_rate
    with sf.SoundFile(io.BytesIO(body)) as f:
        return len(f.read(dtype="int16")) / f.samplerate


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tts-model", default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "speech_formats_cpu.json"))
    ap.add_argument("--plot", default=str(ROOT / "docs" / "speech_formats_cpu.png"), help="a PNG path, or none")
    args = ap.parse_args()

    import httpx
    from liveserver import serve

    from realtime.config import ServerConfig
    from realtime.server import create_app, load_tts

    log("loading the voice")
    cfg = ServerConfig(tts_model=args.tts_model)
    tts = load_tts(cfg)
    app = create_app(cfg, tts=tts, services=[])
    rows: dict[str, list[dict[str, float]]] = {f: [] for f in FORMATS}
    with serve(app) as live, httpx.Client(base_url=live.http, timeout=120) as client:
        for rnd in range(args.warmup + args.rounds):
            order = FORMATS[rnd % len(FORMATS):] + FORMATS[:rnd % len(FORMATS)]
            for fmt in order:
                body = {"model": "tts-1", "input": TEXT, "voice": "alloy", "response_format": fmt, "seed": rnd}
                t0 = time.perf_counter()
                first, data, parts = None, b"", 0
                with client.stream("POST", "/v1/audio/speech", json=body) as r:
                    assert r.status_code == 200, r.read()
                    for part in r.iter_raw():  # (as the server sent them: no re-chunking)
                        if not part:
                            continue
                        if first is None and parts == HEADER_PARTS.get(fmt, 0):
                            first = time.perf_counter() - t0
                        data, parts = data + part, parts + 1
                total = time.perf_counter() - t0
                if rnd >= args.warmup:
                    rows[fmt].append({"first_audio_ms": 1000 * (first or total), "total_ms": 1000 * total,
                                      "bytes": len(data), "audio_s": _seconds(fmt, data, tts.native_rate)})
            if rnd == args.warmup - 1:
                log(f"warmed up ({args.warmup} rounds); timing {args.rounds} rounds")
    table = []
    pcm_s = pct([r["audio_s"] for r in rows["pcm"]], 50) or 1.0
    print(f"\n{'format':8} {'first audio p50':>16} {'p95':>8} {'whole p50':>10} {'kbit/s':>8} {'audio vs pcm':>13}")
    for fmt in FORMATS:
        rs = rows[fmt]
        audio = pct([r["audio_s"] for r in rs], 50) or 0.0
        row = {"format": fmt, "first_audio_ms_p50": pct([r["first_audio_ms"] for r in rs], 50),
               "first_audio_ms_p95": pct([r["first_audio_ms"] for r in rs], 95),
               "total_ms_p50": pct([r["total_ms"] for r in rs], 50),
               "kbit_per_s": 8 * (pct([r["bytes"] for r in rs], 50) or 0) / max(audio, 1e-9) / 1000,
               "audio_s_p50": audio, "audio_vs_pcm": audio / pcm_s}
        table.append(row)
        print(f"{fmt:8} {row['first_audio_ms_p50']:14.1f} ms {row['first_audio_ms_p95']:6.1f} ms "
              f"{row['total_ms_p50']:8.1f} ms {row['kbit_per_s']:8.1f} {row['audio_vs_pcm']:12.3f}")
    res = {"commit": commit(), "date": time.strftime("%Y-%m-%d"), "text": TEXT, "rounds": args.rounds,
           "warmup": args.warmup, "voice": tts.describe()["id"], "native_rate": tts.native_rate,
           "rows": table, "raw": rows}
    write_json(args.out, res)
    log(f"wrote {args.out}")
    if args.plot != "none":
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.6))
        xs = range(len(table))
        ax.bar([x - 0.2 for x in xs], [r["first_audio_ms_p50"] for r in table], 0.4, label="first audio bytes (p50)")
        ax.bar([x + 0.2 for x in xs], [r["total_ms_p50"] for r in table], 0.4, label="whole reply (p50)")
        ax.set_xticks(list(xs), [f"{r['format']}\n{r['kbit_per_s']:.0f} kbit/s" for r in table])
        ax.set_ylabel("ms")
        ax.set_title(f"/v1/audio/speech by format, {pcm_s:.1f} s of speech "
                     f"({res['voice']}, CPU, {res['commit']})", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
        log(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
