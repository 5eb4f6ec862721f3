"""L2 prefetch of upcoming weights, issued beside a decode step's latency-bound kernels.

At batch 1 a decode layer alternates between weight-streaming GEMVs and short kernels that read
almost nothing from HBM (rotary + cache write, split attention, its merge, the add + RMSNorms:
~2.5 µs each on the H200). While those run, the memory system is idle. ``l2_prefetch`` asks it to
pull the next GEMVs' weights into L2 meanwhile (``cp.async.bulk.prefetch.L2``, sm90+: one
instruction per chunk, nothing comes back to the SM), so the GEMV that follows finds part of its
weight there. ``Prefetcher`` issues the prefetches on a side stream forked from the compute stream
(inside a CUDA graph capture that makes a parallel branch), so the compute chain itself gains no
kernel; ``join`` merges the branch back.

A prefetch is a hint: it changes no value. Off sm90+ CUDA (the CPU, the interpreter, older GPUs) it
is skipped, which is also its PyTorch reference. Whether it pays is measured
(``bench/text.py --l2-prefetch``): the L2 is ~50 MB on the H100/H200, and too large a prefetch
evicts its own beginning before the GEMV reads it, hence the byte budget per issue.
"""

from __future__ import annotations

import functools
import os
import threading

import torch
from torch import Tensor

from ._triton import _capability, check, interpret_mode, triton_available

__all__ = ["CHUNK_BYTES", "l2_prefetch", "supported", "Prefetcher", "use_l2_prefetch"]

CHUNK_BYTES = 16 << 10  # bytes per bulk prefetch instruction (a multiple of 16)
_BLOCK = 256  # chunks per program (one per thread at 8 warps)


def _env_mb() -> int:
    raw = os.environ.get("REALTIME_L2_PREFETCH", "0").strip().lower()
    if raw in ("", "0", "off", "false", "no"):
        return 0
    if raw in ("1", "on", "true", "yes"):
        return 32
    try:
        return max(0, int(raw))
    except ValueError:
        raise ValueError(f"REALTIME_L2_PREFETCH must be 0/1 or a budget in MB, got {raw!r}") from None


_BUDGET_MB = _env_mb()


def use_l2_prefetch(budget_mb: int | None = None) -> int:
    """The decode step's prefetch budget in MB per issue (0 = off); ``budget_mb`` sets it.

    From REALTIME_L2_PREFETCH: 0 (default, off), 1 (32 MB), or a number of MB. Read when a step
    runs (or is captured): a CUDA graph keeps what was set at capture."""
    global _BUDGET_MB
    if budget_mb is not None:
        check(budget_mb >= 0, f"the prefetch budget must be >= 0 MB, got {budget_mb}")
        _BUDGET_MB = int(budget_mb)
    return _BUDGET_MB


def supported(t: Tensor) -> bool:
    """Whether ``l2_prefetch`` issues anything for ``t``: a CUDA tensor on sm90+ with Triton (not
    the interpreter), its data 16-byte aligned."""
    if not (t.is_cuda and triton_available()) or interpret_mode():
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _capability(index) >= (9, 0) and t.data_ptr() % 16 == 0


@functools.cache
def _kernel():
    global triton, tl  # the jit'd function resolves `tl` through module globals
    import triton
    import triton.language as tl

    @triton.jit
    def _prefetch_kernel(
        base_ptr,  # *u8, 16-byte aligned: the first byte to fetch
        nbytes,  # bytes to fetch from base_ptr (i64)
        CHUNK: tl.constexpr,  # bytes per instruction, a multiple of 16
        BLOCK: tl.constexpr,  # chunks per program
    ):
        # Each lane issues one bulk L2 prefetch of up to CHUNK bytes (the tail clipped down to a
        # multiple of 16; lanes past the end issue nothing). No value comes back: the asm's output
        # is a dummy, and the asm is impure so it is not removed.
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        off = idx * CHUNK
        size = tl.minimum(tl.maximum(nbytes - off, 0), CHUNK).to(tl.int32) // 16 * 16
        tl.inline_asm_elementwise(
            asm="""{
            .reg .pred p;
            setp.gt.s32 p, $2, 0;
            @p cp.async.bulk.prefetch.L2.global [$1], $2;
            mov.u32 $0, 0;
            }""",
            constraints="=r,l,r", args=[base_ptr + off, size], dtype=tl.int32, is_pure=False, pack=1)

    return _prefetch_kernel


def l2_prefetch(t: Tensor, max_bytes: int | None = None) -> int:
    """Ask the L2 to fetch ``t``'s storage (its first ``max_bytes`` at most) on the current stream;
    returns the bytes requested (0 where unsupported: see ``supported``). ``t`` must be contiguous."""
    check(t.is_contiguous(), "l2_prefetch needs a contiguous tensor")
    if not supported(t):
        return 0
    nbytes = t.numel() * t.element_size()
    if max_bytes is not None:
        nbytes = min(nbytes, max_bytes)
    nbytes = nbytes // 16 * 16
    if nbytes <= 0:
        return 0
    kernel = _kernel()
    grid = (triton.cdiv(triton.cdiv(nbytes, CHUNK_BYTES), _BLOCK),)
    kernel[grid](t.view(-1).view(torch.uint8), nbytes, CHUNK=CHUNK_BYTES, BLOCK=_BLOCK, num_warps=_BLOCK // 32)
    return nbytes


_local = threading.local()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per (thread, device): two threads capturing graphs at once (the speech and
    text lanes at startup) must not fork their branches from the same stream."""
    streams = _local.__dict__.setdefault("streams", {})
    if device not in streams:
        streams[device] = torch.cuda.Stream(device=device)
    return streams[device]


class Prefetcher:
    """Prefetches issued on a side stream beside one decode step, within a byte budget per issue.

        pf = Prefetcher.for_step(x)       # None when the budget is 0 or x is not on sm90+ CUDA
        pf.issue(w1, w2)                  # after the kernel they may overlap has been launched
        pf.join()                         # before the step ends (and before a graph capture ends)

    ``issue`` forks the side stream from the compute stream's current point: the prefetches start
    when the work launched so far has finished, and run beside what is launched after. Inside a
    CUDA graph capture each issue becomes a branch of the graph; ``join`` makes the compute stream
    wait for the branches (required before the capture ends)."""

    def __init__(self, device: torch.device, budget_bytes: int) -> None:
        self.main = torch.cuda.current_stream(device)
        self.side = _side_stream(device)
        self.budget = budget_bytes
        self.issued = 0  # bytes requested so far (the bench reports it)
        self._open = False

    @classmethod
    def for_step(cls, x: Tensor) -> "Prefetcher | None":
        mb = use_l2_prefetch()
        if mb <= 0 or not supported(x):
            return None
        return cls(x.device, mb << 20)

    def issue(self, *tensors: Tensor) -> None:
        """Prefetch ``tensors`` in order until the budget is used (the last one possibly in part)."""
        self.side.wait_stream(self.main)
        left = self.budget
        with torch.cuda.stream(self.side):
            for t in tensors:
                if left <= 0:
                    break
                left -= l2_prefetch(t, left)
        self.issued += self.budget - left
        self._open = True

    def join(self) -> None:
        if self._open:
            self.main.wait_stream(self.side)
            self._open = False
