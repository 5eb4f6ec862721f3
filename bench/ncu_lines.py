"""Nsight Compute's per-instruction stall samples of the CUDA stack, summed per source line.

The device exports the SASS page of a report (``ncu -i R.ncu-rep --page source --csv --print-source
sass``: one row an instruction, no source lines). This script builds the same .cu here with
``-lineinfo`` (the same nvcc version gives the same SASS: it checks every opcode), disassembles it
with nvdisasm (``pip install nvidia-cuda-nvdisasm``; no GPU needed) and puts each instruction's
samples on its source line:

    python bench/ncu_lines.py --csv B_sass.csv [--src kernels/csrc/decode_stack.cu] [--top 40]

It prints the lines with the most samples, each with its three main stall reasons, and with
``--lines 217,219`` the instructions of those lines.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _nvdisasm(given: str | None) -> str:
    cands = [given, shutil.which("nvdisasm")]
    try:  # the PyPI wheel's binary
        import nvidia

        cands += [str(p) for p in Path(nvidia.__path__[0]).glob("*/bin/nvdisasm")]
    except ImportError:
        pass
    for c in cands:
        if c and Path(c).is_file():
            return c
    sys.exit("nvdisasm not found: pip install nvidia-cuda-nvdisasm, or pass --nvdisasm")


def local_sass(src: Path, nvdisasm: str, kernel: str) -> list[tuple[int, int | None, str]]:
    """(offset, source line, instruction) for the kernel whose mangled name contains ``kernel``."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        subprocess.run(["nvcc", "-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90", "-cubin", "-lineinfo",
                        "-o", str(cubin), str(src)], check=True)
        text = subprocess.run([nvdisasm, "-g", "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    out, line, fn = [], None, None
    for row in text.splitlines():
        m = re.search(r'//## File "(.*)", line (\d+)', row)
        if m:  # (a header's inlined code stays on the source line it was inlined from)
            if Path(m.group(1)).name == src.name:
                line = int(m.group(2))
            continue
        m = re.match(r"\s*\.text\.(\S+):", row)
        if m:
            fn = m.group(1)
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?);", row)
        if m and fn and kernel in fn:
            out.append((int(m.group(1), 16), line, m.group(2).strip()))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", required=True, help="the report's SASS page as CSV (see above)")
    ap.add_argument("--src", default=str(ROOT / "kernels" / "csrc" / "decode_stack.cu"))
    ap.add_argument("--kernel", default="ILb0E", help="a piece of the kernel's mangled name (default: the untimed step)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--lines", default="", help="comma-separated source lines whose instructions to print")
    ap.add_argument("--nvdisasm", default=None)
    args = ap.parse_args()
    loc = local_sass(Path(args.src), _nvdisasm(args.nvdisasm), args.kernel)
    rows = list(csv.reader(open(args.csv, newline="")))
    hdr = next(r for r in rows if r and r[0] == "Address")
    data = [r for r in rows[rows.index(hdr) + 1:] if len(r) == len(hdr)]
    ix = {h: i for i, h in enumerate(hdr)}
    if len(loc) != len(data) or any(a[2].split()[0] != b[1].split()[0] for a, b in zip(loc, data)):
        sys.exit(f"the local build's SASS ({len(loc)} instructions) is not the profiled one ({len(data)}): "
                 "another source or nvcc version")
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    samples = ix["Warp Stall Sampling (All Samples)"]
    by_line: collections.Counter = collections.Counter()
    why: dict = collections.defaultdict(collections.Counter)
    for (_, line, _), r in zip(loc, data):
        by_line[line] += int(r[samples] or 0)
        for h in reasons:
            why[line][h[6:]] += int(r[ix[h]] or 0)
    total = sum(by_line.values())
    src = Path(args.src).read_text().splitlines()
    print(f"{total} samples over {len(loc)} instructions")
    for line, n in by_line.most_common(args.top):
        top = ", ".join(f"{k}:{v}" for k, v in why[line].most_common(3) if v)
        text = src[line - 1].strip()[:72] if line else "(no line)"
        print(f"{n:8d} {100 * n / max(total, 1):5.1f}%  L{line}  {text}  [{top}]")
    want = {int(x) for x in args.lines.split(",") if x}
    for (off, line, ins), r in zip(loc, data):
        if line in want and int(r[samples] or 0):
            print(f"{off:6x} L{line} {int(r[samples]):6d}  {ins[:60]}  executed {r[ix['Instructions Executed']]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
