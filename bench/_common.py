"""Shared by the bench scripts (run as ``python bench/NAME.py``, so this folder is on sys.path)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
