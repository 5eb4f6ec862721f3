"""Where the one-kernel decode step's time goes (kernels/decode_stack.py), on one GPU.

    python bench/stack_probe.py [--shapes 1b|csm-depth] [--context N] [--out bench/results/stack_probe.json]

Random bf16 weights (seeded normal, not zeros) of Llama-3.2-1B's stack (or CSM's depth decoder),
a cache prefilled to --context positions, one row. Each variant is captured in a CUDA graph (10
steps back to back) and replayed; medians of 15 replays, after warm-up:
- the layer-by-layer step (the engine's ``_decode`` without the stack), for the ratio;
- the stack kernel as served (grid barriers, one poller a program, no L2 prefetch), with the
  prefetch on, on half the SMs, as two 4-warp programs an SM, with the first weight tiles loaded
  before the barriers, with every thread polling, with gate and up in two K loops, other K-loop
  depths (STAGES), K tiles;
- each phase kind alone (the L launches of that phase, no barrier) and an empty launch, so
  full - sum(phases) is what the barriers and the phase hand-offs cost;
- a traced step (as served, with EARLY=1, and two 4-warp programs an SM): every program's time
  stamps at every grid barrier, so each phase's work per program (mean, slowest), the waits and the
  arrival spread.
Each figure is also given as bandwidth: the weight bytes it reads / time, against the measured
copy bandwidth. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from _common import commit  # bench/ is on sys.path when a script runs
from text import copy_bandwidth, log

SHAPES = {
    "1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, intermediate_size=8192),
    "csm-depth": dict(dim=1024, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=128, intermediate_size=8192),
}


def timed(fn, reps: int = 10, rounds: int = 15) -> float:  # noqa: ANN001
    """Median seconds of one fn() call, fn captured ``reps`` times in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def trace_table(ds, w, step, programs: int, n_layers: int, label: str) -> dict:  # noqa: ANN001
    """Runs traced stack steps (time stamps at every grid barrier, ``decode_stack(trace=)``) and logs,
    per phase kind summed over the layers: each program's work between barriers (mean over programs,
    and the slowest program), the mean wait at the barrier, the mean spread of the arrivals; the
    kernel's own length on the global timer. Returns those sums and the per-site rows."""
    trace = torch.zeros((programs, ds.PHASES * n_layers + 1, 4), dtype=torch.int64, device=w.qkv.device)
    for _ in range(5):  # the last of a few (warm) steps
        step(trace)
    torch.cuda.synchronize()
    hz, sites = ds.trace_summary(trace)
    t = trace.cpu()
    kernel_us = float((t[:, -1, 3].max() - t[:, 0, 3].min()) / 1e3)
    names = ["norm + qkv", "rope + attention", "o + residual", "norm + gate|up", "down + residual"]
    kinds = []
    for k in range(ds.PHASES):
        rows_k = [r for r in sites if r["phase"] == k]
        kinds.append(dict(phase=k, name=names[k], work_mean_us=sum(r["work_mean_us"] for r in rows_k),
                          work_max_us=sum(r["work_max_us"] for r in rows_k),
                          work_min_us=sum(r["work_min_us"] for r in rows_k),
                          wait_mean_us=sum(r["wait_mean_us"] for r in rows_k),
                          spread_mean_us=sum(r["arrival_spread_us"] for r in rows_k) / len(rows_k)))
    log(f"trace ({label}): kernel {kernel_us:.1f} us on the global timer, SM clock {hz / 1e9:.2f} GHz; per phase kind, "
        f"summed over {n_layers} layers (us): work mean / min / max-program, wait mean, arrival spread (mean a site)")
    for r in kinds:
        log(f"  {r['phase']} {r['name']:<18} {r['work_mean_us']:8.1f} {r['work_min_us']:8.1f} {r['work_max_us']:8.1f} "
            f"{r['wait_mean_us']:8.1f} {r['spread_mean_us']:7.2f}")
    return dict(kernel_us=kernel_us, clock_hz=hz, kinds=kinds, sites=sites)


def plot_traces(result: dict, png: Path) -> None:
    """Bar chart of a probe result's traced steps: per phase kind, the slowest program's work summed
    over the layers (µs) for each traced variant, next to the time the phase's weight bytes take at
    the measured copy bandwidth; the title names the GPU, commit and step times."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = result.get("traces") or {}
    if not traces:
        return
    kinds = next(iter(traces.values()))["kinds"]
    names = [k["name"] for k in kinds]
    layers = SHAPES[result["shapes"]]["n_layers"]
    cfg = SHAPES[result["shapes"]]
    dim, inter, hd = cfg["dim"], cfg["intermediate_size"], cfg["head_dim"]
    qkv = (cfg["n_heads"] + 2 * cfg["n_kv_heads"]) * hd * dim
    per_layer = [qkv, 0, dim * cfg["n_heads"] * hd, 2 * inter * dim, dim * inter]  # weight elements a phase reads
    floor = [n * 2 * layers / (result["copy_bw_GB_s"] * 1e9) * 1e6 for n in per_layer]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / (len(traces) + 1)
    xs = range(len(names))
    for i, (label, t) in enumerate(traces.items()):
        ax.bar([x + i * width for x in xs], [k["work_max_us"] for k in t["kinds"]], width,
               label=f"{label}: slowest program ({t['kernel_us']:.0f} µs a step)")
    ax.bar([x + len(traces) * width for x in xs], floor, width, color="0.7", label="its weight bytes at the copy bandwidth")
    ax.set_xticks([x + width * len(traces) / 2 for x in xs], names)
    ax.set_ylabel(f"µs, summed over {layers} layers")
    served = {r["name"]: r.get("us") for r in result["rows"]}
    ax.set_title(f"decode stack phases, {result['shapes']} batch 1, {result['device']} ({result['date']}, {result['commit']}); "
                 f"layer path {served.get('layer-by-layer (_decode, no stack)', float('nan')):.0f} µs", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def plot_cuda(results: list[dict], png: Path) -> None:
    """The CUDA C++ stack across probe results (one a commit, in order): left, a 1B step's time for
    the layer path, the Triton stack and the CUDA stack as served by each commit, with the copy
    floor; right, the last result's CUDA variants (copies in flight, splits, probe modes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def by(r: dict) -> dict:
        return {row["name"]: row.get("us") for row in r["rows"] if row.get("us")}

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 1.4]})
    commits = [r["commit"] for r in results]
    xs = range(len(results))
    layer = [by(r).get("layer-by-layer (_decode, no stack)") for r in results]
    triton = [by(r).get("stack, as served") for r in results]
    cuda = [next((v for k, v in by(r).items() if k.startswith("CUDA stack, splits=") and "stages" not in k
                  and (k.endswith("splits=9") or k.endswith("splits=9, 2 in flight"))), None) for r in results]
    ax.plot(xs, layer, "o-", label="layer path (served today)")
    ax.plot(xs, triton, "s-", label="Triton stack")
    ax.plot(xs, cuda, "^-", label="CUDA stack (the commit's default or its best cap)")
    floor = [r["weight_bytes"] / (r["copy_bw_GB_s"] * 1e9) * 1e6 for r in results]
    ax.plot(xs, floor, "--", color="0.5", label="weight bytes at the copy bandwidth")
    ax.set_xticks(list(xs), commits, fontsize=8)
    ax.set_ylabel("µs a step (16 layers, batch 1)")
    ax.set_ylim(0, max(v for v in layer + triton + cuda if v) * 1.1)
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title("Llama-3.2-1B decode step, one call each", fontsize=9)
    last = results[-1]
    rows = [(k, v) for k, v in by(last).items() if k.startswith("CUDA") or k.startswith("layer-by-layer (_decode, no stack)")]
    bx.barh([k.replace("CUDA stack, ", "") for k, _ in rows], [v for _, v in rows],
            color=["C0" if k.startswith("layer") else ("0.6" if "mode" in k or "streamed" in k or "waits" in k else "C2")
                   for k, _ in rows])
    bx.axvline(floor[-1], ls="--", color="0.5")
    bx.tick_params(axis="y", labelsize=7)
    bx.invert_yaxis()
    bx.set_xlabel("µs a step")
    bx.set_title(f"{last['device']}, {last['date']}, {last['commit']}: CUDA stack variants (grey: probe modes)", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def finish(args, ds, w, cfg, bw: float, weight_bytes: int, sms: int, rows: list, stack, traced) -> int:  # noqa: ANN001
    """The traced steps (``traced``: (label, tune, programs) each), the summary, the JSON; the exit code."""
    nl = cfg.n_layers
    traces = {}
    for label, tune, programs in traced:
        try:
            traces[label] = trace_table(ds, w, lambda tr, tune=tune, p=programs: stack(tune=tune, trace=tr, programs=p)(),
                                        programs, nl, label)
        except Exception as exc:
            log(f"trace ({label}) failed: {exc!r}"[:200])
    flags = ds.errors(w)
    log(f"barrier errors: {flags}")
    by = {r["name"]: r.get("us", float("nan")) for r in rows}  # (nan: the row failed or did not run)
    phase_sum = sum(by[n] for n in by if n.startswith("phase "))
    served = by["stack, as served"]
    empty = by.get(f"empty launch x{ds.PHASES * nl + 1}", float("nan"))
    summary = dict(
        served_us=served, layer_path_us=by["layer-by-layer (_decode, no stack)"], floor_us=weight_bytes / bw * 1e6,
        phases_sum_us=phase_sum, barriers_and_handoffs_us=served - phase_sum,
        launch_overhead_per_phase_us=empty / (ds.PHASES * nl + 1),
    )
    log("summary: " + ", ".join(f"{k} {v:.1f}" for k, v in summary.items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(commit=commit(), device=torch.cuda.get_device_name(), shapes=args.shapes,
                                   context=args.context, copy_bw_GB_s=bw / 1e9, weight_bytes=weight_bytes, rows=rows,
                                   summary=summary, traces=traces, barrier_errors=flags,
                                   date=time.strftime("%Y-%m-%d")), indent=1))
    log(f"wrote {out}")
    if traces:
        plot_traces(json.loads(out.read_text()), out.with_suffix(".png"))
        log(f"wrote {out.with_suffix('.png')}")
    return 0 if flags == 0 else 1


def cuda_rows(args, model, w, step_x, pos, cache, slots, cos, sin, weight_bytes: int, row, sms: int,  # noqa: ANN001
              rows: list) -> None:
    """The CUDA C++ stack (kernels/decode_stack_cuda.py): as served, other split counts and ring
    sizes, each checked against the layer path's step (output and the step's K/V rows)."""
    from realtime.kernels import decode_stack_cuda as dsc

    if args.no_cuda or not dsc.available():
        log("CUDA stack: skipped (--no-cuda, or no sm_90 GPU / nvcc)")
        return
    saved = model.stack
    model.stack = None
    k0, v0 = cache.k.clone(), cache.v.clone()
    p0 = int(pos[0])
    with torch.no_grad():
        ref = model._decode(step_x[:, None], pos, cache, slots)[:, 0].float()
    rk, rv = cache.k[:, :, :, p0].float(), cache.v[:, :, :, p0].float()
    model.stack = saved
    variants = [dict()] if args.lean else [dict(), dict(backoff=300), dict(inflight=3), dict(balance=40),
                                           dict(splits=4), dict(splits=12)]
    fits = dsc.every_fits(w.n_heads, w.n_kv_heads, w.head_dim, cache.k.shape[3])
    every = dsc.every_default(w.n_heads, w.n_kv_heads, w.head_dim, cache.k.shape[3])
    if fits:  # the attention as items handing the heads over, beside every SM attending (or the reverse)
        variants.insert(1, dict(every=not every))
    most = dsc.ring_stages(w, step_x.device, every)
    log(f"CUDA stack: {most} ring stages of 16 KB fit an SM (the default)"
        + (", every SM attends to all the heads" if every else ""))
    if args.inflight_scan:  # copies in flight an SM: the memory's latency times its bandwidth
        variants += [dict(inflight=n) for n in args.inflight_scan]
    if args.backoff_scan:  # polls that sleep before they poll again: less L2 traffic beside the stream
        variants += [dict(backoff=n) for n in args.backoff_scan]
    if args.stage_scan:  # the ring's size: as many stages as fit, then fewer
        variants += [dict(stages=n) for n in (most - 1, most - 2, most - 4) if n >= 2]
    for kw in variants:
        ns, stages = kw.get("splits"), kw.get("stages")

        def fn(kw=kw):  # noqa: ANN202
            return dsc.decode_stack_cuda(w, step_x, pos, cache.k, cache.v, slots, cos, sin, **kw)
        fl = kw.get("inflight", dsc.INFLIGHT)
        ev = kw.get("every", dsc.every_default(w.n_heads, w.n_kv_heads, w.head_dim, cache.k.shape[3], ns))
        name = ("CUDA stack, every SM attends" if ev else
                f"CUDA stack, splits={ns or dsc.default_splits(w.n_kv_heads, cache.k.shape[3], sms)}")
        name = (name
                + (f", {stages} stages" if stages else "") + f", {fl or 'all'} in flight"
                + (f", balance {kw['balance']}" if "balance" in kw else "")
                + (f", polls back off {kw['backoff']} ns" if kw.get("backoff") else ""))
        try:
            cache.k.copy_(k0)
            cache.v.copy_(v0)
            out = fn().float()
            torch.cuda.synchronize()
            rel = float((out - ref).norm() / ref.norm())
            relk = float((cache.k[:, :, :, p0].float() - rk).norm() / rk.norm())
            relv = float((cache.v[:, :, :, p0].float() - rv).norm() / rv.norm())
            log(f"  {name}: vs the layer path: out {rel:.2e}, k {relk:.2e}, v {relv:.2e} (relative); "
                f"poll timeouts {dsc.errors(w)}")
        except Exception as exc:  # a failing build or launch must not lose the other rows
            log(f"  {name}: failed: {exc!r}"[:400])
            continue
        row(name, fn, weight_bytes)
    # The engines' one-row step: the input row gathered from an embedding, the stack, the head
    # (the LM head; a CSM codebook head): three launches as the engines did, or one kernel
    # (x_index and head: decode_row_fused)
    if args.head_rows:
        from realtime.engines.transformer import project, use_gemv

        table = torch.randn(4096, step_x.shape[1], device=step_x.device, dtype=torch.bfloat16)
        index = torch.tensor([123], device=step_x.device)
        head = (torch.randn(args.head_rows, step_x.shape[1], device=step_x.device) * 0.02).to(torch.bfloat16)
        gemv = use_gemv(head)
        nbytes = weight_bytes + head.numel() * 2

        def three() -> torch.Tensor:
            x = torch.nn.functional.embedding(index, table)
            return project(dsc.decode_stack_cuda(w, x, pos, cache.k, cache.v, slots, cos, sin), head, None, gemv)

        def one() -> torch.Tensor:
            return dsc.decode_stack_cuda(w, table, pos, cache.k, cache.v, slots, cos, sin, x_index=index, head=head)[1]
        cache.k.copy_(k0)
        cache.v.copy_(v0)
        a3 = three().float()
        cache.k.copy_(k0)
        cache.v.copy_(v0)
        a1 = one().float()
        torch.cuda.synchronize()
        log(f"  head of {args.head_rows} rows: one kernel's logits vs the three launches': "
            f"{float((a1 - a3).norm() / a3.norm()):.2e} (relative); poll timeouts {dsc.errors(w)}")
        row(f"gather + CUDA stack + head GEMV ({args.head_rows} rows): 3 launches", three, nbytes)
        row(f"CUDA stack with the gather and the head ({args.head_rows} rows): 1 kernel", one, nbytes)
        if args.head_rows <= dsc.MAX_SAMPLE_V:  # the token sampled in the kernel too (a CSM depth pass)
            token = torch.zeros(1, device=step_x.device, dtype=torch.long)
            seeds = torch.tensor([7], device=step_x.device)
            steps = torch.tensor([3], device=step_x.device)
            for t, k, what in ((0.9, 50, "sampled (temperature 0.9, top-k 50)"), (0.0, 0, "greedy")):
                sample = (torch.tensor([t], device=step_x.device), torch.tensor([k], device=step_x.device),
                          seeds, steps, 0)

                def sampled(sample=sample) -> torch.Tensor:
                    return dsc.decode_stack_cuda(w, table, pos, cache.k, cache.v, slots, cos, sin, x_index=index,
                                                 head=head, sample=sample, token=token)[2]
                row(f"CUDA stack with the gather, the head and the token {what}: 1 kernel", sampled, nbytes)
    # Where the CUDA stack's time goes: each SM's cycle counts for one step, and the step without
    # its waits (mode 1) and without its arithmetic too (mode 2: how fast the weights stream alone)
    # (mode 3: no waits and no attention, so mode 1 - mode 3 is what the attention's own work costs
    # and mode 3 - mode 2 what the stages' arithmetic and the phases' local work cost)
    for mode, kw, name in ((1, {}, "CUDA stack, no polls (probe mode 1)"),
                           (3, {}, "CUDA stack, no polls, no attention (probe mode 3)"),
                           (2, {}, "CUDA stack, weights streamed only (probe mode 2)"),
                           (2, dict(inflight=0), "CUDA stack, weights streamed only, all in flight"),
                           *((2, dict(inflight=n), f"CUDA stack, weights streamed only, {n} in flight")
                             for n in (args.inflight_scan or ()) if n)):
        row(name, lambda mode=mode, kw=kw: dsc.decode_stack_cuda(w, step_x, pos, cache.k, cache.v, slots, cos, sin,
                                                                 mode=mode, **kw), weight_bytes)
    cache.k.copy_(k0)
    cache.v.copy_(v0)
    stats = torch.zeros(sms, dsc.STATS, dtype=torch.int64, device=step_x.device)
    for _ in range(3):
        dsc.decode_stack_cuda(w, step_x, pos, cache.k, cache.v, slots, cos, sin, stats=stats)
    torch.cuda.synchronize()
    st = stats.double().cpu()
    total = float(st[:, 9].max())
    log(f"CUDA stack, cycle counts of one step ({sms} SMs; the slowest consumer total = 1.00):")
    for i, name in enumerate(dsc.STAT_NAMES):
        col = st[:, i]
        if i == 11:
            log(f"  {name:<42} mean {float(col.mean()):9.1f}  max {float(col.max()):9.1f}")
        else:
            log(f"  {name:<42} mean {float(col.mean()) / total:6.3f}  max {float(col.max()) / total:6.3f}  "
                f"min {float(col.min()) / total:6.3f}   ({float(col.max()):.0f} cycles)")
    # the attention's parts on the SMs that attend, split 0 of each kv head (which merges) apart
    ns = dsc.default_splits(w.n_kv_heads, cache.k.shape[3], sms)
    items = w.n_kv_heads * ns
    layers = w.qkv.shape[0]
    for label, sel in (("splits 1..", [i for i in range(items) if i % ns]), ("split 0 (merges)", list(range(0, items, ns)))):
        if sel:
            sub = st[sel]
            log(f"  {label}, cycles a layer, mean over {len(sel)} SMs:")
            for i in (4, 16, 18, 17, 19, 14, 15, 8):
                log(f"    {dsc.STAT_NAMES[i]:<40} {float(sub[:, i].mean()) / layers:8.0f}")
    rows.append(dict(name="CUDA stack cycle counts", stat_names=list(dsc.STAT_NAMES),
                     mean=st.mean(0).tolist(), max=st.max(0).values.tolist(), min=st.min(0).values.tolist(),
                     per_sm=st.long().tolist()))
    if args.timeline:  # one step's timeline (the timed build): bench/stack_timeline.py reads and sums it
        import stack_timeline
        ts = args.timeline
        trace = torch.zeros(sms, dsc.trace_width(layers, ts), dtype=torch.int64, device=step_x.device)
        for _ in range(3):  # (the last of a few warm steps: every slot is rewritten each step)
            trace.zero_()
            dsc.decode_stack_cuda(w, step_x, pos, cache.k, cache.v, slots, cos, sin, stats=stats, trace=trace)
        torch.cuda.synchronize()
        path = Path(args.out).with_suffix(".trace.pt")
        meta = dict(n_layers=layers, stages=ts, items=items, splits=ns, ring=dsc.ring_stages(w, step_x.device),
                    dim=w.qkv.shape[2], inter=w.down.shape[2], n_heads=w.n_heads, n_kv_heads=w.n_kv_heads,
                    head_dim=w.head_dim,
                    device=torch.cuda.get_device_name(), commit=commit(), context=int(cache.k.shape[3]))
        torch.save(dict(trace=trace.cpu(), **meta), path)
        summary = stack_timeline.summarize(trace.cpu(), **meta)
        stack_timeline.report(summary)
        rows.append(dict(name="CUDA stack timeline", file=path.name, **summary))
        cache.k.copy_(k0)
        cache.v.copy_(v0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--context", type=int, default=None,
                    help="cached positions before the step (default: 264 for 1b, 16 for csm-depth: mid-frame)")
    ap.add_argument("--out", default="bench/results/stack_probe.json")
    ap.add_argument("--quick", action="store_true",
                    help="only the layer path (timed first and last), the stack as served, its plain form and the "
                         "FMA / ATT_PREFETCH / ATT_EARLY / ATT_REGS variants (each checked against the served step), "
                         "and traces")
    ap.add_argument("--no-trace", action="store_true", help="with --quick: no traced steps")
    ap.add_argument("--cuda-only", action="store_true",
                    help="only the layer path, the Triton stack as served and the CUDA C++ stack's rows")
    ap.add_argument("--lean", action="store_true",
                    help="with --cuda-only: the CUDA stack as served, its probe modes and cycle counts (no variants)")
    ap.add_argument("--timeline", type=int, default=0, metavar="STAGES",
                    help="with the CUDA stack's cycle counts: one traced step's timeline of its first STAGES stages an SM "
                         "(bench/stack_timeline.py; the trace beside --out as .trace.pt)")
    ap.add_argument("--head-rows", type=int, default=None,
                    help="rows of a head after the stack for the one-row-step rows (default: 128256, Llama-3.2's "
                         "LM head, for 1b; 2051, a CSM codebook head, for csm-depth; 0: none)")
    ap.add_argument("--inflight-scan", type=int, nargs="+", default=None, metavar="N",
                    help="CUDA stack rows with N weight copies in flight an SM (0: the whole ring), "
                         "and the stream alone (probe mode 2) at each")
    ap.add_argument("--backoff-scan", type=int, nargs="+", default=None, metavar="NS",
                    help="CUDA stack rows with the polls sleeping NS ns after a word not yet written (Params::backoff)")
    ap.add_argument("--stage-scan", action="store_true",
                    help="CUDA stack rows with 1, 2 and 4 ring stages fewer than fit")
    ap.add_argument("--no-cuda", action="store_true", help="no rows for the CUDA C++ stack (kernels/decode_stack_cuda.py)")
    ap.add_argument("--plot", metavar="JSON", help="only plot a probe result's traces into JSON's name with .png")
    ap.add_argument("--plot-cuda", metavar="JSON", nargs="+",
                    help="only plot probe results' CUDA-stack rows (one a commit, in order) into --out's name with .png")
    ap.add_argument("--ncu", action="store_true",
                    help="for Nsight Compute: run the served stack step and the layer-by-layer step a few times "
                         "each (no timing, no graphs) and exit, e.g. ncu -k regex:_stack_kernel -c 1 ...")
    ap.add_argument("--ncu-cuda", action="store_true",
                    help="for Nsight Compute: warm CUDA C++ stack steps, then one in the NVTX range 'cuda_stack', "
                         "and exit (build it with REALTIME_CUDA_LINEINFO=1 for per-line source counters)")
    args = ap.parse_args()
    if args.plot_cuda:  # no GPU needed
        png = Path(args.out).with_suffix(".png")
        plot_cuda([json.loads(Path(f).read_text()) for f in args.plot_cuda], png)
        print(f"wrote {png}")
        return 0
    if args.plot:  # no GPU needed
        png = Path(args.plot).with_suffix(".png")
        plot_traces(json.loads(Path(args.plot).read_text()), png)
        print(f"wrote {png}")
        return 0
    if args.context is None:
        args.context = 16 if args.shapes == "csm-depth" else 264
    if args.head_rows is None:
        args.head_rows = 2051 if args.shapes == "csm-depth" else 128256
    if not torch.cuda.is_available():
        print("stack_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    from realtime.engines.transformer import KVCache, Transformer, TransformerConfig
    from realtime.kernels import decode_stack as ds

    dev = torch.device("cuda")
    bw = copy_bandwidth(dev, 1024)
    cfg = TransformerConfig(**SHAPES[args.shapes], max_seq_len=args.context + 8, rope_theta=500000.0)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model = model.to(dev, torch.bfloat16)
    model.fuse_projections()
    assert model.enable_decode_stack(), "the stack kernel does not take these shapes"
    w = model.stack
    cache = KVCache(cfg, n_slots=1, max_seq_len=cfg.max_seq_len, device=dev, dtype=torch.bfloat16)
    slots = torch.zeros(1, dtype=torch.long, device=dev)
    x = torch.randn(1, args.context, cfg.dim, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        model(x, torch.arange(args.context, device=dev)[None], cache, slots)
    step_x = torch.randn(1, cfg.dim, device=dev, dtype=torch.bfloat16)
    pos = torch.full((1,), args.context, dtype=torch.long, device=dev)
    cos, sin = model.rope_table(cache.max_seq_len, torch.bfloat16)
    weight_bytes = w.layer_bytes
    per_kind = [w.qkv[0], None, w.o[0], w.gate_up[0], w.down[0]]  # the bytes each phase kind reads a layer
    sms = ds.default_programs(dev)
    log(f"{args.shapes}: {cfg.n_layers} layers, {weight_bytes / 1e9:.3f} GB of layer weights, {sms} SMs, "
        f"copy bandwidth {bw / 1e9:.0f} GB/s, floor {weight_bytes / bw * 1e6:.1f} us")

    def stack(**kw):  # noqa: ANN003, ANN202
        return lambda: ds.decode_stack(w, step_x, pos, cache.k, cache.v, slots, cos, sin, **kw)

    if args.ncu_cuda:  # the CUDA C++ stack's step for a profiler (see bench/h200_stack.sh, part ncu_cuda)
        from realtime.kernels import decode_stack_cuda as dsc

        for _ in range(3):  # the build, the scratch, warm caches: outside the profiled range
            dsc.decode_stack_cuda(w, step_x, pos, cache.k, cache.v, slots, cos, sin)
        torch.cuda.synchronize()
        with torch.cuda.nvtx.range("cuda_stack"):  # ncu --nvtx --nvtx-include cuda_stack/
            dsc.decode_stack_cuda(w, step_x, pos, cache.k, cache.v, slots, cos, sin)
        torch.cuda.synchronize()
        log(f"ncu-cuda mode: warm steps, then one CUDA stack step (NVTX 'cuda_stack'); poll timeouts {dsc.errors(w)}")
        return 0
    if args.ncu:  # the kernels a profiler attaches to: stack steps, then layer-by-layer steps
        for _ in range(2):  # warm (compiles, GEMV choices) outside the profiled ranges
            stack()()
        saved = model.stack
        model.stack = None
        for _ in range(2):
            model._decode(step_x[:, None], pos, cache, slots)
        torch.cuda.synchronize()
        with torch.cuda.nvtx.range("layers"):  # ncu --nvtx --nvtx-include layers/
            model._decode(step_x[:, None], pos, cache, slots)
        model.stack = saved
        with torch.cuda.nvtx.range("stack"):
            stack()()
        torch.cuda.synchronize()
        log(f"ncu mode: warm steps, then one layer-by-layer step (NVTX 'layers') and one stack step ('stack') ran; barrier errors {ds.errors(w)}")
        return 0

    rows: list[dict] = []

    def row(name: str, fn, nbytes: int | None) -> None:  # noqa: ANN001
        try:
            t = timed(fn)
        except Exception as exc:  # one variant that fails (e.g. does not fit) must not lose the others
            rows.append(dict(name=name, error=repr(exc)[:300]))
            log(f"{name:<44} failed: {exc!r}"[:200])
            return
        r = dict(name=name, us=t * 1e6)
        if nbytes:
            r["GB_s"] = nbytes / t / 1e9
            r["of_copy_bw"] = nbytes / t / bw
        rows.append(r)
        log(f"{name:<44} {t * 1e6:9.1f} us" + (f"  {r['GB_s']:7.0f} GB/s ({r['of_copy_bw']:.2f} of copy)" if nbytes else ""))

    saved = model.stack
    model.stack = None
    row("layer-by-layer (_decode, no stack)", lambda: model._decode(step_x[:, None], pos, cache, slots), weight_bytes)
    model.stack = saved
    row("stack, as served", stack(), weight_bytes)
    cuda_rows(args, model, w, step_x, pos, cache, slots, cos, sin, weight_bytes, row, sms, rows)
    if args.cuda_only:
        return finish(args, ds, w, cfg, bw, weight_bytes, sms, rows, stack, ())
    # The served switches at one row are FMA=15, ATT_PREFETCH=4, ATT_REGS (launch_meta). The variants
    # built on ``plain`` (none of them: the served form before) name every switch they turn on; the
    # "served" ones change only what they name.
    plain = {"FMA": 0, "ATT_PREFETCH": 0, "ATT_REGS": 0}
    for name, tune in (("plain form (no FMA, ATT_PREFETCH, ATT_REGS)", plain),
                       ("FMA=15 only", {**plain, "FMA": 15}),
                       ("FMA=15 + ATT_PREFETCH=4 + ATT_EARLY", {**plain, "FMA": 15, "ATT_PREFETCH": 4, "ATT_EARLY": 1}),
                       ("FMA=15 + ATT_REGS (no prefetch)", {**plain, "FMA": 15, "ATT_REGS": 1}),
                       ("ATT_REGS only", {**plain, "ATT_REGS": 1}),
                       ("served, FMA=14 (q|k|v by tl.dot)", {"FMA": 14}),
                       ("served + q|k|v L2-prefetched at down's end (PREFETCH=1)", {"PREFETCH": 1}),
                       ("served + PREFETCH=9 (q|k|v, down's quarter)", {"PREFETCH": 9}),
                       ("served + PREFETCH=15 (every site)", {"PREFETCH": 15})):
        row(f"stack, {name}", stack(tune=tune), weight_bytes)
        try:
            with torch.no_grad():  # the same step as served, within bf16 rounding (another summation order)
                a, b = stack(tune=tune)().float(), stack()().float()
            log(f"  {name}: max |diff| {float((a - b).abs().max()):.3g} (served max |h| {float(b.abs().max()):.3g})")
        except Exception as exc:  # (its row already says it failed)
            log(f"  {name}: no comparison: {exc!r}"[:200])
    model.stack = None  # again, after the variants: how far the layer path's time drifted in this call
    row("layer-by-layer (_decode, no stack), again", lambda: model._decode(step_x[:, None], pos, cache, slots),
        weight_bytes)
    model.stack = saved
    if args.quick:
        return finish(args, ds, w, cfg, bw, weight_bytes, sms, rows, stack,
                      () if args.no_trace else (("served", None, sms), ("plain form", plain, sms),
                                                ("served + PREFETCH=1", {"PREFETCH": 1}, sms)))
    row("stack, L2 prefetch on", stack(prefetch=True), weight_bytes)
    row("stack, idle programs prefetch o + 1/2 gate|up", stack(tune={"ATT_PREFETCH": 2}), weight_bytes)
    row(f"stack on {sms // 2} programs", stack(programs=sms // 2), weight_bytes)
    row(f"stack on {2 * sms} programs of 4 warps (two an SM)", stack(programs=2 * sms, tune={"WARPS": 4}), weight_bytes)
    base = ds.launch_meta(1, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.n_layers,
                          cfg.max_seq_len, sms, 2, False, False)
    double = {k: 2 * base[k] for k in ("BK_QKV", "BK_O", "BK_GU", "BK_D") if 2 * base[k] <= 512}
    variants = [("first weight tiles ahead of the barriers", {"EARLY": 1}),
                ("every thread polls the barrier", {"ONE_POLLER": False}),
                ("gate and up in two K loops", {"GU_ONE_LOOP": False}), ("STAGES=2", {"STAGES": 2}),
                ("STAGES=3", {"STAGES": 3}), ("STAGES=6", {"STAGES": 6}), ("K tiles x2, STAGES=3", {**double, "STAGES": 3}),
                ("o and down K tiles / 2", {"BK_O": base["BK_O"] // 2, "BK_D": base["BK_D"] // 2})]
    for name, tune in variants:
        row(f"stack, {name}", stack(tune=tune), weight_bytes)
    nl = cfg.n_layers
    row("all phases, one launch each (no barrier)", stack(phases=list(range(ds.PHASES * nl + 1))), weight_bytes)
    names = ["norm + qkv", "rope + cache + attention", "merge + o + residual", "norm + gate|up + swiglu",
             "down + residual"]
    for k, name in enumerate(names):
        nbytes = per_kind[k].numel() * 2 * nl if per_kind[k] is not None else None
        row(f"phase {k} ({name}) x{nl}", stack(phases=[ds.PHASES * l + k for l in range(nl)]), nbytes)
    row(f"empty launch x{ds.PHASES * nl + 1}", stack(phases=[10 ** 6] * (ds.PHASES * nl + 1)), None)
    return finish(args, ds, w, cfg, bw, weight_bytes, sms, rows, stack,
                  (("served", None, sms), ("EARLY=1", {"EARLY": 1}, sms), ("plain form", plain, sms),
                   ("two 4-warp programs an SM", {"WARPS": 4}, 2 * sms)))


if __name__ == "__main__":
    sys.exit(main())
