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

__all__ = ["CONFIGS", "l2_prefetch", "supported", "Prefetcher", "use_l2_prefetch"]



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


def use_l2_prefetch(budget_mb: int | None = None, config: str | None = None) -> int:
    """The decode step's prefetch budget in MB per issue (0 = off); ``budget_mb`` sets it, and
    ``config`` (a ``CONFIGS`` name) how the prefetch is issued.

    From REALTIME_L2_PREFETCH: 0 (default, off), 1 (32 MB), or a number of MB. Read when a step
    runs (or is captured): a CUDA graph keeps what was set at capture."""
    global _BUDGET_MB, _config
    if budget_mb is not None:
        check(budget_mb >= 0, f"the prefetch budget must be >= 0 MB, got {budget_mb}")
        _BUDGET_MB = int(budget_mb)
    if config is not None:
        check(config in CONFIGS, f"unknown prefetch config {config!r}; one of {sorted(CONFIGS)}")
        _config = CONFIGS[config]
    return _BUDGET_MB


def supported(t: Tensor) -> bool:
    """Whether ``l2_prefetch`` issues anything for ``t``: a CUDA tensor on sm90+ with Triton (not
    the interpreter), its data 16-byte aligned."""
    if not (t.is_cuda and triton_available()) or interpret_mode():
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _capability(index) >= (9, 0) and t.data_ptr() % 16 == 0


# A launch configuration: (mode, bytes per lane or program, lanes per program, warps).
#   "bulk": each lane one ``cp.async.bulk.prefetch.L2`` of up to CHUNK bytes (sm90's TMA unit);
#   "line": each lane one ``prefetch.global.L2`` of a 128-byte line (the load/store unit);
#   "load": each program reads CHUNK bytes into registers and keeps one word (plain loads: the
#           bytes go through the SM, like the GEMV's own reads).
Config = tuple
CONFIGS: dict[str, Config] = {
    "bulk16k": ("bulk", 16 << 10, 4, 1), "bulk4k": ("bulk", 4 << 10, 4, 1), "bulk64k": ("bulk", 64 << 10, 1, 1),
    "line": ("line", 128, 512, 4), "load": ("load", 16 << 10, 4096, 4),
}
_config: Config = CONFIGS["bulk16k"]


@functools.cache
def _kernel():
    global triton, tl  # the jit'd function resolves `tl` through module globals
    import triton
    import triton.language as tl

    @triton.jit
    def _prefetch_kernel(
        base_ptr,  # *u8, 16-byte aligned: the first byte to fetch
        nbytes,  # bytes to fetch from base_ptr (i64)
        sink_ptr,  # *i32 [programs]: "load" mode's one word per program (unused otherwise)
        MODE: tl.constexpr,  # 0 bulk, 1 line, 2 load
        CHUNK: tl.constexpr,  # bytes per lane (bulk: a multiple of 16; line: 128) or per program (load)
        BLOCK: tl.constexpr,  # lanes per program (load: 32-bit words per program, CHUNK // 4)
    ):
        pid = tl.program_id(0).to(tl.int64)
        if MODE == 2:
            # Plain loads: the words are read and folded into one, stored so the loads stay.
            words = base_ptr.to(tl.pointer_type(tl.int32))
            offs = pid * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(words + offs, mask=offs < nbytes // 4, other=0)
            tl.store(sink_ptr + pid, tl.xor_sum(x, 0))
        else:
            # One instruction per lane; lanes past the end issue nothing. No value comes back: the
            # asm's output is a dummy, and the asm is impure so it is not removed.
            off = (pid * BLOCK + tl.arange(0, BLOCK)) * CHUNK
            size = tl.minimum(tl.maximum(nbytes - off, 0), CHUNK).to(tl.int32) // 16 * 16
            if MODE == 0:
                tl.inline_asm_elementwise(
                    asm="""{
                    .reg .pred p;
                    setp.gt.s32 p, $2, 0;
                    @p cp.async.bulk.prefetch.L2.global [$1], $2;
                    mov.u32 $0, 0;
                    }""",
                    constraints="=r,l,r", args=[base_ptr + off, size], dtype=tl.int32, is_pure=False, pack=1)
            else:
                tl.inline_asm_elementwise(
                    asm="""{
                    .reg .pred p;
                    setp.gt.s32 p, $2, 0;
                    @p prefetch.global.L2 [$1];
                    mov.u32 $0, 0;
                    }""",
                    constraints="=r,l,r", args=[base_ptr + off, size], dtype=tl.int32, is_pure=False, pack=1)

    return _prefetch_kernel


def l2_prefetch(t: Tensor, max_bytes: int | None = None, config: Config | None = None) -> int:
    """Ask the L2 to fetch ``t``'s storage (its first ``max_bytes`` at most) on the current stream;
    returns the bytes requested (0 where unsupported: see ``supported``). ``t`` must be contiguous.
    ``config``: one of ``CONFIGS`` (default: the one ``use_l2_prefetch`` set)."""
    check(t.is_contiguous(), "l2_prefetch needs a contiguous tensor")
    if not supported(t):
        return 0
    nbytes = t.numel() * t.element_size()
    if max_bytes is not None:
        nbytes = min(nbytes, max_bytes)
    nbytes = nbytes // 16 * 16
    if nbytes <= 0:
        return 0
    mode, chunk, block, warps = config or _config
    kernel = _kernel()
    per_program = chunk if mode == "load" else chunk * block
    grid = (triton.cdiv(nbytes, per_program),)
    sink = _sink(t.device, grid[0]) if mode == "load" else t
    kernel[grid](t.view(-1).view(torch.uint8), nbytes, sink, MODE=("bulk", "line", "load").index(mode), CHUNK=chunk,
                 BLOCK=chunk // 4 if mode == "load" else block, num_warps=warps)
    return nbytes


_sinks: dict[torch.device, Tensor] = {}


def _sink(device: torch.device, n: int) -> Tensor:
    """A scratch word per program for "load" mode (grown, never shrunk: graphs keep its address)."""
    if device not in _sinks or _sinks[device].numel() < n:
        _sinks[device] = torch.empty(max(n, 4096), dtype=torch.int32, device=device)
    return _sinks[device]


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
