"""Rotary position embedding, HF half-rotation (rotate_half) convention, q and k in one launch.

    out = x * cos + rotate_half(x) * sin,   rotate_half([x1, x2]) = [-x2, x1]

Each product is rounded to x's dtype before the sum, exactly like the PyTorch expression in
engines/transformer.py evaluated in bf16, so bf16 outputs match it bit for bit on the GPU.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ._triton import check, use_triton

__all__ = ["apply_rotary", "apply_rotary_ref"]


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _as_btd(c: Tensor) -> Tensor:
    """Accept cos/sin as [B, T, D] or the engine's [B, 1, T, D] (a view, no copy)."""
    return c[:, 0] if c.dim() == 4 and c.shape[1] == 1 else c


def apply_rotary_ref(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """PyTorch reference: q [B, H, T, D], k [B, Hkv, T, D], cos/sin [B, T, D] -> (q', k')."""
    c = _as_btd(cos)[:, None]
    s = _as_btd(sin)[:, None]
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


@functools.cache
def _kernels():
    # The jit'd functions resolve `tl` and their helper through module globals.
    global triton, tl, _rotate_heads
    import triton
    import triton.language as tl

    @triton.jit
    def _rotate_heads(
        x_ptr,  # *x [B, NH, T, D] input (q or k), strides s_b, s_h, s_t
        o_ptr,  # *x' [B, NH, T, D] output, contiguous
        c1, c2, s1, s2,  # cos/sin halves for this (b, t), float32 [BLOCK_HALF]
        b, t, h0, NH, T, s_b, s_h, s_t,
        HALF: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        d = tl.arange(0, BLOCK_HALF)
        h = h0 + tl.arange(0, BLOCK_H)
        m = (h[:, None] < NH) & (d[None, :] < HALF)
        hh = h[:, None].to(tl.int64)
        x_off = b * s_b + hh * s_h + t * s_t + d[None, :]
        x1 = tl.load(x_ptr + x_off, mask=m, other=0.0)
        x2 = tl.load(x_ptr + x_off + HALF, mask=m, other=0.0)
        dt = x1.dtype
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        # Round each product to the input dtype before adding: the engine's bf16 expression does.
        o1 = (x1 * c1[None, :]).to(dt).to(tl.float32) - (x2 * s1[None, :]).to(dt).to(tl.float32)
        o2 = (x2 * c2[None, :]).to(dt).to(tl.float32) + (x1 * s2[None, :]).to(dt).to(tl.float32)
        o_off = ((b * NH + hh) * T + t) * (2 * HALF) + d[None, :]
        tl.store(o_ptr + o_off, o1.to(dt), mask=m)
        tl.store(o_ptr + o_off + HALF, o2.to(dt), mask=m)

    @triton.jit
    def _rotary_kernel(
        q_ptr,  # *q [B, H, T, D], strides sq_* (unit stride on D)
        k_ptr,  # *k [B, Hkv, T, D], strides sk_*
        cos_ptr,  # *cos [B, T, D], strides sc_* (shared by q and k)
        sin_ptr,  # *sin [B, T, D], same strides as cos
        qo_ptr,  # *q' [B, H, T, D] output, contiguous
        ko_ptr,  # *k' [B, Hkv, T, D] output, contiguous
        T, H, HKV,
        sq_b, sq_h, sq_t,
        sk_b, sk_h, sk_t,
        sc_b, sc_t,
        HALF: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        # Program (b*T + t, head block): head blocks [0, cdiv(H)) rotate q, the rest rotate k.
        bt = tl.program_id(0)
        hb = tl.program_id(1)
        b = (bt // T).to(tl.int64)
        t = (bt % T).to(tl.int64)
        d = tl.arange(0, BLOCK_HALF)
        dm = d < HALF
        c_off = b * sc_b + t * sc_t + d
        c1 = tl.load(cos_ptr + c_off, mask=dm, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + c_off + HALF, mask=dm, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + c_off, mask=dm, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + c_off + HALF, mask=dm, other=0.0).to(tl.float32)
        n_qb = tl.cdiv(H, BLOCK_H)
        if hb < n_qb:
            _rotate_heads(q_ptr, qo_ptr, c1, c2, s1, s2, b, t, hb * BLOCK_H, H, T, sq_b, sq_h, sq_t,
                          HALF, BLOCK_HALF, BLOCK_H)
        else:
            _rotate_heads(k_ptr, ko_ptr, c1, c2, s1, s2, b, t, (hb - n_qb) * BLOCK_H, HKV, T, sk_b, sk_h, sk_t,
                          HALF, BLOCK_HALF, BLOCK_H)

    return _rotary_kernel


def apply_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """q [B, H, T, D], k [B, Hkv, T, D], cos/sin [B, T, D] (or [B, 1, T, D]) -> (q', k') contiguous.

    q and k may be strided views (e.g. the engine's ``view(B, T, H, D).transpose(1, 2)``) as long as
    D is the unit-stride dim; cos/sin may broadcast over B (stride 0). All four share one dtype.
    """
    if not use_triton("apply_rotary", q, k, cos, sin):
        return apply_rotary_ref(q, k, cos, sin)
    cos, sin = _as_btd(cos), _as_btd(sin)
    check(q.dim() == 4 and k.dim() == 4, f"q, k must be [B, H, T, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    b, h, t, d = q.shape
    hkv = k.shape[1]
    check(k.shape == (b, hkv, t, d), f"k {tuple(k.shape)} must be [B={b}, Hkv, T={t}, D={d}]")
    check(cos.shape == (b, t, d) and sin.shape == (b, t, d), f"cos/sin must be [B={b}, T={t}, D={d}], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    check(d % 2 == 0, f"head dim D must be even, got {d}")
    check(q.is_floating_point() and k.dtype == q.dtype and cos.dtype == q.dtype and sin.dtype == q.dtype,
          f"q, k, cos, sin must share one float dtype, got {q.dtype}, {k.dtype}, {cos.dtype}, {sin.dtype}")
    check(q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1,
          "the last dim (D) of q, k, cos, sin must have unit stride")
    check(cos.stride() == sin.stride(), "cos and sin must have the same strides")
    kernel = _kernels()
    qo = torch.empty((b, h, t, d), device=q.device, dtype=q.dtype)
    ko = torch.empty((b, hkv, t, d), device=k.device, dtype=k.dtype)
    if b * t == 0:
        return qo, ko
    half = d // 2
    block_half = triton.next_power_of_2(half)
    # About 2K elements of each half per program; decode (T=1) then runs a few programs per row.
    block_h = max(1, min(triton.next_power_of_2(max(h, hkv)), 2048 // block_half))
    grid = (b * t, triton.cdiv(h, block_h) + triton.cdiv(hkv, block_h))
    kernel[grid](
        q, k, cos, sin, qo, ko, t, h, hkv,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        cos.stride(0), cos.stride(1),
        HALF=half, BLOCK_HALF=block_half, BLOCK_H=block_h, num_warps=4,
    )
    return qo, ko
