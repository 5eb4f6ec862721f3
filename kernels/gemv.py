"""Skinny GEMM for decode (M <= 4 rows) as a Triton GEMV, with SwiGLU optionally fused in.

    linear:  y = x @ w.T (+ bias)                      x [M, K], w [N, K] (nn.Linear layout) -> y [M, N]
    swiglu:  y = silu(x @ wg.T) * (x @ wu.T)           w = [wg | wu] stacked on N (2I rows) -> y [M, I]

At batch 1 a decode step is all matrix-vector products, bound by reading the weights once. The
CSM depth decoder's matrices are small (2-34 MB) and run ~600 times a frame, where a GEMM launch's
latency, not bandwidth, sets the time; the fused SwiGLU also drops two elementwise kernels and the
[M, 2I] intermediate. Whether this beats cuBLAS for a given shape is measured, not assumed:
``faster_than_library`` times both inside CUDA graphs and the engines keep the winner per shape.

Numerics: float32 accumulation (another summation order than cuBLAS: not bit-equal, within the
rounding of the output dtype); the bias is added in float32; for SwiGLU, gate and up are each
rounded to the output dtype, then silu is rounded, then the product, exactly as the eager
``F.silu(gate) * up`` over bf16 GEMM outputs rounds them.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from ._triton import check, use_triton

__all__ = ["MAX_M", "linear", "swiglu", "linear_ref", "swiglu_ref", "faster_than_library"]

MAX_M = 4  # rows handled by the GEMV; more rows go to the library GEMM (the callers check)
_TILE = 8192  # weight elements per program per K step (16 KB of bf16 in flight)


def linear_ref(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """PyTorch reference: x [M, K], w [N, K], bias [N] or None -> [M, N]."""
    return F.linear(x, w, bias)


def swiglu_ref(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """PyTorch reference: x [M, K], w [2I, K] = [gate | up] -> silu(gate) * up [M, I]."""
    gate, up = F.linear(x, w, bias).chunk(2, dim=-1)
    return F.silu(gate) * up


@functools.cache
def _kernels():
    global triton, tl  # the jit'd functions resolve `tl` through module globals
    import triton
    import triton.language as tl

    @triton.jit
    def _gemv_kernel(
        x_ptr,  # *x [M, K], row stride stride_xm, unit column stride
        w_ptr,  # *w [N or 2N, K], row stride stride_wn, unit column stride
        b_ptr,  # *bias [N or 2N] (read only when HAS_BIAS)
        y_ptr,  # *y [M, N] output, row stride stride_ym
        M, N, K,
        stride_xm, stride_wn, stride_ym,
        HAS_BIAS: tl.constexpr,
        SWIGLU: tl.constexpr,  # w holds gate rows [0, N) and up rows [N, 2N)
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        K_STEPS: tl.constexpr,  # cdiv(K, BLOCK_K): a constexpr trip count (the CPU interpreter needs one)
    ):
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        nm = rn < N
        mm = rm < M
        w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
        up_rows = w_rows + N.to(tl.int64) * stride_wn
        # Products accumulate elementwise across K steps and are reduced once at the end: the
        # loop body is loads and FMAs only.
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
        for i in range(K_STEPS):
            rk = i * BLOCK_K + tl.arange(0, BLOCK_K)
            km = rk < K
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
            x = x.to(tl.float32)[:, None, :]
            w = tl.load(w_rows + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            acc += x * w.to(tl.float32)[None, :, :]
            if SWIGLU:
                wu = tl.load(up_rows + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
                acc_up += x * wu.to(tl.float32)[None, :, :]
        out_t = y_ptr.dtype.element_ty
        y = tl.sum(acc, axis=2)
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            u = tl.sum(acc_up, axis=2)
            if HAS_BIAS:
                u += tl.load(b_ptr + N + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
            g = y.to(out_t).to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(out_t).to(tl.float32)
            y = s * u.to(out_t).to(tl.float32)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y.to(out_t), mask=mm[:, None] & nm[None, :])

    return _gemv_kernel


def _blocks(m: int, n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): enough programs to cover the SMs (~128+), 16 KB of weights each step."""
    block_m = triton.next_power_of_2(m)
    block_n = max(4, min(32, 1 << max(0, (n // 128).bit_length() - 1)))
    block_k = max(32, _TILE // (block_n * block_m))
    return block_m, block_n, block_k


def _launch(x: Tensor, w: Tensor, bias: Tensor | None, n_out: int, swiglu: bool) -> Tensor:
    check(x.dim() == 2 and w.dim() == 2, f"x must be [M, K] and w [N, K], got {tuple(x.shape)}, {tuple(w.shape)}")
    m, k = x.shape
    check(1 <= m <= MAX_M, f"the GEMV takes 1..{MAX_M} rows, got {m}")
    check(w.shape[1] == k, f"w {tuple(w.shape)} must have K={k} columns")
    check(x.dtype == w.dtype and x.is_floating_point(), f"x and w must share a float dtype, got {x.dtype}, {w.dtype}")
    check(x.stride(-1) == 1 and w.stride(-1) == 1, "x and w need a unit stride over K")
    if bias is not None:
        check(bias.shape == (w.shape[0],) and bias.is_contiguous(), f"bias must be [{w.shape[0]}], got {tuple(bias.shape)}")
    kernel = _kernels()
    y = torch.empty((m, n_out), device=x.device, dtype=x.dtype)
    bm, bn, bk = _blocks(m, n_out)
    kernel[(triton.cdiv(n_out, bn),)](
        x, w, bias if bias is not None else w, y, m, n_out, k,
        x.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, SWIGLU=swiglu, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, K_STEPS=triton.cdiv(k, bk),
        num_warps=8,
    )
    return y


def linear(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K] (M <= MAX_M), w [N, K], bias [N] or None -> x @ w.T + bias [M, N] in x's dtype."""
    if not use_triton("gemv", x, w):
        return linear_ref(x, w, bias)
    return _launch(x, w, bias, w.shape[0], swiglu=False)


def swiglu(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K] (M <= MAX_M), w [2I, K] = [gate | up], bias [2I] or None -> silu(gate) * up [M, I]."""
    if not use_triton("gemv", x, w):
        return swiglu_ref(x, w, bias)
    check(w.shape[0] % 2 == 0, f"w must stack gate and up rows (2I), got {w.shape[0]} rows")
    return _launch(x, w, bias, w.shape[0] // 2, swiglu=True)


def _graph_time(fn, reps: int = 20, rounds: int = 5) -> float:
    """Median seconds of one ``fn()`` replayed ``reps`` times inside a CUDA graph (no launch gaps)."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return sorted(times)[len(times) // 2]


_choice: dict[tuple, bool] = {}


def faster_than_library(w: Tensor, bias: Tensor | None = None, swiglu: bool = False) -> bool:
    """Whether the GEMV (optionally with SwiGLU) beats the library path for one row on this weight.

    Timed once per (shape, dtype, bias, swiglu, device) inside CUDA graphs on random inputs, and
    cached; False off CUDA or without Triton. Call outside graph capture (it synchronizes).
    """
    if not w.is_cuda or not use_triton("gemv", w):
        return False
    key = (tuple(w.shape), w.dtype, bias is not None, swiglu, w.device)
    if key not in _choice:
        x = torch.randn(1, w.shape[1], device=w.device, dtype=w.dtype)
        ours = (lambda: _launch(x, w, bias, w.shape[0] // 2, True)) if swiglu else (lambda: _launch(x, w, bias, w.shape[0], False))
        lib = (lambda: swiglu_ref(x, w, bias)) if swiglu else (lambda: linear_ref(x, w, bias))
        _choice[key] = _graph_time(ours) < _graph_time(lib)
    return _choice[key]
