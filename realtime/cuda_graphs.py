"""CUDA graphs per batch-size bucket for the speech hot path (eager stays available as a switch).

A step over B active slots replays the graph of the smallest bucket >= B; the rows past B point at
a scratch slot that no session owns, so padding never touches live state. Inputs are copied into
the graph's static buffers; outputs are read from its static output tensors. Graphs of all buckets
share one memory pool. Capture happens at warm-up, before the server accepts connections.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger("realtime.cuda_graphs")


@torch.no_grad()
def capture(run: Callable[[], object], pool=None, warmups: int = 2, device=None,  # noqa: ANN001, ANN201
            error_mode: str = "global"):
    """CUDA graph of ``run()`` in memory ``pool`` (None: a pool of its own) -> (graph, run's static
    output). The warm-up runs (on a side stream, as capture requires) compile kernels and allocate
    workspaces outside the graph; callers point the static inputs at padding (a scratch slot), so
    they touch no session. ``error_mode`` is torch's capture_error_mode ("thread_local" lets other
    threads keep using CUDA while this one captures)."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmups):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=error_mode):
        out = run()
    return graph, out


def buckets_up_to(n: int) -> list[int]:
    out, b = [], 1
    while b < n:
        out.append(b)
        b *= 2
    out.append(n)
    return out


class BucketGraphs:
    """``fn(*static_inputs) -> Tensor`` captured once per bucket.

    make_inputs(B) builds the static input tensors of bucket B (filled with padding values);
    after_step(B) runs inside the capture after ``fn`` (e.g. to keep the scratch slot in range).
    """

    def __init__(self, name: str, fn: Callable[..., torch.Tensor], make_inputs: Callable[[int], list[torch.Tensor]],
                 buckets: Sequence[int], after_step: Callable[[], None] | None = None) -> None:
        self.name = name
        self.fn = fn
        self.make_inputs = make_inputs
        self.buckets = sorted(buckets)
        self.after_step = after_step
        self.inputs: dict[int, list[torch.Tensor]] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _body(self, b: int) -> torch.Tensor:
        out = self.fn(*self.inputs[b])
        if self.after_step is not None:
            self.after_step()
        return out

    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for b in self.buckets:
            t0 = time.perf_counter()
            self.inputs[b] = self.make_inputs(b)
            self.graphs[b], self.outputs[b] = capture(lambda b=b: self._body(b), pool, warmups=2)
            log.info("captured %s for batch %d in %.2fs", self.name, b, time.perf_counter() - t0)
        torch.cuda.synchronize()

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{self.name}: batch {n} over the largest bucket {self.buckets[-1]}")

    def run(self, n: int, fill: Callable[[list[torch.Tensor]], None]) -> torch.Tensor:
        """Fill bucket(n)'s static inputs with ``fill`` (rows >= n must be padding), replay, return
        the static output (valid rows: the first n; read it before the next replay)."""
        b = self.bucket(n)
        fill(self.inputs[b])
        self.graphs[b].replay()
        return self.outputs[b]
