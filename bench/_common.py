"""Shared by the bench scripts (run as ``python bench/NAME.py``, so this folder is on sys.path)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The real speech the benches use (CMU ARCTIC, 16 kHz; tests/assets/COPYING.cmu_arctic) and what it says
ARCTIC_CLIP = ROOT / "tests" / "assets" / "arctic_a0009.wav"
ARCTIC_TEXT = "He turned sharply, and faced Gregson across the table."


def commit() -> str:
    """The commit the results belong to: $REALTIME_COMMIT (the device copy of the tree has no usable
    .git; pass the hash of the machine that sent it), else git's short HEAD, else "unknown"."""
    if os.environ.get("REALTIME_COMMIT"):
        return os.environ["REALTIME_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                       stderr=subprocess.DEVNULL).strip() or "unknown"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def log(msg: str) -> None:
    """A progress line with the time of day (long runs show where they are)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pct(xs: list[float], q: float) -> float | None:
    """The q-th percentile of xs (None for no values)."""
    import numpy as np

    return float(np.percentile(xs, q)) if xs else None


def write_json(path: str | Path, res: object) -> None:
    """A bench's results as indented JSON at ``path`` (its folder made where missing)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(res, indent=2))
