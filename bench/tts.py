"""TTS benchmark against a real server on loopback: TTFA, RTF, concurrency sweep with underruns.

    python bench/tts.py                                  # embedded Piper voice on the CPU
    python bench/tts.py --concurrency 1 8 --rounds 10    # smaller run
    python bench/tts.py --tts-model /path/csm --generator-device cuda:0 --codec-device cuda:0
    python bench/tts.py ... --client-procs 8                # sweep clients in 8 other processes

Starts uvicorn with the model in this process, then drives it with real WebSocket clients.
TTFA is measured on the client: text sent → first audio chunk received. Prints a table, writes
JSON (bench/results/) and a PNG plot (docs/). Warm-up rounds are not counted; medians and p95.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from _common import ARCTIC_CLIP, ARCTIC_TEXT, commit, log, pct, write_json  # bench/ is on sys.path when a script runs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "server"))

PROMPTS = {
    "hello": "Hello.",
    "short": "Hello there, how are you today?",
    "sentences": ("The committee met on Tuesday to discuss the new budget. After a long debate, they "
                  "agreed to fund the library renovation. Work will begin early next spring."),
    # "short" after a 5 s voice reference (CSM): the speech clip of tests/assets + 1.9 s of silence
    "reference": "Hello there, how are you today?",
}
REFERENCE_S = 5.0
REFERENCE_CLIP, REFERENCE_TEXT = ARCTIC_CLIP, ARCTIC_TEXT


def reference_wav() -> dict:
    """The voice reference of the "reference" prompt: {audio: WAV bytes of REFERENCE_S seconds, text}."""
    import io

    import soundfile as sf

    audio, rate = sf.read(REFERENCE_CLIP, dtype="float32")
    audio = np.concatenate([audio, np.zeros(int(REFERENCE_S * rate) - len(audio), dtype=np.float32)])
    buf = io.BytesIO()
    sf.write(buf, audio, rate, format="WAV")
    return {"audio": buf.getvalue(), "text": REFERENCE_TEXT}


async def one_stream(url: str, text: str, rate: int, start_delay: float = 0.0, reference: dict | None = None) -> dict:
    from realtime.clients.tts import TTSStream

    await asyncio.sleep(start_delay)
    t_open = time.monotonic()
    async with TTSStream(url, format="pcm_s16le", sample_rate=rate, reference=reference) as s:
        await s.send_text(text)
        await s.stop()
        n = 0
        async for c in s:
            n += len(c.audio) // 2
    wall = time.monotonic() - t_open
    gaps = s.gaps.stats()
    return {"ttfa_ms": s.ttfa_ms, "audio_s": n / rate, "wall_s": wall, "server": s.stats,
            "client_underruns": gaps["underruns"], "client_max_underrun_ms": gaps["max_underrun_ms"],
            "client_underruns_over_100ms": gaps["underruns_over_100ms"]}


def _client_proc(url: str, text: str, rate: int, delays: list[float], start_at: float) -> list[dict]:
    """One client process's share of a sweep level: its streams, at their open-loop offsets from
    the shared wall-clock start ``start_at`` (so the processes' arrivals interleave as in one)."""
    async def run() -> list[dict]:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        return await asyncio.gather(*(one_stream(url, text, rate, d) for d in delays))

    return asyncio.run(run())


async def sweep_level(url: str, text: str, rate: int, n: int, arrival_s: float, pool=None, procs: int = 1) -> dict:  # noqa: ANN001
    # open-loop arrivals: stream i starts at i * arrival_s / n, whether or not earlier ones finished
    delays = [i * arrival_s / max(n, 1) for i in range(n)]
    t0 = time.monotonic()
    if pool is None:
        res = await asyncio.gather(*(one_stream(url, text, rate, d) for d in delays))
    else:  # the clients in `procs` other processes: the server's process then runs only the server
        start_at = time.time() + 0.2
        shares = [delays[k::procs] for k in range(procs)]
        parts = await asyncio.to_thread(pool.starmap, _client_proc,
                                        [(url, text, rate, sh, start_at) for sh in shares if sh])
        res = [r for part in parts for r in part]
        t0 += 0.2
    wall = time.monotonic() - t0
    ttfa = [r["ttfa_ms"] for r in res if r["ttfa_ms"] is not None]
    audio = sum(r["audio_s"] for r in res)
    return {"streams": n, "ttfa_p50_ms": pct(ttfa, 50), "ttfa_p95_ms": pct(ttfa, 95),
            "rtf_p50": pct([r["server"]["rtf"] for r in res], 50),
            "underruns_total": sum(r["client_underruns"] for r in res),
            "streams_zero_underrun": sum(r["client_underruns"] == 0 for r in res),
            "streams_gap_over_100ms": sum(r["client_underruns_over_100ms"] > 0 for r in res),
            "max_underrun_ms": max(r["client_max_underrun_ms"] for r in res),
            "aggregate_audio_s_per_s": audio / wall, "wall_s": wall}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tts-model", default=None)
    ap.add_argument("--generator-device", default="cpu")
    ap.add_argument("--codec-device", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--slots", type=int, default=64, help="CSM KV-cache slots (max concurrent streams)")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--arrival-s", type=float, default=1.0, help="open-loop arrival window per sweep level")
    ap.add_argument("--rate", type=int, default=24000)
    ap.add_argument("--prompts", nargs="+", default=["hello", "sentences"], choices=list(PROMPTS))
    ap.add_argument("--sweep-prompt", default="sentences", choices=list(PROMPTS))
    ap.add_argument("--client-procs", type=int, default=1,
                    help="run the sweep's WebSocket clients in this many other processes (1: in the server's process)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "tts.json"))
    ap.add_argument("--plot", default=str(ROOT / "docs" / "tts_bench.png"))
    args = ap.parse_args()

    from liveserver import serve

    from realtime.config import ServerConfig
    from realtime.server import create_app, load_tts

    cfg = ServerConfig(generator_device=args.generator_device, codec_device=args.codec_device or args.generator_device,
                       dtype=args.dtype, tts_model=args.tts_model, max_streams=1024, tts_slots=args.slots,
                       cuda_graphs=not args.eager)
    log(f"loading model ({args.tts_model or 'embedded Piper voice'}) on {cfg.generator_device}/{cfg.codec_device}")
    backend = load_tts(cfg)
    if hasattr(backend, "warmup"):
        log("warm-up / CUDA-graph capture")
        backend.warmup()
    app = create_app(cfg, tts=backend, services=[])
    results: dict = {"date": time.strftime("%Y-%m-%d"), "commit": commit(), "machine": platform.machine(),
                     "cpu_count": os.cpu_count(), "model": backend.name, "devices": [cfg.generator_device, cfg.codec_device]}
    try:
        import torch

        results["torch"] = torch.__version__
        results["threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            results["gpu"] = torch.cuda.get_device_name(0)
    except Exception:
        pass
    with serve(app) as live:
        url = f"{live.ws}/v1/tts"

        async def run() -> None:
            log(f"warm-up: {args.warmup} rounds")
            refs = {name: (reference_wav() if name == "reference" else None) for name in args.prompts}
            for i in range(args.warmup):
                name = args.prompts[i % len(args.prompts)]
                await one_stream(url, PROMPTS[name], args.rate, reference=refs[name])
            single = {}
            for name in args.prompts:
                text = PROMPTS[name]
                log(f"single stream, prompt '{name}': {args.rounds} rounds")
                rs = [await one_stream(url, text, args.rate, reference=refs[name]) for _ in range(args.rounds)]
                ttfa = [r["ttfa_ms"] for r in rs]
                single[name] = {"ttfa_p50_ms": pct(ttfa, 50), "ttfa_p95_ms": pct(ttfa, 95),
                                "rtf_p50": pct([r["server"]["rtf"] for r in rs], 50),
                                "audio_s": rs[0]["audio_s"],
                                "wall_rtf_p50": pct([r["wall_s"] / r["audio_s"] for r in rs], 50),
                                "underruns": sum(r["client_underruns"] for r in rs), "ttfa_all_ms": ttfa}
            results["single"] = single
            sweep = []
            pool = None
            if args.client_procs > 1:
                import multiprocessing as mp

                pool = mp.get_context("spawn").Pool(args.client_procs)
                pool.starmap(_client_proc, [(url, PROMPTS["hello"], args.rate, [0.0], 0.0)] * args.client_procs)
            try:
                for n in args.concurrency:
                    log(f"concurrency {n}: open-loop arrivals over {args.arrival_s}s"
                        + (f", clients in {args.client_procs} processes" if pool else ""))
                    live.state.metrics.gc.start_window()  # the server's GC pauses in this level (they hold the GIL)
                    lv = await sweep_level(url, PROMPTS[args.sweep_prompt], args.rate, n, args.arrival_s,
                                           pool, args.client_procs)
                    sweep.append({**lv, **live.state.metrics.gc.window()})
            finally:
                if pool is not None:
                    pool.close()
                    pool.join()
            results["sweep_prompt"] = args.sweep_prompt
            results["client_procs"] = args.client_procs
            results["sweep"] = sweep

        asyncio.run(run())
    write_json(args.out, results)
    print()
    print(f"model {results['model']} on {results['devices']}  commit {results['commit']}  {results['date']}")
    print(f"{'prompt':<12}{'TTFA p50 ms':>14}{'TTFA p95 ms':>14}{'RTF p50':>10}{'wall RTF':>10}{'underruns':>11}")
    for name, r in results["single"].items():
        print(f"{name:<12}{r['ttfa_p50_ms']:>14.1f}{r['ttfa_p95_ms']:>14.1f}{r['rtf_p50']:>10.3f}"
              f"{r['wall_rtf_p50']:>10.3f}{r['underruns']:>11d}")
    print(f"\n{'streams':<9}{'TTFA p50':>10}{'TTFA p95':>10}{'RTF p50':>9}{'zero-gap':>10}{'gap>100ms':>11}"
          f"{'max gap ms':>12}{'audio s/s':>11}{'GCs':>6}{'max GC ms':>11}")
    for r in results["sweep"]:
        print(f"{r['streams']:<9}{r['ttfa_p50_ms']:>10.1f}{r['ttfa_p95_ms']:>10.1f}{r['rtf_p50']:>9.3f}"
              f"{r['streams_zero_underrun']:>10d}{r['streams_gap_over_100ms']:>11d}{r['max_underrun_ms']:>12.1f}"
              f"{r['aggregate_audio_s_per_s']:>11.2f}{r['gc_collections']:>6d}{r['gc_max_pause_ms']:>11.1f}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        for name, r in results["single"].items():
            a.hist(r["ttfa_all_ms"], bins=15, alpha=0.6, label=name)
        a.set_xlabel("TTFA (ms), one stream"); a.set_ylabel("rounds"); a.legend()
        xs = [r["streams"] for r in results["sweep"]]
        b.plot(xs, [r["ttfa_p50_ms"] for r in results["sweep"]], "o-", label="TTFA p50")
        b.plot(xs, [r["ttfa_p95_ms"] for r in results["sweep"]], "s--", label="TTFA p95")
        b.set_xlabel("concurrent streams"); b.set_ylabel("TTFA, ms"); b.set_xscale("log", base=2)
        g = b.twinx()
        g.plot(xs, [r["streams_gap_over_100ms"] for r in results["sweep"]], "^:", color="tab:red",
               label="streams with a gap > 100 ms")
        g.set_ylabel("streams with a gap > 100 ms")
        g.set_ylim(bottom=0, top=max(1, max(xs)))
        lines = b.get_legend_handles_labels()[0] + g.get_legend_handles_labels()[0]
        b.legend(lines, [ln.get_label() for ln in lines], loc="upper left")
        fig.suptitle(f"{results['model']} on {'/'.join(results['devices'])} ({results['date']}, {results['commit']})")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        log(f"wrote {args.out} and {args.plot}")
    except ImportError:
        log(f"wrote {args.out} (matplotlib missing: no plot)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
