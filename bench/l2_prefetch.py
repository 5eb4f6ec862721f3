"""L2 prefetch probe (kernels/prefetch.py): does a prefetch land in L2, and what does it cost?

    python bench/l2_prefetch.py                 # CUDA (H200): weights of 8, 24 and 40 MB
    python bench/l2_prefetch.py --sizes 8 --reps 5

For each weight size and each prefetch configuration (and none): the weight is evicted from L2 (a
256 MB write), the prefetch is launched, the stream idles for a window (``torch.cuda._sleep``: the
time a decode step's latency-bound kernels would give it), then a GEMV reads the weight. The
profiler gives each kernel's device time, so the table shows the GEMV's time after each kind of
prefetch next to the prefetch kernel's own time. Random bf16 weights; medians of --reps rounds are
not available from the profiler's averages, so the figures are means over the rounds. Prints a
table and writes bench/results/l2_prefetch.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from _common import commit  # bench/ is on sys.path when a script runs

ROOT = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def kernel_us(prof, part: str) -> float | None:  # noqa: ANN001
    """Mean device µs of the kernels whose name contains ``part`` in a profile."""
    hits = [e for e in prof.key_averages() if part in e.key]
    n = sum(e.count for e in hits)
    return sum(e.self_device_time_total for e in hits) / n if n else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 24, 40], help="weight sizes in MB ([N, 2048] bf16)")
    ap.add_argument("--windows", type=float, nargs="+", default=[10.0, 40.0], help="idle µs between prefetch and GEMV")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "l2_prefetch.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")

    from torch.profiler import ProfilerActivity, profile

    from realtime.kernels import gemv
    from realtime.kernels.prefetch import CONFIGS, l2_prefetch

    dev = torch.device("cuda")
    clock_hz = 1.98e9  # H200 boost clock: _sleep counts cycles
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    res = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(0), "commit": commit(), "rows": []}
    print(f"{'MB':>4} {'window':>7} {'prefetch':>9} {'GEMV µs':>8} {'TB/s':>6} {'prefetch µs':>12}")
    for mb in args.sizes:
        k = 2048
        n = (mb << 20) // (2 * k)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        gemv.linear(x, w)
        for cfg in CONFIGS.values():
            l2_prefetch(w, None, cfg)  # compile outside the profile
        torch.cuda.synchronize()
        for window in args.windows:
            for name in ["none", *CONFIGS]:
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.reps):
                        flush.fill_(1)
                        if name != "none":
                            l2_prefetch(w, None, CONFIGS[name])
                        torch.cuda._sleep(int(window * 1e-6 * clock_hz))
                        gemv.linear(x, w)
                    torch.cuda.synchronize()
                g = kernel_us(prof, "_gemv")
                p = kernel_us(prof, "_prefetch_kernel")
                row = {"MB": mb, "window_us": window, "prefetch": name, "gemv_us": g, "prefetch_kernel_us": p,
                       "gemv_TBps": w.numel() * 2 / (g * 1e-6) / 1e12 if g else None}
                res["rows"].append(row)
                print(f"{mb:>4} {window:>7.0f} {name:>9} {g:>8.1f} {row['gemv_TBps']:>6.2f} "
                      f"{p if p is not None else float('nan'):>12.1f}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
