"""Triton availability and the warned fallback shared by every kernel file.

Each kernel file builds its ``@triton.jit`` kernels lazily (on first use) so that
``TRITON_INTERPRET=1`` set by a test (or the user) before the first call is honoured, and so that
importing ``realtime.kernels`` never needs Triton. A launcher asks :func:`use_triton` whether to run
its kernel; when the answer is no it runs the file's ``_ref`` PyTorch version instead, after one
warning per kernel name.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

__all__ = ["triton_available", "interpret_mode", "use_triton", "check"]

_warned: set[str] = set()


@functools.cache
def triton_available() -> bool:
    """True when ``import triton`` works (cached)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install raising something else at import
        return False
    return True


def interpret_mode() -> bool:
    """True when TRITON_INTERPRET asks for the CPU interpreter (read at call time, not import time)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def use_triton(name: str, *tensors: torch.Tensor) -> bool:
    """Whether kernel ``name`` can run on these tensors; warns once per name when it cannot.

    Triton runs CUDA tensors natively and CPU tensors only through its interpreter. Otherwise the
    caller falls back to its ``_ref`` (same results, PyTorch speed).
    """
    if not triton_available():
        reason = "Triton is not installed"
    elif all(t.is_cuda for t in tensors):
        return True
    elif interpret_mode() and all(t.device.type == "cpu" for t in tensors):
        return True
    elif any(t.is_cuda for t in tensors) and any(not t.is_cuda for t in tensors):
        raise ValueError(f"{name}: tensors are on different devices: {[str(t.device) for t in tensors]}")
    else:
        reason = f"tensors on {tensors[0].device} and TRITON_INTERPRET is not set"
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"realtime.kernels.{name}: {reason}; using the PyTorch reference", RuntimeWarning, stacklevel=3)
    return False


def check(cond: bool, msg: str) -> None:
    """Launcher argument check: raise ValueError (kernel arguments are caller bugs, not user input)."""
    if not cond:
        raise ValueError(msg)
