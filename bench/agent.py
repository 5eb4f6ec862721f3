"""The voice agent's turn latency against a real server on loopback, with the embedded models.

    python bench/agent.py                       # CPU: Silero VAD + Whisper tiny.en, SmolLM2, Piper
    python bench/agent.py --rounds 3 --max-tokens 32

Starts the server as ``realtime serve`` builds it (every default service, warm-up on) in this
process, then says each prompt over ``/v1/realtime`` at real-time pace with the Python client
(``converse_wav``: the recording, then silence like an open microphone until the reply is done).
The prompts: the CMU ARCTIC clip in tests/assets (real speech) and two questions in the embedded
voice. Per turn the server reports (``response.realtime_metrics``) the turn latency (end of the
user's speech → first agent audio sent, the VAD's silence wait included) and its parts: end of
speech → ASR final, the LLM's time to first token, and first clause → first audio. Prints a table
(medians and p95 after warm-up rounds), writes JSON (bench/results/) and a PNG plot (docs/).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from _common import ARCTIC_CLIP, ARCTIC_TEXT, commit, log, pct, write_json  # bench/ is on sys.path when a script runs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "server"))

QUESTIONS = {
    "capital": "What is the capital of France?",
    "ocean": "Can you tell me something interesting about the ocean?",
}
PARTS = ("asr_final_ms", "llm_ttft_ms", "tts_ttfa_ms")


def prompts() -> dict[str, tuple[np.ndarray, int, str]]:
    """name -> (float32 mono audio, its rate, what is said)."""
    import soundfile as sf

    import torch

    from realtime.engines.vits import PiperVoice

    audio, rate = sf.read(ARCTIC_CLIP, dtype="float32")
    out = {"arctic": (audio, rate, ARCTIC_TEXT)}
    voice = PiperVoice.load()
    for name, text in QUESTIONS.items():
        out[name] = (voice.synthesize(text, generator=torch.Generator().manual_seed(0)), voice.sample_rate, text)
    return out


async def one_turn(url: str, audio: np.ndarray, rate: int, max_tokens: int) -> dict:
    from realtime.clients.agent import converse_wav

    t0 = time.monotonic()
    conv = await converse_wav(url, audio, rate, max_output_tokens=max_tokens, timeout_s=120.0)
    if not conv.metrics:
        raise RuntimeError("the reply came without metrics")
    return {**conv.metrics, "user_transcript": conv.user_transcript, "reply": conv.transcript,
            "reply_audio_s": len(conv.audio) / conv.sample_rate, "wall_s": time.monotonic() - t0}


async def some_turns(url: str, audio: np.ndarray, rate: int, max_tokens: int, n: int) -> list[dict]:
    """``n`` conversations saying the prompt at once (their starts 0.2 s apart, as callers are)."""

    async def later(i: int) -> dict:
        await asyncio.sleep(0.2 * i)
        return await one_turn(url, audio, rate, max_tokens)

    return list(await asyncio.gather(*[later(i) for i in range(n)]))


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["prompts"])
    fig, ax = plt.subplots(figsize=(9, 2.8 + 0.6 * len(names)))
    labels = {"asr_final_ms": "end of speech → ASR final (mostly the VAD's silence wait)", "llm_ttft_ms": "LLM first token",
              "tts_ttfa_ms": "first segment → first audio",
              "other_ms": "the rest: the LLM writing the first segment (a clause or sentence), hand-overs"}
    labels["held_ms"] = ("preemptive: final → the held reply sent (its LLM and TTS ran before the final, "
                         "from the ASR's preview)")
    colors = {"asr_final_ms": "#4c72b0", "llm_ttft_ms": "#dd8452", "tts_ttfa_ms": "#55a868", "other_ms": "#bbbbbb",
              "held_ms": "#8172b3"}
    labelled: set[str] = set()
    for i, name in enumerate(names):
        med = res["prompts"][name]["median"]
        left = 0.0
        if res["prompts"][name].get("preemptive_turns"):  # the parts overlap: only final -> audio sent
            parts = {"asr_final_ms": med["asr_final_ms"],
                     "held_ms": max(0.0, med["turn_latency_ms"] - med["asr_final_ms"])}
        else:
            parts = {k: med[k] for k in PARTS}
            parts["other_ms"] = max(0.0, med["turn_latency_ms"] - sum(parts.values()))
        for k, v in parts.items():
            ax.barh(i, v, left=left, color=colors[k], label=None if k in labelled else labels[k])
            labelled.add(k)
            left += v
        ax.text(left + 10, i, f"{med['turn_latency_ms']:.0f} ms", va="center", fontsize=9)
    ax.set_xlim(0, max(r["median"]["turn_latency_ms"] for r in res["prompts"].values()) * 1.15)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("median turn latency: end of the user's speech → first agent audio (ms)")
    at_once = f", {res['sessions']} conversations at once" if res.get("sessions", 1) > 1 else ""
    ax.set_title(f"voice agent on {res['devices']}{at_once} ({res['date']}, {res['commit']})", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.4, -0.25), ncol=1, frameon=False)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="timed turns a prompt")
    ap.add_argument("--warmup", type=int, default=1, help="untimed turns a prompt first")
    ap.add_argument("--max-tokens", type=int, default=48, help="the reply's token cap")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "agent_cpu.json"))
    ap.add_argument("--plot", default=str(ROOT / "docs" / "agent_cpu.png"))
    ap.add_argument("--from-json", default=None, help="only plot this results JSON")
    ap.add_argument("--sessions", type=int, default=1, help="conversations at once (each says the prompt)")
    ap.add_argument("--compare", action="store_true",
                    help="alternate preemptive replies (the default) with replies started after the final")
    args = ap.parse_args()
    if args.from_json:
        import json

        plot(json.loads(Path(args.from_json).read_text()), args.plot)
        return 0
    if args.rounds < 1 or args.warmup < 0 or args.max_tokens < 1 or args.sessions < 1:
        ap.error("--rounds, --max-tokens and --sessions take at least 1, --warmup at least 0")

    import torch
    from liveserver import serve

    from realtime.config import ServerConfig
    from realtime.server import create_app

    log("loading the prompts (the questions in the embedded voice)")
    says = prompts()
    log("loading the server's models (every default service) and warming up")
    cfg = ServerConfig(enable_asr=True, enable_text=True)  # as `realtime serve` sets them where installed
    app = create_app(cfg)
    # With --compare each prompt's turns alternate between the default (a preemptive reply, started
    # on the ASR's preview when silence begins) and replies started after the final, in one run.
    modes: dict[str, bool | None] = {"preemptive": True, "after final": False} if args.compare else {"": None}
    turns: dict[str, list[dict]] = {f"{name}, {m}" if args.compare else name: [] for name in says for m in modes}
    with serve(app) as live:
        agent = live.state.services["agent"]
        url = f"{live.ws}/v1/realtime"
        for name, (audio, rate, text) in says.items():
            log(f"prompt '{name}' ({len(audio) / rate:.1f} s of speech): {args.warmup} warm-up + {args.rounds} turns"
                + (" each way" if args.compare else ""))
            for r in range(args.warmup + args.rounds):
                for mode, pre in modes.items():
                    if pre is not None:
                        agent.agent_cfg = replace(agent.agent_cfg, preemptive=pre)
                    got = asyncio.run(some_turns(url, audio, rate, args.max_tokens, args.sessions))
                    if r >= args.warmup:
                        turns[f"{name}, {mode}" if args.compare else name] += got
            last = turns[f"{name}, {mode}" if args.compare else name][-1]
            log(f"  heard {last['user_transcript']!r}; replied {last['reply'][:70]!r}")

    keys = ("turn_latency_ms", *PARTS, "llm_tokens", "llm_tokens_per_s", "underruns", "underrun_ms")
    res = {"date": time.strftime("%Y-%m-%d"), "commit": commit(), "machine": platform.machine(),
           "cpu_count": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "devices": "cpu", "max_tokens": args.max_tokens, "rounds": args.rounds, "warmup": args.warmup,
           "sessions": args.sessions,
           "prompts": {}}
    for name, ts in turns.items():
        vals = {k: [float(t[k]) for t in ts if t.get(k) is not None] for k in keys}
        said = says[name.split(",")[0]]
        res["prompts"][name] = {"said": said[2], "speech_s": len(said[0]) / said[1],
                                "preemptive_turns": sum(1 for t in ts if t.get("preemptive_ms") is not None),
                                "median": {k: pct(v, 50) for k, v in vals.items()},
                                "p95": {k: pct(v, 95) for k, v in vals.items()}, "turns": ts}

    print(f"\nvoice agent, embedded models on the CPU  commit {res['commit']}  {res['date']}  "
          f"({args.rounds} turns a prompt after {args.warmup} warm-up, {args.sessions} conversation(s) at once; "
          f"replies of at most {args.max_tokens} tokens)")
    w = max(len(n) for n in res["prompts"]) + 2
    print(f"{'prompt':<{w}}{'turn p50':>10}{'turn p95':>10}{'ASR final':>11}{'LLM TTFT':>10}{'TTS TTFA':>10}"
          f"{'tok/s':>7}{'underruns':>11}{'preemptive':>12}")
    for name, r in res["prompts"].items():
        m, p = r["median"], r["p95"]
        print(f"{name:<{w}}{m['turn_latency_ms']:>10.0f}{p['turn_latency_ms']:>10.0f}{m['asr_final_ms']:>11.0f}"
              f"{m['llm_ttft_ms']:>10.0f}{m['tts_ttfa_ms']:>10.0f}{m['llm_tokens_per_s']:>7.1f}"
              f"{sum(t.get('underruns') or 0 for t in r['turns']):>11}"
              f"{r['preemptive_turns']:>8}/{len(r['turns'])}")
    print("(ms; turn = end of the user's speech -> first agent audio sent. The end is where the VAD put it (150 ms of\n"
          " padding after the last speech); the VAD says so after 500 ms of silence, so ~350 ms of the ASR column is that wait)")
    write_json(args.out, res)
    plot(res, args.plot)
    log(f"wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
