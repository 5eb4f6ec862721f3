"""Skinny GEMM for decode (M <= 4 rows) as a Triton GEMV, with SwiGLU or GELU optionally fused in.

    linear:  y = x @ w.T (+ bias)                      x [M, K], w [N, K] (nn.Linear layout) -> y [M, N]
    swiglu:  y = silu(x @ wg.T) * (x @ wu.T)           w = [wg | wu] stacked on N (2I rows) -> y [M, I]
    linear_gelu: y = gelu(x @ w.T (+ bias))            exact (erf) or tanh-approximated, as F.gelu
    linear_partials: the K range split S ways          -> float32 partial sums [S, M, N] (``Partials``)

At batch 1 a decode step is all matrix-vector products, bound by reading the weights once. The
CSM depth decoder's matrices are small (2-34 MB) and run ~600 times a frame, where a GEMM launch's
latency, not bandwidth, sets the time; the fused SwiGLU also drops two elementwise kernels and the
[M, 2I] intermediate. Two kernels: elementwise FMAs (no matrix units), and one that pads the rows
to 16 and uses tl.dot so Triton software-pipelines the K loop. Whether either beats cuBLAS for a
shape is measured, not assumed: ``faster_than_library`` times cuBLAS and a few configurations
inside CUDA graphs on weights read from HBM, and the engines keep the winner per shape.

Split K: a tall-K, short-N product (the MLP's down projection, 8192 -> 1024) has too few output
rows to keep the SMs busy, and cuBLAS answers with a split-K GEMM plus a second reduce kernel.
``linear_partials`` splits K over a second grid axis and leaves the S float32 partial sums to the
consumer: the decode loop's residual-add + RMSNorm sums them (``rmsnorm.add_rmsnorm_partials``),
so the reduction costs no launch of its own. Only where ``faster_than_library(..., partials=True)``
measured it faster; the sum is rounded to the activation dtype before the residual add, as the
plain output would be.

Numerics: float32 accumulation (another summation order than cuBLAS: not bit-equal, within the
rounding of the output dtype); the bias is added in float32; for SwiGLU, gate and up are each
rounded to the output dtype, then silu is rounded, then the product, exactly as the eager
``F.silu(gate) * up`` over bf16 GEMM outputs rounds them; for GELU the product is rounded to the
output dtype, then GELU runs in float32 and is rounded once, as ``F.gelu`` over a GEMM output does.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._triton import check, graph_time, pdl_jit, pdl_launch, use_triton

__all__ = ["MAX_M", "Partials", "linear", "swiglu", "linear_gelu", "linear_partials", "linear_ref", "swiglu_ref",
           "linear_gelu_ref", "faster_than_library", "choices"]

MAX_M = 4  # rows handled by the GEMV; more rows go to the library GEMM (the callers check)
_TILE = 8192  # weight elements per program per K step (16 KB of bf16 in flight)


class Partials(NamedTuple):
    """Split-K partial sums of ``x @ w.T``: ``sums`` [S, M, N] float32; the product is
    ``sums.sum(0)`` rounded to ``dtype``."""

    sums: Tensor
    dtype: torch.dtype

    def total(self) -> Tensor:
        """The product itself [M, N] (the PyTorch sum; the kernels' consumers sum in order)."""
        return self.sums.sum(0).to(self.dtype)


def linear_ref(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """PyTorch reference: x [M, K], w [N, K], bias [N] or None -> [M, N]."""
    return F.linear(x, w, bias)


def swiglu_ref(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """PyTorch reference: x [M, K], w [2I, K] = [gate | up] -> silu(gate) * up [M, I]."""
    gate, up = F.linear(x, w, bias).chunk(2, dim=-1)
    return F.silu(gate) * up


# GELU forms the epilogue knows, by F.gelu's ``approximate`` argument (0: no GELU).
_GELU = {"none": 1, "tanh": 2}


def linear_gelu_ref(x: Tensor, w: Tensor, bias: Tensor | None = None, approximate: str = "none") -> Tensor:
    """PyTorch reference: x [M, K], w [N, K] -> F.gelu(x @ w.T + bias, approximate) [M, N]."""
    return F.gelu(F.linear(x, w, bias), approximate=approximate)


@functools.cache
def _kernels():
    global triton, tl, _epilogue, _w_tiles, _fma_step, _dot_step, _pdl_enter  # the jit'd functions resolve these through module globals
    import triton
    import triton.language as tl
    _pdl_enter = pdl_jit()

    @triton.jit
    def _epilogue(y, u, b_ptr, y_ptr, rm, rn, mm, nm, N, stride_ym, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
                  GELU: tl.constexpr):
        # y, u [BLOCK_M, BLOCK_N] float32 sums of the gate (or only) and up products.
        out_t = y_ptr.dtype.element_ty
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            if HAS_BIAS:
                u += tl.load(b_ptr + N + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
            g = y.to(out_t).to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(out_t).to(tl.float32)
            y = s * u.to(out_t).to(tl.float32)
        if GELU == 1:  # exact: x/2 (1 + erf(x / sqrt 2)) on the rounded product
            g = y.to(out_t).to(tl.float32)
            y = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
        if GELU == 2:  # tanh form: x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), tanh(z) = 2 sigmoid(2z) - 1
            g = y.to(out_t).to(tl.float32)
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            y = 0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * z)) - 1.0))
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y.to(out_t), mask=mm[:, None] & nm[None, :])

    @triton.jit
    def _w_tiles(w_rows, up_rows, rk, km, nm, SWIGLU: tl.constexpr):
        # One K step's weight tile (and the up tile for SwiGLU; else the same tile, unused).
        w = tl.load(w_rows + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        wu = w
        if SWIGLU:
            wu = tl.load(up_rows + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        return w, wu

    @triton.jit
    def _fma_step(acc, acc_up, x_ptr, rm, mm, stride_xm, rk, km, w, wu, SWIGLU: tl.constexpr):
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        x = x.to(tl.float32)[:, None, :]
        acc += x * w.to(tl.float32)[None, :, :]
        if SWIGLU:
            acc_up += x * wu.to(tl.float32)[None, :, :]
        return acc, acc_up

    @triton.jit
    def _dot_step(acc, acc_up, x_ptr, rm, mm, stride_xm, rk, km, w, wu, SWIGLU: tl.constexpr, DOT_F32: tl.constexpr):
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        if DOT_F32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
            wu = wu.to(tl.float32)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee" if DOT_F32 else "tf32")
        if SWIGLU:
            acc_up += tl.dot(x, tl.trans(wu), input_precision="ieee" if DOT_F32 else "tf32")
        return acc, acc_up

    @triton.jit
    def _gemv_kernel(
        x_ptr,  # *x [M, K], row stride stride_xm, unit column stride
        w_ptr,  # *w [N or 2N, K], row stride stride_wn, unit column stride
        b_ptr,  # *bias [N or 2N] (read only when HAS_BIAS)
        y_ptr,  # *y [M, N] output, row stride stride_ym
        M, N, K,
        stride_xm, stride_wn, stride_ym,
        stride_ys,  # between the split-K partial outputs (program axis 1); 0 without a split
        K_PER,  # K columns per split (a multiple of BLOCK_K); >= K without a split
        HAS_BIAS: tl.constexpr,
        SWIGLU: tl.constexpr,  # w holds gate rows [0, N) and up rows [N, 2N)
        GELU: tl.constexpr,  # 0: none, 1: exact GELU, 2: tanh GELU of the product (``_GELU``)
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        K_STEPS: tl.constexpr,  # cdiv(K_PER, BLOCK_K): a constexpr trip count (the CPU interpreter needs one)
        PDL: tl.constexpr = False,  # launched with programmatic dependent launch (see _triton.pdl)
    ):
        # Elementwise products accumulated across K steps, reduced once at the end.
        pid = tl.program_id(0)
        k0 = tl.program_id(1) * K_PER
        y_ptr += tl.program_id(1).to(tl.int64) * stride_ys
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        nm = rn < N
        mm = rm < M
        w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
        up_rows = w_rows + N.to(tl.int64) * stride_wn
        # The first step's weights do not depend on the kernel before: they are requested before
        # waiting for it (with PDL, while it finishes).
        rk = k0 + tl.arange(0, BLOCK_K)
        km = rk < K
        w, wu = _w_tiles(w_rows, up_rows, rk, km, nm, SWIGLU)
        _pdl_enter(PDL)
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
        acc, acc_up = _fma_step(acc, acc_up, x_ptr, rm, mm, stride_xm, rk, km, w, wu, SWIGLU)
        for i in range(1, K_STEPS):
            rk = k0 + i * BLOCK_K + tl.arange(0, BLOCK_K)
            km = rk < K
            w, wu = _w_tiles(w_rows, up_rows, rk, km, nm, SWIGLU)
            acc, acc_up = _fma_step(acc, acc_up, x_ptr, rm, mm, stride_xm, rk, km, w, wu, SWIGLU)
        _epilogue(tl.sum(acc, axis=2), tl.sum(acc_up, axis=2), b_ptr, y_ptr, rm, rn, mm, nm, N, stride_ym,
                  HAS_BIAS, SWIGLU, GELU)

    @triton.jit
    def _gemv_dot_kernel(
        x_ptr,  # *x [M, K] (M <= 16), row stride stride_xm, unit column stride
        w_ptr,  # *w [N or 2N, K], row stride stride_wn, unit column stride
        b_ptr,  # *bias [N or 2N] (read only when HAS_BIAS)
        y_ptr,  # *y [M, N] output, row stride stride_ym
        M, N, K,
        stride_xm, stride_wn, stride_ym,
        stride_ys,  # between the split-K partial outputs (program axis 1); 0 without a split
        K_PER,  # K columns per split (a multiple of BLOCK_K); >= K without a split
        HAS_BIAS: tl.constexpr,
        SWIGLU: tl.constexpr,
        GELU: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        K_STEPS: tl.constexpr,
        DOT_F32: tl.constexpr,  # dot in float32 (float32 weights, or the CPU interpreter)
        PDL: tl.constexpr = False,  # launched with programmatic dependent launch (see _triton.pdl)
    ):
        # The rows padded to 16 and multiplied on the matrix units: the K loop is software-pipelined
        # (num_stages), which keeps several weight tiles in flight per program.
        pid = tl.program_id(0)
        k0 = tl.program_id(1) * K_PER
        y_ptr += tl.program_id(1).to(tl.int64) * stride_ys
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, 16)
        nm = rn < N
        mm = rm < M
        w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
        up_rows = w_rows + N.to(tl.int64) * stride_wn
        # The first step's weights are requested before waiting for the kernel before (see above).
        rk = k0 + tl.arange(0, BLOCK_K)
        km = rk < K
        w, wu = _w_tiles(w_rows, up_rows, rk, km, nm, SWIGLU)
        _pdl_enter(PDL)
        acc = tl.zeros([16, BLOCK_N], tl.float32)
        acc_up = tl.zeros([16, BLOCK_N], tl.float32)
        acc, acc_up = _dot_step(acc, acc_up, x_ptr, rm, mm, stride_xm, rk, km, w, wu, SWIGLU, DOT_F32)
        for i in range(1, K_STEPS):
            rk = k0 + i * BLOCK_K + tl.arange(0, BLOCK_K)
            km = rk < K
            w, wu = _w_tiles(w_rows, up_rows, rk, km, nm, SWIGLU)
            acc, acc_up = _dot_step(acc, acc_up, x_ptr, rm, mm, stride_xm, rk, km, w, wu, SWIGLU, DOT_F32)
        _epilogue(acc, acc_up, b_ptr, y_ptr, rm, rn, mm, nm, N, stride_ym, HAS_BIAS, SWIGLU, GELU)

    return _gemv_kernel, _gemv_dot_kernel


# A launch configuration: (kind, BLOCK_N, BLOCK_K, num_warps, num_stages[, splits]); kind "fma"
# (elementwise) or "dot" (matrix units, rows padded to 16); splits > 1 (only for ``linear_partials``)
# divides K among that many programs per output tile.
Config = tuple


def _splits(cfg: Config) -> int:
    return cfg[5] if len(cfg) > 5 else 1


def _default_config(n: int) -> Config:
    """The elementwise kernel with enough programs to cover the SMs (~128+), 16 KB of weights a
    step for one row (``_launch`` divides BLOCK_K by the padded row count)."""
    block_n = max(4, min(32, 1 << max(0, (n // 128).bit_length() - 1)))
    return ("fma", block_n, max(32, _TILE // block_n), 8, 1)


def _candidates(n: int, k: int | None = None, partials: bool = False) -> list[Config]:
    """What ``faster_than_library`` times for one row: the default and pipelined matrix-unit tiles;
    with ``partials``, also split-K tiles where a split still gets a few K steps (K >= 1024 a split)."""
    fma = _default_config(n)
    out: list[Config] = [fma, ("fma", max(4, fma[1] // 2), fma[2], 4, 1),
                         ("dot", 16, 128, 4, 4), ("dot", 16, 256, 4, 3), ("dot", 32, 128, 4, 4), ("dot", 64, 64, 4, 4),
                         # more bytes in flight per program (3-6 stages of 16-32 KB tiles) for the large products
                         ("dot", 32, 256, 4, 3), ("dot", 64, 128, 4, 3), ("dot", 64, 64, 4, 6)]
    if partials and k is not None:
        for splits in (2, 4, 8):
            if k // splits >= 1024:
                out += [("dot", 16, 128, 4, 4, splits), ("dot", 32, 128, 4, 4, splits), ("fma", 8, 1024, 4, 1, splits),
                        ("dot", 64, 64, 4, 4, splits)]
    return out


_best: dict[tuple, Config] = {}  # per weight key: the fastest configuration measured


def _splittable(bias: Tensor | None, swiglu: bool, gelu: str | None) -> bool:
    """Split-K partials exist only for a plain product: no bias, no activation."""
    return bias is None and not swiglu and gelu is None


def _key(w: Tensor, bias: Tensor | None, swiglu: bool, partials: bool = False, gelu: str | None = None) -> tuple:
    # Other products than a plain one ignore the partials flag.
    return (tuple(w.shape), w.dtype, bias is not None, swiglu, w.device, partials and _splittable(bias, swiglu, gelu), gelu)


def _launch(x: Tensor, w: Tensor, bias: Tensor | None, n_out: int, swiglu: bool, cfg: Config | None = None,
            partials: bool = False, gelu: str | None = None) -> Tensor:
    """The product [M, n_out] in x's dtype (``gelu``: its GELU, F.gelu's ``approximate``), or with a
    split configuration the float32 partial sums [S, M, n_out] (``partials`` must then be True: only
    a consumer that sums them may get them)."""
    check(x.dim() == 2 and w.dim() == 2, f"x must be [M, K] and w [N, K], got {tuple(x.shape)}, {tuple(w.shape)}")
    m, k = x.shape
    check(1 <= m <= MAX_M, f"the GEMV takes 1..{MAX_M} rows, got {m}")
    check(w.shape[1] == k, f"w {tuple(w.shape)} must have K={k} columns")
    check(x.dtype == w.dtype and x.is_floating_point(), f"x and w must share a float dtype, got {x.dtype}, {w.dtype}")
    check(x.stride(-1) == 1 and w.stride(-1) == 1, "x and w need a unit stride over K")
    if bias is not None:
        check(bias.shape == (w.shape[0],) and bias.is_contiguous(), f"bias must be [{w.shape[0]}], got {tuple(bias.shape)}")
    check(gelu is None or gelu in _GELU, f"gelu must be one of {sorted(_GELU)} or None, got {gelu!r}")
    fma_kernel, dot_kernel = _kernels()
    if cfg is None:
        cfg = _best.get(_key(w, bias, swiglu, partials, gelu)) or _default_config(n_out)
    kind, bn, bk, warps, stages = cfg[:5]
    splits = _splits(cfg)
    if splits > 1:
        check(partials and _splittable(bias, swiglu, gelu), "a split-K configuration gives partial sums: linear_partials only")
    if kind == "fma":
        bm = triton.next_power_of_2(m)
        bk = max(32, bk // bm)  # the same registers for more rows
    k_per = triton.cdiv(triton.cdiv(k, splits), bk) * bk  # whole K steps per split
    splits = triton.cdiv(k, k_per)
    if splits > 1:
        y = torch.empty((splits, m, n_out), device=x.device, dtype=torch.float32)
        stride_ys = y.stride(0)
    else:
        y = torch.empty((m, n_out), device=x.device, dtype=x.dtype)
        stride_ys = 0
    args = (x, w, bias if bias is not None else w, y, m, n_out, k, x.stride(0), w.stride(0), y.stride(-2),
            stride_ys, k_per)
    grid = (triton.cdiv(n_out, bn), splits)
    if kind == "dot":
        # The CPU interpreter multiplies bf16 dot operands as raw bits: it dots in float32.
        f32 = x.dtype == torch.float32 or not x.is_cuda
        dot_kernel[grid](*args, HAS_BIAS=bias is not None, SWIGLU=swiglu, GELU=_GELU.get(gelu, 0), BLOCK_N=bn, BLOCK_K=bk,
                         K_STEPS=k_per // bk, DOT_F32=f32, num_warps=warps, num_stages=stages, **pdl_launch(x))
    else:
        fma_kernel[grid](*args, HAS_BIAS=bias is not None, SWIGLU=swiglu, GELU=_GELU.get(gelu, 0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                         K_STEPS=k_per // bk, num_warps=warps, num_stages=stages, **pdl_launch(x))
    return y


def linear(x: Tensor, w: Tensor, bias: Tensor | None = None, config: Config | None = None) -> Tensor:
    """x [M, K] (M <= MAX_M), w [N, K], bias [N] or None -> x @ w.T + bias [M, N] in x's dtype.

    ``config`` forces a launch configuration (tests); by default the one ``faster_than_library``
    measured fastest for this weight's shape, else the elementwise kernel's default."""
    if not use_triton("gemv", x, w):
        return linear_ref(x, w, bias)
    return _launch(x, w, bias, w.shape[0], False, config)


def linear_partials(x: Tensor, w: Tensor, bias: Tensor | None = None, config: Config | None = None) -> Tensor | Partials:
    """``linear`` for a consumer that can sum split-K partials (``rmsnorm.add_rmsnorm_partials``):
    a ``Partials`` when the configuration (forced, or measured by ``faster_than_library(w, bias,
    partials=True)``) splits K, else the plain product [M, N]."""
    if not use_triton("gemv", x, w):
        return linear_ref(x, w, bias)
    y = _launch(x, w, bias, w.shape[0], False, config, partials=True)
    return Partials(y, x.dtype) if y.dim() == 3 else y


def swiglu(x: Tensor, w: Tensor, bias: Tensor | None = None, config: Config | None = None) -> Tensor:
    """x [M, K] (M <= MAX_M), w [2I, K] = [gate | up], bias [2I] or None -> silu(gate) * up [M, I]."""
    if not use_triton("gemv", x, w):
        return swiglu_ref(x, w, bias)
    check(w.shape[0] % 2 == 0, f"w must stack gate and up rows (2I), got {w.shape[0]} rows")
    return _launch(x, w, bias, w.shape[0] // 2, True, config)


def linear_gelu(x: Tensor, w: Tensor, bias: Tensor | None = None, approximate: str = "none",
                config: Config | None = None) -> Tensor:
    """x [M, K] (M <= MAX_M), w [N, K], bias [N] or None -> F.gelu(x @ w.T + bias, approximate) [M, N]
    in one launch (an MLP's first product: no separate GELU kernel)."""
    if not use_triton("gemv", x, w):
        return linear_gelu_ref(x, w, bias, approximate)
    return _launch(x, w, bias, w.shape[0], False, config, gelu=approximate)


_L2_FLUSH_BYTES = 192 << 20  # > 3x the H100/H200 L2: the timed weights come from HBM, as in a decode step


def faster_than_library(w: Tensor, bias: Tensor | None = None, swiglu: bool = False, partials: bool = False,
                        gelu: str | None = None) -> bool:
    """Whether the GEMV (optionally with SwiGLU, or GELU: F.gelu's ``approximate``) beats the library
    path (with the same activation after it) for one row on this weight.

    ``partials``: the caller takes ``linear_partials`` (its consumer sums split-K partials), so
    split-K configurations are timed too; the choice is kept apart from the plain one.

    Times cuBLAS (+ silu * mul) and each candidate configuration once per (shape, dtype, bias,
    swiglu, device) inside CUDA graphs, cycling over enough copies of the weight that it is read
    from HBM (a decode step's weights do not stay in L2), and keeps the fastest configuration for
    ``linear``/``swiglu``. False off CUDA or without Triton. Call outside graph capture (it syncs).
    """
    if not w.is_cuda or not use_triton("gemv", w):
        return False
    _kernels()
    key = _key(w, bias, swiglu, partials, gelu)
    if key not in _choice:
        copies = max(2, min(64, -(-_L2_FLUSH_BYTES // (w.numel() * w.element_size()))))
        ws = [w] + [w.clone() for _ in range(copies - 1)]
        x = torch.randn(1, w.shape[1], device=w.device, dtype=w.dtype)
        n_out = w.shape[0] // 2 if swiglu else w.shape[0]
        if gelu is not None:
            ref = functools.partial(linear_gelu_ref, approximate=gelu)
        else:
            ref = swiglu_ref if swiglu else linear_ref
        lib = graph_time([lambda wi=wi: ref(x, wi, bias) for wi in ws])
        best, best_t = None, lib
        split = key[5]
        for cfg in _candidates(n_out, w.shape[1], split):
            try:
                t = graph_time([lambda wi=wi, cfg=cfg: _launch(x, wi, bias, n_out, swiglu, cfg, split, gelu) for wi in ws])
            except Exception:  # a configuration that does not compile or launch here is skipped
                continue
            if t < best_t:
                best, best_t = cfg, t
        del ws
        _choice[key] = best is not None
        if best is not None:
            _best[key] = best
        _timings[key] = {"library_us": lib * 1e6, "best_us": best_t * 1e6, "config": best}
    return _choice[key]


_choice: dict[tuple, bool] = {}
_timings: dict[tuple, dict] = {}  # what the choice measured (benchmarks print it)


def choices() -> list[dict]:
    """The measured choices so far: shape, swiglu, library and best GEMV time (µs), configuration."""
    return [{"shape": list(k[0]), "dtype": str(k[1]).replace("torch.", ""), "bias": k[2], "swiglu": k[3],
             "partials": k[5], "gelu": k[6], **v, "gemv": _choice[k]} for k, v in _timings.items()]
