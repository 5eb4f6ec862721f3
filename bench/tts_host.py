"""Host cost of the served CSM path: server CPU per stream-frame, without the model math.

    python bench/tts_host.py                                  # 64 and 128 streams, null model
    python bench/tts_host.py --model tiny --streams 64        # the tiny random CSM's own math too
    python bench/tts_host.py --profile /tmp/host.prof         # cProfile of the server's threads

A random CSM at tiny widths but the real frame size (Mimi ratios 8·6·5·4 → 1920 samples = 80 ms at
24 kHz a frame) is written with transformers' ``save_pretrained`` and served by a real uvicorn in
this process; the WebSocket clients run in ``--client-procs`` other processes, so this process's CPU
time is the server's. ``--model null`` (default) replaces the two batched model calls (CSM frame
step, Mimi decode step, and the per-segment prefill) by stubs that return random codes / a fixed
PCM block, so what is left is the host work: scheduling, the lanes' bookkeeping, prompt building,
PCM conversion and packing, framing, the WebSocket send, gap tracking, metrics. ``--model tiny``
runs the real (tiny) model and subtracts the CPU time spent inside the model calls instead.

Reported per level: server CPU µs per stream-frame (process CPU ÷ frames delivered), split by
thread (event loop, generator worker, codec worker), TTFA and client-side gaps.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from _common import log  # bench/ is on sys.path when a script runs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "server"))

PROMPTS = {
    "short": "Hello there, how are you today?",
    "sentences": ("The committee met on Tuesday to discuss the new budget. After a long debate, they "
                  "agreed to fund the library renovation. Work will begin early next spring."),
}


class ModelClock:
    """CPU seconds spent inside the model calls, per thread (what ``--model tiny`` subtracts)."""

    def __init__(self) -> None:
        self.cpu_s = 0.0
        self.by_thread: dict[str, float] = {}
        self.lock = threading.Lock()

    def wrap(self, fn):  # noqa: ANN001, ANN201
        def timed(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            t0 = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.thread_time() - t0
                name = threading.current_thread().name
                with self.lock:
                    self.cpu_s += dt
                    self.by_thread[name] = self.by_thread.get(name, 0.0) + dt
        return timed


def null_model(backend) -> None:  # noqa: ANN001
    """Replace the frame step and the Mimi step by stubs of the same shapes (no model math)."""
    import torch

    k = backend.csm.num_codebooks
    rng = torch.Generator().manual_seed(0)
    bank = torch.randint(1, backend.codebook_size, (4096, k), generator=rng)  # never the all-0 EOS frame
    pcm = (torch.rand(backend.n_slots + 1, 1, backend.mimi.frame_size, generator=rng) - 0.5) * 0.5
    pos = [0]

    def frame_step(slots, temp, top_k, seeds):  # noqa: ANN001, ANN202
        b = len(slots)
        i = pos[0] = (pos[0] + b) % (len(bank) - b)
        for s in slots.tolist():  # the real step advances each slot's host-side length
            backend.state.lengths[s] += 1
        return bank[i:i + b].clone()

    def decode_slots(slots, codes):  # noqa: ANN001, ANN202
        return pcm[: len(slots)]

    def prefill(state, slot, prompt):  # noqa: ANN001, ANN202
        state.lengths[slot] = len(prompt)

    backend.frame_step = frame_step
    backend.decode_slots = decode_slots
    backend.csm.prefill = prefill


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads, by name (unnamed: by native id)."""
    import psutil

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for t in psutil.Process().threads():
        name = names.get(t.id, "other")
        if name.startswith("worker-"):
            pass
        elif name == "uvicorn":
            name = "event loop"
        else:
            name = "other"
        out[name] = out.get(name, 0.0) + t.user_time + t.system_time
    return out


async def one_stream(url: str, text: str, fmt: str, rate: int, delay: float) -> dict:
    from realtime.clients.tts import TTSStream

    await asyncio.sleep(delay)
    async with TTSStream(url, format=fmt, sample_rate=rate, open_timeout=120) as s:
        await s.send_text(text)
        await s.stop()
        n = 0
        async for _ in s:
            n += 1
    g = s.gaps.stats()
    st = s.stats or {}
    return {"ttfa_ms": s.ttfa_ms, "chunks": n, "frames": st.get("frames", 0), "server_ttfa_ms": st.get("ttfa_ms"),
            "server_gaps_over_100ms": st.get("underruns_over_100ms", 0),
            "gaps": g["underruns"], "gaps_over_100ms": g["underruns_over_100ms"], "max_gap_ms": g["max_underrun_ms"]}


def client_proc(url: str, text: str, fmt: str, rate: int, delays: list[float], start_at: float,
                deflate: bool = False) -> list[dict]:
    if deflate:  # offer permessage-deflate, as the client did before (and as browsers do)
        import websockets

        connect = websockets.connect

        def offering(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            return connect(*a, **{**kw, "compression": "deflate"})

        websockets.connect = offering  # this client process only

    async def run() -> list[dict]:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        return await asyncio.gather(*(one_stream(url, text, fmt, rate, d) for d in delays))

    try:
        return asyncio.run(run())
    except Exception as exc:  # the pool cannot unpickle every exception type: send its text
        raise RuntimeError(f"client failed: {exc!r}") from None


def serve_profiled(app, profiles: dict | None, deflate: bool = False):  # noqa: ANN001, ANN201
    """liveserver.serve, with the server loop (optionally) under cProfile."""
    from liveserver import serve

    def run(server_run) -> None:  # noqa: ANN001
        if profiles is None:
            server_run()
            return
        prof = profiles["event loop"] = cProfile.Profile(time.thread_time)
        prof.enable()
        try:
            server_run()
        finally:
            prof.disable()

    return serve(app, deflate=deflate, run=run)


def profile_workers(profiles: dict) -> None:
    from realtime.scheduler import Worker

    loop = Worker._loop

    def _loop(self) -> None:  # noqa: ANN001
        prof = profiles.setdefault(f"worker-{self.name}", cProfile.Profile(time.thread_time))
        prof.enable()
        try:
            loop(self)
        finally:
            prof.disable()

    Worker._loop = _loop


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["null", "tiny"], default="null")
    ap.add_argument("--tts-model", default=None, help="a CSM folder instead of the generated tiny one")
    ap.add_argument("--streams", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--prompt", default="sentences", choices=list(PROMPTS))
    ap.add_argument("--format", default="pcm_s16le")
    ap.add_argument("--rate", type=int, default=24000)
    ap.add_argument("--arrival-s", type=float, default=1.0)
    ap.add_argument("--ttfa-rounds", type=int, default=20, help="single-stream TTFA rounds before the sweep")
    ap.add_argument("--deflate", action="store_true",
                    help="server and clients offer permessage-deflate (what both did before it was turned off)")
    ap.add_argument("--profile", default=None, help="write cProfile stats of the server threads here (prefix)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None, help="JSON results")
    args = ap.parse_args()

    import multiprocessing as mp

    import torch

    from realtime.config import ServerConfig
    from realtime.server import create_app
    from realtime.tts_csm import CSMBackend

    torch.set_num_threads(1)
    tmp = tempfile.TemporaryDirectory()
    folder = args.tts_model
    if folder is None:
        folder = tmp.name
        from tiny_csm import tiny_csm

        # tiny widths, the real Mimi frame: 8·6·5·4 = 1920 samples = 80 ms at 24 kHz
        tiny_csm(Path(folder), num_codebooks=8, vocab=67, codebook_size=64, num_filters=2,
                 upsampling_ratios=(8, 6, 5, 4), max_positions=1024)
    slots = max(args.streams)
    backend = CSMBackend(folder, n_slots=slots, max_seq_len=1024)
    backend.warmup()
    clock = ModelClock()
    if args.model == "null":
        null_model(backend)
    else:
        backend.csm.prefill = clock.wrap(backend.csm.prefill)  # per segment, model math: not host cost
        backend.frame_step = clock.wrap(backend.frame_step)
        backend.decode_slots = clock.wrap(backend.decode_slots)
    profiles: dict | None = {} if args.profile else None
    if profiles is not None:
        profile_workers(profiles)
    cfg = ServerConfig(max_streams=1024, tts_slots=slots)
    app = create_app(cfg, tts=backend, services=[])
    text = PROMPTS[args.prompt]
    results: dict = {"date": time.strftime("%Y-%m-%d"), "model": args.model, "format": args.format,
                     "rate": args.rate, "prompt": args.prompt, "cpu_count": os.cpu_count(), "levels": []}
    with serve_profiled(app, profiles, args.deflate) as live:
        url = f"{live.ws}/v1/tts"
        pool = mp.get_context("spawn").Pool(args.client_procs)
        try:
            pool.starmap(client_proc, [(url, "Hi.", args.format, args.rate, [0.0], 0.0)] * args.client_procs)
            if args.ttfa_rounds:  # one stream at a time: the host's share of time to first audio
                rs = [pool.apply(client_proc, (url, PROMPTS["short"], args.format, args.rate, [0.0], 0.0))[0]
                      for _ in range(args.ttfa_rounds)]
                c_ttfa = [r["ttfa_ms"] for r in rs]
                s_ttfa = [r["server_ttfa_ms"] for r in rs]
                results["single"] = {"rounds": args.ttfa_rounds,
                                     "ttfa_p50_ms": float(np.percentile(c_ttfa, 50)),
                                     "ttfa_p95_ms": float(np.percentile(c_ttfa, 95)),
                                     "server_ttfa_p50_ms": float(np.percentile(s_ttfa, 50)),
                                     "server_ttfa_p95_ms": float(np.percentile(s_ttfa, 95))}
                log(f"one stream: {json.dumps(results['single'])}")
            for n in args.streams:
                delays = [i * args.arrival_s / n for i in range(n)]
                shares = [delays[k::args.client_procs] for k in range(args.client_procs)]
                start_at = time.time() + 0.3
                time.sleep(0.1)
                live.state.metrics.gc.start_window()  # the server's GC pauses in this level (they hold the GIL)
                c0, t0, m0, w0 = time.process_time(), thread_cpu(), clock.cpu_s, time.monotonic()
                mt0 = dict(clock.by_thread)
                parts = pool.starmap(client_proc, [(url, text, args.format, args.rate, sh, start_at, args.deflate)
                                                   for sh in shares if sh])
                c1, t1, m1, w1 = time.process_time(), thread_cpu(), clock.cpu_s, time.monotonic()
                res = [r for p in parts for r in p]
                frames = sum(r["frames"] for r in res)
                host_s = (c1 - c0) - (m1 - m0)
                for k, v in clock.by_thread.items():  # host CPU by thread: less the model calls made there
                    k = "event loop" if k == "uvicorn" else k
                    t1[k] = t1.get(k, 0.0) - (v - mt0.get(k if k != "event loop" else "uvicorn", 0.0))
                per_thread = {k: round((t1.get(k, 0.0) - t0.get(k, 0.0)) / frames * 1e6, 1) for k in t1}
                ttfa = [r["ttfa_ms"] for r in res if r["ttfa_ms"] is not None]
                lv = {"streams": n, "frames": frames, "wall_s": round(w1 - w0, 2),
                      "server_cpu_s": round(c1 - c0, 3), "model_cpu_s": round(m1 - m0, 3),
                      "host_us_per_stream_frame": round(host_s / frames * 1e6, 1),
                      "us_per_stream_frame_by_thread": per_thread,
                      "server_cpu_share": round((c1 - c0) / (w1 - w0), 3),
                      "ttfa_p50_ms": float(np.percentile(ttfa, 50)), "ttfa_p95_ms": float(np.percentile(ttfa, 95)),
                      "streams_with_gap_over_100ms": sum(r["gaps_over_100ms"] > 0 for r in res),
                      "server_ttfa_p50_ms": float(np.percentile([r["server_ttfa_ms"] for r in res], 50)),
                      "server_ttfa_p95_ms": float(np.percentile([r["server_ttfa_ms"] for r in res], 95)),
                      "server_streams_with_gap_over_100ms": sum(r["server_gaps_over_100ms"] > 0 for r in res),
                      "max_gap_ms": max(r["max_gap_ms"] for r in res), **live.state.metrics.gc.window()}
                results["levels"].append(lv)
                log(json.dumps(lv))
        finally:
            pool.close()
            pool.join()
    print(f"\nmodel={args.model} format={args.format} rate={args.rate} prompt={args.prompt} "
          f"clients in {args.client_procs} processes")
    if "single" in results:
        r = results["single"]
        print(f"one stream, {r['rounds']} rounds: TTFA p50 {r['ttfa_p50_ms']:.1f} ms (server {r['server_ttfa_p50_ms']:.1f}),"
              f" p95 {r['ttfa_p95_ms']:.1f} ms (server {r['server_ttfa_p95_ms']:.1f})")
    print("TTFA and gaps: client-side (received) / server-side (sent)")
    print(f"{'streams':>8}{'frames':>8}{'host µs/stream-frame':>22}{'server CPU/wall':>17}"
          f"{'TTFA p50':>14}{'TTFA p95':>14}{'gap>100ms':>11}  host µs by thread")
    for lv in results["levels"]:
        print(f"{lv['streams']:>8}{lv['frames']:>8}{lv['host_us_per_stream_frame']:>22.1f}"
              f"{lv['server_cpu_share']:>17.2f}{lv['ttfa_p50_ms']:>7.0f}/{lv['server_ttfa_p50_ms']:<6.0f}"
              f"{lv['ttfa_p95_ms']:>7.0f}/{lv['server_ttfa_p95_ms']:<6.0f}"
              f"{lv['streams_with_gap_over_100ms']:>6}/{lv['server_streams_with_gap_over_100ms']:<4}"
              f"  {lv['us_per_stream_frame_by_thread']}  GCs {lv['gc_collections']} (max {lv['gc_max_pause_ms']:.2f} ms)")
    if profiles:
        frames = sum(lv["frames"] for lv in results["levels"])
        for name, prof in profiles.items():
            path = f"{args.profile}.{name.replace(' ', '_')}"
            prof.dump_stats(path)
            st = pstats.Stats(prof)
            print(f"\n=== {name}: top {args.top} by own time (µs per stream-frame over {frames} frames) ===")
            rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[: args.top]  # type: ignore[attr-defined]
            for (file, line, fn), (cc, nc, tt, ct, _) in rows:
                print(f"{tt / frames * 1e6:8.2f} own {ct / frames * 1e6:8.2f} cum {nc:>9}  "
                      f"{Path(file).name}:{line} {fn}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
