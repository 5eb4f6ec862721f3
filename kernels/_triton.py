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

__all__ = ["triton_available", "interpret_mode", "use_triton", "check", "pdl", "pdl_launch", "pdl_jit", "graph_time"]

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


# Programmatic dependent launch (Hopper+): a kernel launched with it may start while the kernel
# before it in the stream is still finishing; it waits (griddepcontrol.wait) before touching
# anything. Every kernel of this package launched with it calls ``pdl_enter`` first, which waits for
# the previous grid to complete and flush, then lets the next kernel launch. Because each kernel
# waits for its predecessor before it ends, completion stays transitive along the stream.
_PDL = os.environ.get("REALTIME_PDL", "1").strip() != "0"


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device launch with programmatic dependent launch: CUDA sm90+, not
    the interpreter, and REALTIME_PDL is not 0. Pass it as both the kernel's PDL constexpr and the
    ``launch_pdl`` launch option."""
    if not (_PDL and t.is_cuda) or interpret_mode():
        return False
    return _capability(t.device.index if t.device.index is not None else torch.cuda.current_device()) >= (9, 0)


def pdl_launch(t: torch.Tensor) -> dict:
    """The launch keywords for kernels on ``t``'s device: the PDL constexpr and the matching
    ``launch_pdl`` option (see ``pdl``)."""
    on = pdl(t)
    return {"PDL": on, "launch_pdl": on}


@functools.cache
def pdl_jit():
    """The ``pdl_enter(PDL)`` jit helper each kernel calls first (built on first use)."""
    global tl, gdc_wait, gdc_launch_dependents  # the jit'd helper resolves these through module globals
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        if PDL:
            gdc_wait()  # the previous kernel in the stream has completed and its writes are visible
            gdc_launch_dependents()  # the next one may be scheduled now

    return pdl_enter


@functools.cache
def state_row_jit():
    """The ``state_row(b, rows_ptr, HAS_ROWS)`` jit helper of the kernels that step a subset of a
    state's rows in place: the state row of input row b, rows[b] (``rows_ptr``, contiguous int64)
    when HAS_ROWS, else b itself."""
    global tl  # the jit'd helper resolves this through module globals
    import triton
    import triton.language as tl

    @triton.jit
    def state_row(b, rows_ptr, HAS_ROWS: tl.constexpr):
        row = b
        if HAS_ROWS:
            row = tl.load(rows_ptr + b).to(tl.int64)
        return row

    return state_row


def graph_time(fns: list, rounds: int = 5) -> float:
    """Median seconds per call of the ``fns`` replayed in turn inside one CUDA graph (no launch gaps),
    on the current device. The first two run eagerly first (compilation stays out of the graph)."""
    from realtime.cuda_graphs import capture

    for fn in fns[:2]:
        fn()

    def run() -> None:
        for fn in fns:
            fn()

    graph, _ = capture(run, None, warmups=1)
    graph.replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(fns))
    return sorted(times)[len(times) // 2]
