"""RMSNorm and fused residual-add + RMSNorm (one row per program), HF LlamaRMSNorm semantics.

    y = weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)

Statistics in float32; the normalised row is rounded to x's dtype before the weight multiply, as
HF does, so bf16 results match the PyTorch module to the last bit up to rsqrt/summation order.
Output dtype = promote(x.dtype, weight.dtype) (= x.dtype in the usual same-dtype case).

``add_rmsnorm_partials`` takes the sublayer output as split-K float32 partial sums [S, R, D] (see
``gemv.linear_partials``): it sums them in order, rounds the sum to the residual's dtype (what the
plain GEMV would have stored), then adds and normalises as ``add_rmsnorm`` does.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ._triton import check, pdl_jit, pdl_launch, use_triton

__all__ = ["rmsnorm", "add_rmsnorm", "add_rmsnorm_partials", "rmsnorm_ref", "add_rmsnorm_ref", "add_rmsnorm_partials_ref"]

_MAX_D = 32768  # one row lives in one block's registers


def rmsnorm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """PyTorch reference: x [..., D], weight [D] -> y [..., D]."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rmsnorm_ref(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """PyTorch reference: (rmsnorm(x + residual), x + residual); the sum is rounded to x.dtype."""
    s = x + residual
    return rmsnorm_ref(s, weight, eps), s


def add_rmsnorm_partials_ref(parts: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """PyTorch reference: ``add_rmsnorm`` of (the partials' sum rounded to residual's dtype, residual)."""
    return add_rmsnorm_ref(parts.sum(0).to(residual.dtype), residual, weight, eps)


@functools.cache
def _kernels():
    global triton, tl, _pdl_enter  # the jit'd functions resolve `tl` through module globals
    import triton
    import triton.language as tl
    _pdl_enter = pdl_jit()

    @triton.jit
    def _rmsnorm_kernel(
        x_ptr,  # *x [R, D] rows, row stride stride_x, unit column stride
        r_ptr,  # *residual [R, D] (read only when HAS_RESIDUAL)
        w_ptr,  # *weight [D]
        y_ptr,  # *y [R, D] output, contiguous
        s_ptr,  # *new residual [R, D] output (written only when HAS_RESIDUAL), contiguous
        D,
        stride_x,
        stride_r,
        stride_p,  # between the partial sums of x (N_PARTS > 0)
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK_D: tl.constexpr,
        N_PARTS: tl.constexpr = 0,  # > 0: x is that many float32 partial sums, summed in order here
        PDL: tl.constexpr = False,  # launched with programmatic dependent launch (see _triton.pdl)
    ):
        _pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        m = cols < D
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
        for i in tl.static_range(1, N_PARTS):  # the other partial sums (none without partials)
            x += tl.load(x_ptr + i * stride_p + row * stride_x + cols, mask=m, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + row * stride_r + cols, mask=m, other=0.0)
            if N_PARTS > 0:
                x = x.to(r.dtype)  # the product as the plain GEMV stores it
            # Round the sum to the activation dtype like `x + residual` in PyTorch, then normalise that.
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(s_ptr + row * D + cols, x, mask=m)
        h = x.to(tl.float32)
        var = tl.sum(h * h, axis=0) / D
        h = h * tl.math.rsqrt(var + eps)
        w = tl.load(w_ptr + cols, mask=m, other=0.0)
        # HF: weight * h.to(input_dtype): round to x's dtype first, multiply, round to the output dtype.
        y = h.to(x.dtype).to(tl.float32) * w.to(tl.float32)
        tl.store(y_ptr + row * D + cols, y.to(y_ptr.dtype.element_ty), mask=m)

    return _rmsnorm_kernel


def _launch(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float,
            parts: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    if parts is not None:  # x is the residual; it stands for parts.sum(0) rounded to the residual's dtype
        assert x is residual
        check(parts.dim() >= 2 and parts.dtype == torch.float32 and parts.is_contiguous(),
              f"partials must be contiguous float32 [S, ..., D], got {parts.dtype} {tuple(parts.shape)}")
        check(tuple(parts.shape[1:]) == tuple(residual.shape), f"partials {tuple(parts.shape)} must be [S, *{tuple(residual.shape)}]")
    d = x.shape[-1]
    check(x.dim() >= 1 and x.is_floating_point(), f"x must be a float tensor [..., D], got {x.dtype} {tuple(x.shape)}")
    check(weight.shape == (d,), f"weight must be [D={d}], got {tuple(weight.shape)}")
    check(weight.is_floating_point(), f"weight must be float, got {weight.dtype}")
    check(x.is_contiguous(), "x must be contiguous")
    check(weight.is_contiguous(), "weight must be contiguous")
    check(0 < d <= _MAX_D, f"D must be in [1, {_MAX_D}], got {d}")
    if residual is not None:
        check(residual.shape == x.shape, f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
        check(residual.dtype == x.dtype, f"residual dtype {residual.dtype} must match x {x.dtype}")
        check(residual.is_contiguous(), "residual must be contiguous")
    kernel = _kernels()
    x2 = x.view(-1, d)
    rows = x2.shape[0]
    y = torch.empty(x.shape, device=x.device, dtype=torch.promote_types(x.dtype, weight.dtype))
    s = torch.empty_like(x) if residual is not None else None
    if rows == 0:
        return y, s
    block = triton.next_power_of_2(d)
    # Roughly 8 elements per thread; more warps only for long rows.
    warps = max(1, min(16, block // 256))
    r2 = residual.view(-1, d) if residual is not None else x2
    src = parts.view(parts.shape[0], -1, d) if parts is not None else x2
    kernel[(rows,)](
        src, r2, weight, y, s if s is not None else y, d, src.stride(-2), r2.stride(0),
        src.stride(0) if parts is not None else 0, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK_D=block, N_PARTS=parts.shape[0] if parts is not None else 0,
        num_warps=warps, **pdl_launch(x),
    )
    return y, s


def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., D], weight [D] -> y [..., D] (dtype promote(x, weight)). Triton kernel, else the reference."""
    if not use_triton("rmsnorm", x, weight):
        return rmsnorm_ref(x, weight, eps)
    return _launch(x, None, weight, eps)[0]


def add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Fused s = x + residual; y = rmsnorm(s). x, residual [..., D], weight [D] -> (y, s), both [..., D]."""
    if not use_triton("add_rmsnorm", x, residual, weight):
        return add_rmsnorm_ref(x, residual, weight, eps)
    y, s = _launch(x, residual, weight, eps)
    assert s is not None
    return y, s


def add_rmsnorm_partials(parts: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``add_rmsnorm(parts.sum(0).to(residual.dtype), residual, ...)`` in one kernel: parts [S, ..., D]
    float32 split-K partial sums (``gemv.linear_partials``), residual [..., D] -> (y, new residual)."""
    if not use_triton("add_rmsnorm", parts, residual, weight):
        return add_rmsnorm_partials_ref(parts, residual, weight, eps)
    y, s = _launch(residual, residual, weight, eps, parts)
    assert s is not None
    return y, s
