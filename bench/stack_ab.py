"""The CUDA decode stack's L2 hints, L2 prefetches and copies in flight, A/B in one process: the
engine is loaded once, and each setting is captured again and timed, in the order given
(alternate them: a GPU drifts by ~1 % over a minute). CSM-1B (random weights, /tmp/csm1b as
bench/csm_engine.py builds it) at batch 1, sampled, or text decode at Llama-3.2-1B shapes, batch
1, greedy.

  REALTIME_STACK=csm REALTIME_STACK_KERNEL=cuda python3 bench/stack_ab.py csm --settings 0:2@0 12:2 0:2@0 12:2
  REALTIME_STACK=text REALTIME_STACK_KERNEL=cuda python3 bench/stack_ab.py text --settings -1:2@0+0 -1:2 -1:2@0+0 -1:2

A setting is KEEP:INFLIGHT[:BACKBONE][@AHEAD][+BURST][~BACKOFF] (the suffixes in any order). KEEP is the depth
stack's ``l2_keep`` for CSM (k > 0: every k-th stage kept in a persisting L2 set aside for it, -1:
every stage evict_first, 0: no hints) or the text stack's; INFLIGHT the weight copies in flight an
SM; BACKBONE (CSM) the backbone's ``l2_keep`` (default: -1 where KEEP is not 0); AHEAD the stages
every stack prefetches into L2 past a full ring (without @: each stack's default, 12 for text and
4 for CSM; 0: none); BURST the copies in flight an SM while its consumers are close behind its
stream (without +: each stack's default, 3 for text and 0 for CSM; 0: off; for CSM also
DEPTH/BACKBONE, one a stack); BACKOFF the ns a poll sleeps after a word not yet written (without ~:
each stack's default; 0: none; for CSM also DEPTH/BACKBONE).
Every CSM setting's first frames are checked against the first setting's codes, and every text
setting's tokens against the first's (none of these settings changes a result). Prints a table,
writes JSON, and with --plot a bar chart. ``--from-json A.json B.json --plot X.png`` plots
recorded runs.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

from _common import log  # bench/ is on sys.path when a script runs

ROOT = Path(__file__).resolve().parents[1]


def parse_setting(text: str) -> tuple[int | None, int, int | None, int | None, int | tuple | None, int | tuple | None]:
    """KEEP:INFLIGHT[:BACKBONE][@AHEAD][+BURST][~BACKOFF] -> (keep, inflight, backbone, ahead, burst,
    backoff); KEEP "auto" (None): the engine's k; AHEAD: stages prefetched into L2 past a full ring
    (None, without @: the stacks' default; 0: none); BURST: copies in flight while the consumers
    are close behind the stream (None, without +: the default; CSM's "D/B": the depth stack's D,
    the backbone's B); BACKOFF: ns a poll sleeps after a word not yet written (None, without ~:
    the default; CSM's "D/B" as BURST's)."""
    text, *found = re.split(r"(?=[@+~])", text.strip())  # KEEP:INFLIGHT[:BACKBONE], then "@4", "+3", "~200"
    suffix = {s[0]: s[1:] for s in found}
    if len(suffix) < len(found):
        raise argparse.ArgumentTypeError(f"a setting takes one @AHEAD, one +BURST and one ~BACKOFF at most, "
                                         f"got {text + ''.join(found)!r}")
    ahead, burst, backoff = suffix.get("@"), suffix.get("+"), suffix.get("~")
    if burst is not None and not re.fullmatch(r"\d+(/\d+)?", burst):
        raise argparse.ArgumentTypeError(f"BURST (after +) is a count of copies (CSM: or DEPTH/BACKBONE), got {burst!r}")
    if backoff is not None and not re.fullmatch(r"\d+(/\d+)?", backoff):
        raise argparse.ArgumentTypeError(f"BACKOFF (after ~) is ns (CSM: or DEPTH/BACKBONE), got {backoff!r}")
    if ahead is not None and not ahead.isdigit():
        raise argparse.ArgumentTypeError(f"AHEAD (after @) is a count of stages, got {ahead!r}")
    parts = text.split(":")
    ok = 2 <= len(parts) <= 3 and all(p.lstrip("-").isdigit() for p in parts[1:])
    ok = ok and (parts[0] == "auto" or parts[0].lstrip("-").isdigit())
    if not ok or int(parts[1]) < 0:
        raise argparse.ArgumentTypeError(f"a setting is KEEP:INFLIGHT[:BACKBONE][@AHEAD][+BURST][~BACKOFF] (integers, KEEP may be auto, "
                                         f"INFLIGHT >= 0), got {text!r}")
    return ((None if parts[0] == "auto" else int(parts[0])), int(parts[1]), int(parts[2]) if len(parts) == 3 else None,
            None if ahead is None else int(ahead),
            _count_or_pair(burst), _count_or_pair(backoff))


def _count_or_pair(v: str | None) -> int | tuple | None:
    return None if v is None else tuple(map(int, v.split("/"))) if "/" in v else int(v)


def ahead_s(ahead: int | None) -> str:
    return "default" if ahead is None else str(ahead)


def run_csm(args, res: dict) -> None:  # noqa: ANN001
    import torch

    import csm_engine as ce
    from realtime.engines.transformer import use_kernels
    from realtime.kernels import decode_stack_cuda as dsc
    from realtime.tts_csm import CSMBackend

    folder = Path(args.folder)
    ce.build(folder)
    use_kernels(True)
    t0 = time.perf_counter()
    b = CSMBackend(str(folder), "cuda", "cuda", torch.bfloat16, n_slots=1, max_seq_len=1024, cuda_graphs=True)
    b.capture_graphs()
    log(f"CSM loaded and captured in {time.perf_counter() - t0:.1f}s")
    csm = b.csm
    if not csm.depth.stack_cuda:
        raise SystemExit("the CUDA stack is off: set REALTIME_STACK=csm REALTIME_STACK_KERNEL=cuda")
    w, dev = csm.depth.stack, torch.device("cuda")
    layers = w.layer_bytes
    l2, most = dsc.l2_sizes(dev)
    res.update(depth_layer_bytes=layers, l2_bytes=l2, persist_most=most, auto_keep=dsc.auto_l2_keep(layers, l2, most),
               engine_default_keep=w.l2_keep)
    log(f"L2 {l2 / 1e6:.1f} MB, persisting at most {most / 1e6:.1f} MB; depth layers {layers / 1e6:.1f} MB; "
        f"auto k {res['auto_keep']}")
    text = "Hello there, how are you today?"
    slots = torch.arange(1)
    temp, top_k, seeds = torch.full((1,), 0.9), torch.full((1,), 50, dtype=torch.long), torch.arange(1)

    def restart() -> None:
        b.state.reset([0])
        csm.prefill(b.state, 0, csm.build_prompt(text, 0))

    def frames(n: int = 16) -> None:
        for _ in range(n):
            b.frame_step(slots, temp, top_k, seeds)

    first = None
    stacks = (w, csm.backbone.stack)
    burst0, backoff0 = dsc.BURST, dsc.BACKOFF
    own = {a: tuple(getattr(st, a) for st in stacks) for a in ("burst", "backoff")}  # (the engine's: engines/csm.py)
    for keep, inflight, backbone, ahead, burst, backoff in args.settings:
        keep = res["auto_keep"] if keep is None else keep
        burst = _per_stack(burst, burst0, stacks, "burst", own["burst"], "REALTIME_STACK_BURST")
        backoff = _per_stack(backoff, backoff0, stacks, "backoff", own["backoff"], "REALTIME_STACK_BACKOFF")
        w.l2_keep = keep
        csm.backbone.stack.l2_keep = backbone if backbone is not None else (-1 if keep else 0)
        set_aside = dsc.persist_l2(dev, dsc.keep_set_aside(layers, keep) if keep > 0 else 0)
        dsc.INFLIGHT, dsc.L2_AHEAD = inflight, ahead
        dsc.BURST, dsc.BACKOFF = (burst0 if burst is None else burst), (backoff0 if backoff is None else backoff)
        bursts = (dsc.burst_of(w), dsc.burst_of(csm.backbone.stack))
        backoffs = (dsc.backoff_of(w), dsc.backoff_of(csm.backbone.stack))
        b.step_graphs = csm.capture_step(b.state, sizes=[1])  # the hints and the count are in the launch
        restart()
        codes = torch.stack([b.frame_step(slots, temp, top_k, seeds) for _ in range(6)])
        first = codes if first is None else first
        restart()
        frames(4)
        ts = ce.cuda_time(frames, args.repeats)
        row = {"keep": keep, "inflight": inflight, "ahead": ahead, "burst": bursts[0], "backbone_burst": bursts[1],
               "backoff": backoffs[0], "backbone_backoff": backoffs[1],
               "backbone_keep": csm.backbone.stack.l2_keep,
               "set_aside": set_aside,
               "frames_per_s": 16 / statistics.median(ts), "frames_per_s_each": [16 / t for t in ts],
               "same_codes": bool(torch.equal(codes, first)), "poll_errors": dsc.errors(w)}
        res["rows"].append(row)
        log(f"keep {keep:3d}, backbone {row['backbone_keep']:2d}, {inflight} in flight (burst {bursts[0]}/{bursts[1]}), "
            f"back-off {backoffs[0]}/{backoffs[1]} ns, "
            f"{ahead_s(ahead)} ahead, "
            f"set aside {set_aside / 1e6:5.1f} MB:"
            f" {row['frames_per_s']:6.1f} frames/s (runs {min(row['frames_per_s_each']):.1f}..{max(row['frames_per_s_each']):.1f}),"
            f" same codes {row['same_codes']}")
    dsc.persist_l2(dev, 0)


def _per_stack(value, env0, stacks, attr: str, own: tuple, var: str):  # noqa: ANN001, ANN202
    """A CSM setting's BURST or BACKOFF: DEPTH/BACKBONE (a pair) sets each stack's own ``attr`` for
    this setting and returns None (the launch then takes the stacks'); a count or None puts the
    engine's own back and is returned, for the variable that overrides every stack."""
    if not isinstance(value, tuple):
        for st, v in zip(stacks, own):
            setattr(st, attr, v)
        return value
    if env0 is not None:
        raise SystemExit(f"{var} is set: it would override a setting's DEPTH/BACKBONE")
    for st, v in zip(stacks, value):
        setattr(st, attr, v)
    return None


def run_text(args, res: dict) -> None:  # noqa: ANN001
    import tempfile

    import torch

    import text as tb
    from realtime.engines.llama import TextModel
    from realtime.kernels import decode_stack_cuda as dsc

    dev = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        t0 = time.perf_counter()
        tb.build_checkpoint(tb.LLAMA_3_2_1B, folder, torch.bfloat16, dev)
        model = TextModel.from_pretrained(folder, device=dev, dtype=torch.bfloat16)
        log(f"Llama-3.2-1B shapes built and loaded in {time.perf_counter() - t0:.1f}s")
        if model.transformer.stack is None:
            raise SystemExit("the CUDA stack is off: set REALTIME_STACK=text REALTIME_STACK_KERNEL=cuda")
        first = None
        burst0, backoff0 = dsc.BURST, dsc.BACKOFF
        for keep, inflight, _, ahead, burst, backoff in args.settings:
            if isinstance(burst, tuple) or isinstance(backoff, tuple):
                raise SystemExit("DEPTH/BACKBONE is for CSM's two stacks; text takes +BURST and ~BACKOFF")
            keep = -1 if keep is None else keep  # (auto: the text stack's default, evict_first)
            dsc.INFLIGHT, dsc.L2_AHEAD = inflight, ahead
            dsc.BURST, dsc.BACKOFF = (burst0 if burst is None else burst), (backoff0 if backoff is None else backoff)
            model.transformer.stack.l2_keep = keep
            row = {"keep": keep, "inflight": inflight, "ahead": ahead, "burst": dsc.burst_of(model.transformer.stack),
                   "backoff": dsc.backoff_of(model.transformer.stack)}
            for pipelined in (False, True):  # each builds its decoder, and so captures its graphs
                tps, toks = tb.ours_tokens_per_s(model, 1, 128, args.steps, True, 0.0, 128 + args.steps + 8, None,
                                                 pipelined)
                row["pipelined_tok_s" if pipelined else "graph_tok_s"] = tps
                first = toks if first is None else first
                row["same_tokens" if not pipelined else "same_tokens_pipelined"] = toks == first
            res["rows"].append(row)
            log(f"keep {keep:3d}, {inflight} in flight (burst {row['burst']}, back-off {row['backoff']} ns), "
                f"{ahead_s(ahead)} ahead: "
                f"{row['graph_tok_s']:6.0f} tok/s read each step, "
                f"{row['pipelined_tok_s']:6.0f} pipelined, same tokens {row['same_tokens'] and row['same_tokens_pipelined']}")


def label(row: dict) -> str:
    k, bb = row["keep"], row.get("backbone_keep")
    name = "no hints" if k == 0 else "all\nevict_first" if k < 0 else f"keep 1/{k}"
    if row["inflight"] != 2:
        name += f"\n{row['inflight']} in flight"
    if row.get("ahead") is not None:
        name += f"\n{row['ahead']} ahead"
    if row.get("burst", 0) > row["inflight"] or row.get("backbone_burst", 0) > row["inflight"]:
        bb_b = row.get("backbone_burst", row["burst"])
        name += f"\nburst {row['burst']}" + (f"/{bb_b}" if bb_b != row["burst"] else "")
    if row.get("backoff", 0) or row.get("backbone_backoff", 0):
        bb_o = row.get("backbone_backoff", row["backoff"])
        name += f"\nsleep {row['backoff']}" + (f"/{bb_o}" if bb_o != row["backoff"] else "") + " ns"
    if bb is not None and bb != (-1 if k else 0):
        name += "\nbackbone " + ("no hints" if bb == 0 else "evict_first")
    return name


def _order(row: dict) -> tuple:
    k, bb = row["keep"], row.get("backbone_keep")
    ahead = row.get("ahead")
    return (row["inflight"], row.get("burst", 0), row.get("backbone_burst", 0), row.get("backoff", 0),
            row.get("backbone_backoff", 0), -1 if ahead is None else ahead,
            0 if k == 0 else 1 if k < 0 else 2, -k, bb is not None and bb != (-1 if k else 0))


def plot(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4), squeeze=False)
    for ax, res in zip(axes[0], runs):
        csm = res["part"] == "csm"
        key = "frames_per_s" if csm else "graph_tok_s"
        groups: dict[str, list[float]] = {}
        for row in sorted(res["rows"], key=_order):
            groups.setdefault(label(row), []).append(row[key])
        names = list(groups)
        means = [statistics.mean(v) for v in groups.values()]
        ax.bar(range(len(names)), means, color=["#888" if n == "no hints" else "#3a7" for n in names])
        for i, v in enumerate(groups.values()):
            ax.plot([i] * len(v), v, "k.", ms=4)
        ax.set_xticks(range(len(names)), names, fontsize=7)
        lo = min(min(v) for v in groups.values())
        ax.set_ylim(lo * 0.97, max(max(v) for v in groups.values()) * 1.01)
        ax.set_ylabel("frames/s, batch 1" if csm else "tok/s, batch 1, read each step")
        name = "CSM-1B" if csm else "text, Llama-3.2-1B shapes"
        ax.set_title(f"{name} ({res['gpu']}): the stack's copy and poll settings", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


# The settings a recorded run's rows differ in, and the variable that sets each for every stack
_ENV = {"inflight": "REALTIME_STACK_INFLIGHT", "ahead": "REALTIME_STACK_L2_AHEAD", "burst": "REALTIME_STACK_BURST",
        "backoff": "REALTIME_STACK_BACKOFF", "keep": "REALTIME_STACK_L2_KEEP"}


def best_env(res: dict) -> str:
    """The environment (``NAME=value ...``) that puts every stack at a recorded run's best setting:
    the median over each setting's rows (CSM: frames/s; text: read-each-step + pipelined tok/s).
    The first setting is the reference: a variable is named only where the best setting differs
    from it, and REALTIME_STACK_INFLIGHT always. Refuses (SystemExit) a run whose settings changed a
    result, and a best setting that no variable can express (CSM's DEPTH/BACKBONE pairs or a
    backbone KEEP of its own, a text KEEP other than 0 and -1, its default)."""
    rows, csm = res.get("rows") or [], res.get("part") == "csm"
    if not rows:
        raise SystemExit("the run has no rows")
    if not all(r.get("same_codes", True) and r.get("same_tokens", True) and r.get("same_tokens_pipelined", True)
               for r in rows):
        raise SystemExit("a setting changed the results: no best setting is named")
    fields = ("keep", "inflight", "ahead", "burst", "backbone_burst", "backoff", "backbone_backoff", "backbone_keep")

    def key(r: dict) -> tuple:
        return tuple(r.get(f) for f in fields)

    runs: dict[tuple, list[float]] = {}
    for r in rows:
        runs.setdefault(key(r), []).append(r["frames_per_s"] if csm else r["graph_tok_s"] + r["pipelined_tok_s"])
    best = dict(zip(fields, max(runs, key=lambda k: statistics.median(runs[k]))))
    first = dict(zip(fields, key(rows[0])))
    env = [f"REALTIME_STACK_INFLIGHT={best['inflight']}"]
    for f in ("ahead", "burst", "backoff", "keep"):
        if best[f] == first[f] and best.get(f"backbone_{f}") == first.get(f"backbone_{f}"):
            continue
        if best[f] is None or (f == "keep" and not csm and best[f] == -1):  # the stacks' own default
            continue
        pair = csm and f in ("burst", "backoff") and best[f] != best[f"backbone_{f}"]
        # REALTIME_STACK_L2_KEEP=k: CSM's depth k with the backbone at -1 (0: no hints on either); text's 0 only
        bad_keep = f == "keep" and (best["backbone_keep"] != (-1 if best["keep"] else 0) if csm else best["keep"] != 0)
        if pair or bad_keep or best[f] < 0:
            raise SystemExit(f"the best setting's {f} ({best[f]}) is not one variable's value: set it by hand")
        env.append(f"{_ENV[f]}={best[f]}")
    return " ".join(env)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", nargs="?", choices=["csm", "text"])
    ap.add_argument("--settings", type=parse_setting, nargs="+", default=None,
                    help="KEEP:INFLIGHT[:BACKBONE][@AHEAD][+BURST][~BACKOFF] ... (default: 0:2@0+0~0 auto:2 0:2@0+0~0 auto:2, "
                         "off and the "
                         "default, alternating)")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs of 16 frames a CSM setting (median)")
    ap.add_argument("--steps", type=int, default=256, help="timed decode steps a text setting")
    ap.add_argument("--folder", default="/tmp/csm1b")
    ap.add_argument("--out", default=None, help="JSON (default bench/results/stack_ab_<part>.json)")
    ap.add_argument("--plot", default=None, help="PNG: a bar a setting (the runs' dots over it)")
    ap.add_argument("--from-json", nargs="+", default=None, help="plot these recorded runs, run nothing")
    ap.add_argument("--best", default=None, metavar="JSON",
                    help="print the variables that set every stack to this recorded run's best setting, run nothing")
    # a setting that starts with a negative KEEP (-1:2) would read as an option: a space ahead of it
    args = ap.parse_args([" " + a if re.match(r"-\d+:", a) else a for a in sys.argv[1:]])
    if args.best:
        try:
            res = json.loads(Path(args.best).read_text())
        except (OSError, ValueError) as exc:
            ap.error(f"--best: cannot read a recorded run from {args.best}: {exc}")
        print(best_env(res))
        return 0
    if args.from_json:
        if not args.plot:
            ap.error("--from-json needs --plot")
        plot([json.loads(Path(p).read_text()) for p in args.from_json], args.plot)
        return 0
    if not args.part:
        ap.error("name the part: csm or text")
    import torch

    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (sm_90 with nvcc: the CUDA stack)")
    from _common import commit  # bench/ is on sys.path when a script runs

    from realtime.kernels import decode_stack_cuda as dsc

    if args.settings is None:  # off and the default, alternating
        args.settings = [parse_setting("0:2@0+0~0"), parse_setting("auto:2")] * 2
    res = {"part": args.part, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": commit(),
           "date": time.strftime("%Y-%m-%d"), "inflight_default": dsc.INFLIGHT, "rows": []}
    (run_csm if args.part == "csm" else run_text)(args, res)
    out = Path(args.out or ROOT / "bench" / "results" / f"stack_ab_{args.part}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    log(f"wrote {out}")
    if args.plot:
        plot([res], args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
