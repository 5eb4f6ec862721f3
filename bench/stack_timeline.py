"""One CUDA-stack step's timeline (kernels/csrc/decode_stack.cu, Params::trace), summed.

    python bench/stack_timeline.py RUN.trace.pt [--plot timeline.png] [--layers 7 8]

The trace comes from ``bench/stack_probe.py --timeline STAGES`` (on a GPU); this script reads it on
any machine. Per SM it holds, for the step's first STAGES stages, the producer's clock when it had
room for another copy in flight and when it issued the copy (the gap: the ring was full, the
consumers had not freed the slot), the consumers' clock when they asked for a stage and when they
had it (the gap: they waited for its bytes), and per layer the consumers' clock and the global
timer at the phases' edges (kernels/decode_stack_cuda.TRACE_EVENTS).

It answers three questions about where a step's time goes beyond the weights' stream:
- how long each SM's stream stood still because its ring was full, and during which of the
  consumers' waits (the residual, the attention's chain up to the heads, the activation);
- how long the consumers' segments of a layer take (the phases' stages, the waits between them);
- each hand-over between SMs, on the global timer: the spread of the writers (the last against the
  median) and the readers' latency after the last writer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

# the consumers' segments of a layer, each from the event before it to its own (kernels' Ev order)
SEGMENTS = (("waits for the residual (q|k|v)", 0), ("q|k|v stages", 1), ("attention chain, to the heads", 3),
            ("o stages", 4), ("waits for the residual (gate|up)", 5), ("gate|up stages", 6),
            ("waits for the activation (down)", 7), ("down stages", 8))
EVENTS = 11  # len(kernels.decode_stack_cuda.TRACE_EVENTS); this script needs no GPU module


def _split(trace: torch.Tensor, n_layers: int, stages: int) -> dict:
    ts = stages
    # the global timer counts ns since an epoch (~1.8e18): taken relative to its first value in int64,
    # or float64 keeps it to 256 ns and the offsets below cancel to nothing
    trace = trace.clone()
    gcols = torch.zeros(trace.shape[1], dtype=torch.bool)
    gcols[4 * ts + 1: 4 * ts + 2 * n_layers * EVENTS: 2] = True
    gcols[-3] = gcols[-1] = True
    g = trace[:, gcols]
    base = int(g[g > 0].min()) - 1 if bool((g > 0).any()) else 0
    trace[:, gcols] = torch.where(g > 0, g - base, g)
    t = trace.to(torch.float64)
    ev = t[:, 4 * ts: 4 * ts + 2 * n_layers * EVENTS].reshape(t.shape[0], n_layers, EVENTS, 2)
    return dict(room=t[:, :ts], issue=t[:, ts:2 * ts], ask=t[:, 2 * ts:3 * ts], have=t[:, 3 * ts:4 * ts],
                clk=ev[..., 0], gt=ev[..., 1], cal=t[:, -4:])


def _clock_hz(cal: torch.Tensor) -> float:
    """The SMs' clock rate: the median over SMs of cycles / global ns from each one's start to its end."""
    ok = (cal[:, 3] > cal[:, 1]) & (cal[:, 2] > cal[:, 0])
    if not bool(ok.any()):
        raise ValueError("the trace has no SM's start and end: was it written by a timed step?")
    return float(((cal[ok, 2] - cal[ok, 0]) / (cal[ok, 3] - cal[ok, 1])).median()) * 1e9


def _boundaries(clk: torch.Tensor, start: float) -> list[float]:
    """An SM's segment ends in order (n_layers x len(SEGMENTS)), missing events (0: the SM has no rows
    there) filled with the one before, so that their segment is empty."""
    out, last = [], start
    for l in range(clk.shape[0]):
        for _, e in SEGMENTS:
            v = float(clk[l, e])
            last = v if v > 0 else last
            out.append(last)
    return out


# Llama-3.2-1B's widths: a trace written before the probe saved the widths in it was of these
WIDTHS_1B = dict(dim=2048, inter=8192, n_heads=32, n_kv_heads=8, head_dim=64)


def _rows_of(n: int, sms: int, lo: int, hi: int) -> list[int]:
    """The SMs holding rows [lo, hi) of a weight of n rows split as the kernel does by default
    (ceil(n / sms) rows an SM, rounded up to even; decode_stack_cuda.row_start with balance -1)."""
    r = -(-n // sms)
    r += r & 1
    return [p for p in range(sms) if p * r < min(hi, n) and (p + 1) * r > lo]


def summarize(trace: torch.Tensor, n_layers: int, stages: int, items: int, splits: int, ring: int, **meta) -> dict:
    """The timeline's sums (see the module's doc); times in µs."""
    d = _split(trace, n_layers, stages)
    cal = d["cal"]
    hz = _clock_hz(cal)
    us = 1e6 / hz
    P = trace.shape[0]
    nseg = len(SEGMENTS)
    per_sm = []
    seg_sum = torch.zeros(nseg)
    full_by_seg = torch.zeros(nseg + 1)  # (+ the time after the last layer: the head, the step's end)
    for s in range(P):
        issue, room, ask, have = d["issue"][s], d["room"][s], d["ask"][s], d["have"][s]
        n = int((issue > 0).sum())
        if n == 0:
            continue
        start = float(cal[s, 0])
        b = _boundaries(d["clk"][s], start)
        edges = torch.tensor([start] + b)
        seg = (edges[1:] - edges[:-1]).reshape(n_layers, nseg).clamp(min=0)
        seg_sum += seg.sum(0)
        full = (issue[:n] - room[:n]).clamp(min=0)
        # each stall's interval [room, issue] over the consumers' segments it overlaps
        lo, hi = room[:n], issue[:n]
        ends = torch.tensor(b + [float("inf")])
        begins = torch.cat([torch.tensor([start]), ends[:-1]])
        ov = (torch.minimum(hi[:, None], ends[None]) - torch.maximum(lo[:, None], begins[None])).clamp(min=0)
        by = ov.sum(0)
        for j in range(n_layers * nseg):
            full_by_seg[j % nseg] += float(by[j])
        full_by_seg[nseg] += float(by[-1])
        cap = (room[1:n] - issue[: n - 1]).clamp(min=0)
        nc = int((have > 0).sum())
        per_sm.append(dict(sm=s, stages=n, step_us=float(cal[s, 2] - cal[s, 0]) * us,
                           stream_us=float(issue[n - 1] - issue[0]) * us, ring_full_us=float(full.sum()) * us,
                           inflight_wait_us=float(cap.sum()) * us,
                           bytes_wait_us=float((have[:nc] - ask[:nc]).clamp(min=0).sum()) * us))
    m = len(per_sm)
    mean = {k: statistics.fmean(r[k] for r in per_sm) for k in ("step_us", "stream_us", "ring_full_us",
                                                                  "inflight_wait_us", "bytes_wait_us")}
    worst = max(per_sm, key=lambda r: r["ring_full_us"])
    segments = {name: float(seg_sum[i]) * us / m / n_layers for i, (name, _) in enumerate(SEGMENTS)}
    full_seg = {name: float(full_by_seg[i]) * us / m for i, (name, _) in enumerate(SEGMENTS)}
    full_seg["after the last layer"] = float(full_by_seg[nseg]) * us / m
    return dict(clock_hz=hz, sms=m, mean=mean, worst_ring_full=worst, segment_us_a_layer=segments,
                ring_full_us_by_segment=full_seg,
                handovers=_handovers(d, hz, n_layers, items, splits, {k: meta.get(k, v) for k, v in WIDTHS_1B.items()}),
                ring=ring, per_sm=per_sm)


def _handovers(d: dict, hz: float, n_layers: int, items: int, splits: int, wd: dict) -> dict:
    """Per hand-over, means over the layers (µs, global timer): the spread of the SMs whose rows the
    event's thread (thread 0, of consumer warp 0) waits for (the last against their median), and
    that thread's poll done after the last of them (median and slowest reader). Warp 0 polls the
    input's first 1024 columns, so its writers are the SMs with those rows; an attention item's, the
    SMs with its kv head's q|k|v rows."""
    clk, gt = d["clk"], d["gt"]
    P = clk.shape[0]
    # each SM's clock on the global timer: the offset that fits its events (global ns - cycles / rate)
    stamped = clk > 0
    off = torch.zeros(P, dtype=torch.float64)
    for s in range(P):
        sel = stamped[s]
        if bool(sel.any()):
            off[s] = float((gt[s][sel] - clk[s][sel] * 1e9 / hz).mean())
    g = clk * 1e9 / hz + off[:, None, None]  # ns
    g[~stamped] = float("nan")
    dim, inter, h, hkv, hd = wd["dim"], wd["inter"], wd["n_heads"], wd["n_kv_heads"], wd["head_dim"]
    ns = max(splits, 1)
    G = h // hkv
    nqkv = (h + 2 * hkv) * hd
    seg = 1024  # (kSeg: the columns a consumer warp multiplies)
    every = list(range(P))
    first_down = _rows_of(dim, P, 0, seg)    # the residual's first columns: down's and o's rows
    first_act = _rows_of(inter, P, 0, seg)   # the activation's: gate|up's rows
    first_heads = [kv * ns for kv in range(min(hkv, -(-seg // (G * hd))))]  # split 0 of the first kv heads

    def qkv_rows(kv: int) -> list[int]:
        return sorted(set(_rows_of(nqkv, P, kv * G * hd, (kv + 1) * G * hd))
                      | set(_rows_of(nqkv, P, (h + kv) * hd, (h + kv + 1) * hd))
                      | set(_rows_of(nqkv, P, (h + hkv + kv) * hd, (h + hkv + kv + 1) * hd)))

    # name: (writers' event, readers' event, [(reader SMs, their writer SMs)], the writers' layer offset)
    pairs = {"residual after down -> q|k|v": (8, 0, [(every, first_down)], -1),
             "q|k|v -> attention": (1, 9, [([kv * ns + s for s in range(ns) if kv * ns + s < items], qkv_rows(kv))
                                           for kv in range(hkv)], 0),
             "partials -> split 0": (2, 10, [([kv * ns], [kv * ns + s for s in range(1, ns)]) for kv in range(hkv)], 0),
             "heads -> o": (2, 3, [(every, first_heads)], 0),
             "residual after o -> gate|up": (4, 5, [(every, first_down)], 0),
             "activation -> down": (6, 7, [(every, first_act)], 0)}
    out = {}
    for name, (we, re, groups, dl) in pairs.items():
        spread, med, slow = [], [], []
        for l in range(max(0, -dl), n_layers):
            for readers, writers in groups:
                w = g[[x for x in writers if x < P], l + dl, we]
                r = g[[x for x in readers if x < P], l, re]
                w, r = w[~torch.isnan(w)], r[~torch.isnan(r)]
                if len(w) == 0 or len(r) == 0:
                    continue
                last = float(w.max())
                spread.append((last - float(w.median())) / 1e3)
                med.append((float(r.median()) - last) / 1e3)
                slow.append((float(r.max()) - last) / 1e3)
        if med:
            out[name] = dict(writers_spread_us=statistics.fmean(spread), readers_median_us=statistics.fmean(med),
                             readers_slowest_us=statistics.fmean(slow), layers=len(med))
    return out


def report(s: dict, out=sys.stderr) -> None:  # noqa: ANN001
    """Prints the summary as tables."""
    m = s["mean"]
    p = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    p(f"timeline of one step, {s['sms']} SMs, SM clock {s['clock_hz'] / 1e9:.3f} GHz, ring {s['ring']} stages; means over SMs (µs):")
    p(f"  step {m['step_us']:.1f}, stream (first to last copy) {m['stream_us']:.1f}, ring full {m['ring_full_us']:.1f}, "
      f"waiting for room in flight {m['inflight_wait_us']:.1f}, consumers waiting for bytes {m['bytes_wait_us']:.1f}")
    w = s["worst_ring_full"]
    p(f"  most ring-full SM: {w['sm']} ({w['ring_full_us']:.1f} µs of {w['step_us']:.1f})")
    p("  the consumers' segments, µs a layer (mean over SMs)   | ring full during them, µs a step (mean over SMs)")
    for name, v in s["segment_us_a_layer"].items():
        p(f"    {name:<40} {v:7.2f}       | {s['ring_full_us_by_segment'][name]:7.1f}")
    p(f"    {'after the last layer':<40} {'':7}       | {s['ring_full_us_by_segment']['after the last layer']:7.1f}")
    p("  hand-overs (global timer, mean over layers, µs): writers' spread (last - median), readers after the last writer: median / slowest")
    for name, h in s["handovers"].items():
        p(f"    {name:<32} {h['writers_spread_us']:6.2f}   {h['readers_median_us']:6.2f} / {h['readers_slowest_us']:6.2f}")


def plot(path: Path, trace: torch.Tensor, n_layers: int, stages: int, layers: list[int], sms: list[int], title: str) -> None:
    """A PNG of a few SMs over some layers: the consumers' segments as bars, the ring-full stalls below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = _split(trace, n_layers, stages)
    cal = d["cal"]
    us = 1e6 / _clock_hz(cal)
    fig, ax = plt.subplots(figsize=(13, 0.55 * len(sms) + 1.6))
    colors = ["0.8", "C0", "C3", "C1", "0.6", "C2", "0.4", "C4"]
    nseg = len(SEGMENTS)
    for row, s in enumerate(sms):
        start = float(cal[s, 0])
        b = _boundaries(d["clk"][s], start)
        t0 = b[(layers[0]) * nseg - 1] if layers[0] > 0 else start
        for l in layers:
            for j in range(nseg):
                i = l * nseg + j
                a0 = b[i - 1] if i > 0 else start
                ax.barh(row, (b[i] - a0) * us, left=(a0 - t0) * us, height=0.5, color=colors[j],
                        label=SEGMENTS[j][0] if row == 0 and l == layers[0] else None)
        t1 = b[(layers[-1] + 1) * nseg - 1]
        issue, room = d["issue"][s], d["room"][s]
        sel = (issue > 0) & (room >= t0) & (room <= t1) & (issue - room > 0)
        for r0, r1 in zip(room[sel].tolist(), issue[sel].tolist()):
            ax.plot([(r0 - t0) * us, (r1 - t0) * us], [row + 0.36] * 2, color="k", lw=2.5)
        iss = issue[(issue >= t0) & (issue <= t1)]
        ax.plot(((iss - t0) * us).tolist(), [row - 0.36] * len(iss), "|", color="C5", ms=4)
    ax.set_yticks(range(len(sms)), [f"SM {s}" for s in sms])
    ax.set_xlabel("µs (each SM's own clock from the first layer shown)")
    ax.set_title(f"{title}\nbars: the consumers' segments; black above: the ring full (the producer waits); "
                 "ticks below: copies issued", fontsize=9)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a .trace.pt from bench/stack_probe.py --timeline")
    ap.add_argument("--plot", metavar="PNG", help="a timeline of a few SMs over --layers")
    ap.add_argument("--layers", type=int, nargs="+", default=[7, 8])
    ap.add_argument("--sms", type=int, nargs="+", default=None, help="SMs to plot (default: split 0, split 1, an SM "
                                                                      "that does not attend, the most ring-full SM)")
    args = ap.parse_args()
    blob = torch.load(args.trace, weights_only=True)
    meta = {k: v for k, v in blob.items() if k != "trace"}
    s = summarize(blob["trace"], **meta)
    report(s, sys.stdout)
    if args.plot:
        sms = args.sms or sorted({0, 1, meta["items"] + 1, s["worst_ring_full"]["sm"]})
        plot(Path(args.plot), blob["trace"], meta["n_layers"], meta["stages"], args.layers, sms,
             f"{meta.get('device', '?')}, {meta.get('commit', '?')}: one 1B step's timeline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
