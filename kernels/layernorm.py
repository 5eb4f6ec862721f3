"""LayerScale residual add fused with the LayerNorm that follows it (one row per program).

Mimi's transformer layers end each sublayer with ``x = x + scale * h`` (LayerScale, an addcmul) and
start the next one with a LayerNorm of that x: two kernels of a few µs each on the H200, 16 times a
decode step. This kernel does both:

    s = (x + scale * h) rounded to x's dtype      (what addcmul stores)
    y = (s - mean(s)) * rsqrt(var(s) + eps) * weight + bias   (statistics in float32, as torch's)

and returns (y, s). Statistics are two-pass (mean, then the centred variance) over the rounded s;
torch's LayerNorm uses Welford, so the two agree to float32 rounding of the statistics.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from ._triton import check, pdl_jit, pdl_launch, use_triton

__all__ = ["scale_add_layernorm", "scale_add_layernorm_ref"]

_MAX_D = 16384


def scale_add_layernorm_ref(x: Tensor, h: Tensor, scale: Tensor, weight: Tensor, bias: Tensor | None,
                            eps: float) -> tuple[Tensor, Tensor]:
    """PyTorch reference: (layer_norm(x + scale * h), x + scale * h); x, h [..., D]."""
    s = torch.addcmul(x, scale, h)
    return F.layer_norm(s, s.shape[-1:], weight, bias, eps), s


@functools.cache
def _kernel():
    global triton, tl, _pdl_enter  # the jit'd function resolves `tl` through module globals
    import triton
    import triton.language as tl
    _pdl_enter = pdl_jit()

    @triton.jit
    def _scale_add_layernorm_kernel(
        x_ptr,  # *x [R, D] residual rows, row stride stride_x
        h_ptr,  # *h [R, D] sublayer output rows, row stride stride_h
        g_ptr,  # *scale [D] (LayerScale)
        w_ptr,  # *weight [D]
        b_ptr,  # *bias [D] (read only when HAS_BIAS)
        y_ptr,  # *y [R, D] output, contiguous
        s_ptr,  # *s [R, D] output (the new residual), contiguous
        D,
        stride_x,
        stride_h,
        eps,
        HAS_BIAS: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        _pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        m = cols < D
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
        h = tl.load(h_ptr + row * stride_h + cols, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + cols, mask=m, other=0.0).to(tl.float32)
        s = (x.to(tl.float32) + g * h).to(x.dtype)  # rounded as addcmul stores it
        tl.store(s_ptr + row * D + cols, s, mask=m)
        sf = tl.where(m, s.to(tl.float32), 0.0)
        mean = tl.sum(sf, 0) / D
        c = tl.where(m, sf - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(c * c, 0) / D + eps)
        y = c * rstd * tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * D + cols, y.to(y_ptr.dtype.element_ty), mask=m)

    return _scale_add_layernorm_kernel


def scale_add_layernorm(x: Tensor, h: Tensor, scale: Tensor, weight: Tensor, bias: Tensor | None,
                        eps: float) -> tuple[Tensor, Tensor]:
    """x, h [..., D] (one shape and dtype), scale / weight / bias [D] -> (layer_norm(s), s) with
    s = x + scale * h, both of x's dtype and shape."""
    tensors = [x, h, scale, weight] + ([bias] if bias is not None else [])
    if not use_triton("scale_add_layernorm", *tensors):
        return scale_add_layernorm_ref(x, h, scale, weight, bias, eps)
    check(x.shape == h.shape and x.dtype == h.dtype, f"x and h must share shape and dtype, got {tuple(x.shape)} {x.dtype}, {tuple(h.shape)} {h.dtype}")
    d = x.shape[-1]
    check(0 < d <= _MAX_D, f"row length must be in [1, {_MAX_D}], got {d}")
    check(all(t.shape == (d,) for t in tensors[2:]), f"scale, weight and bias must be [{d}]")
    x2, h2 = x.reshape(-1, d), h.reshape(-1, d)
    check(x2.stride(-1) == 1 and h2.stride(-1) == 1, "rows need a unit stride")
    r = x2.shape[0]
    y = torch.empty((r, d), device=x.device, dtype=x.dtype)
    s = torch.empty((r, d), device=x.device, dtype=x.dtype)
    if r:
        _kernel()[(r,)](
            x2, h2, scale, weight, bias if bias is not None else weight, y, s, d, x2.stride(0), h2.stride(0),
            float(eps), HAS_BIAS=bias is not None, BLOCK_D=triton.next_power_of_2(d), num_warps=4,
            **pdl_launch(x),
        )
    return y.view(x.shape), s.view(x.shape)
