"""Rotary position embedding, HF half-rotation (rotate_half) convention, q and k in one launch.

    out = x * cos + rotate_half(x) * sin,   rotate_half([x1, x2]) = [-x2, x1]

Each product is rounded to x's dtype before the sum, exactly like the PyTorch expression in
engines/transformer.py evaluated in bf16, so bf16 outputs match it bit for bit on the GPU.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ._triton import check, pdl_jit, pdl_launch, use_triton

__all__ = ["apply_rotary", "apply_rotary_ref", "rotary_cache_write", "rotary_cache_write_ref"]


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
    global triton, tl, _rotate_heads, _pdl_enter
    import triton
    import triton.language as tl
    _pdl_enter = pdl_jit()

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
        PDL: tl.constexpr = False,  # launched with programmatic dependent launch (see _triton.pdl)
    ):
        _pdl_enter(PDL)
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

    @triton.jit
    def _rotary_cache_kernel(
        qkv_ptr,  # *qkv [B, (H + 2*HKV) * D]: one token per row, [q heads | k heads | v heads]
        cos_ptr,  # *cos table [P, D], row stride s_tab (row = absolute position)
        sin_ptr,  # *sin table [P, D], same strides
        pos_ptr,  # *pos [B] int64: the token's position (table row and cache position)
        slots_ptr,  # *slots [B] int64: cache slot of each row
        qo_ptr,  # *q' [B, H, D] output, contiguous
        k_ptr,  # *k_cache [S, HKV, TMAX, D] of one layer, strides sk_*
        v_ptr,  # *v_cache [S, HKV, TMAX, D], strides sv_*
        s_qkv, s_tab,
        sk_s, sk_h, sk_t,
        sv_s, sv_h, sv_t,
        H, HKV,
        HALF: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        PDL: tl.constexpr = False,  # launched with programmatic dependent launch (see _triton.pdl)
    ):
        _pdl_enter(PDL)
        # Program (b, head): heads [0, H) rotate q into q'; heads [H, H + HKV) rotate k and write
        # it, and copy v, into the cache at (slot, head, pos).
        b = tl.program_id(0).to(tl.int64)
        hd = tl.program_id(1)
        d = tl.arange(0, BLOCK_HALF)
        dm = d < HALF
        p = tl.load(pos_ptr + b)
        c_off = p * s_tab + d
        c1 = tl.load(cos_ptr + c_off, mask=dm, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + c_off + HALF, mask=dm, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + c_off, mask=dm, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + c_off + HALF, mask=dm, other=0.0).to(tl.float32)
        x_off = b * s_qkv + hd * (2 * HALF) + d
        x1 = tl.load(qkv_ptr + x_off, mask=dm, other=0.0)
        x2 = tl.load(qkv_ptr + x_off + HALF, mask=dm, other=0.0)
        dt = x1.dtype
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        # The same roundings as _rotate_heads (the engine's bf16 expression).
        o1 = ((x1 * c1).to(dt).to(tl.float32) - (x2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
        if hd < H:
            q_off = (b * H + hd) * (2 * HALF) + d
            tl.store(qo_ptr + q_off, o1, mask=dm)
            tl.store(qo_ptr + q_off + HALF, o2, mask=dm)
        else:
            j = (hd - H).to(tl.int64)
            slot = tl.load(slots_ptr + b)
            k_off = slot * sk_s + j * sk_h + p * sk_t + d
            tl.store(k_ptr + k_off, o1.to(k_ptr.dtype.element_ty), mask=dm)
            tl.store(k_ptr + k_off + HALF, o2.to(k_ptr.dtype.element_ty), mask=dm)
            v_in = b * s_qkv + (H + HKV + j) * (2 * HALF) + d
            v1 = tl.load(qkv_ptr + v_in, mask=dm, other=0.0)
            v2 = tl.load(qkv_ptr + v_in + HALF, mask=dm, other=0.0)
            v_off = slot * sv_s + j * sv_h + p * sv_t + d
            tl.store(v_ptr + v_off, v1.to(v_ptr.dtype.element_ty), mask=dm)
            tl.store(v_ptr + v_off + HALF, v2.to(v_ptr.dtype.element_ty), mask=dm)

    return _rotary_kernel, _rotary_cache_kernel


def rotary_cache_write_ref(
    qkv: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor,
    n_heads: int, n_kv_heads: int,
) -> Tensor:
    """PyTorch reference of ``rotary_cache_write`` (writes the caches in place, returns q')."""
    b = qkv.shape[0]
    d = cos.shape[-1]
    q, k, v = qkv.view(b, n_heads + 2 * n_kv_heads, d).split([n_heads, n_kv_heads, n_kv_heads], dim=1)
    c, s = cos[pos][:, None], sin[pos][:, None]  # [B, 1, D]
    q = q * c + _rotate_half(q) * s
    k = k * c + _rotate_half(k) * s
    k_cache[slots, :, pos] = k.to(k_cache.dtype)
    v_cache[slots, :, pos] = v.to(v_cache.dtype)
    return q.contiguous()


def rotary_cache_write(
    qkv: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor,
    n_heads: int, n_kv_heads: int,
) -> Tensor:
    """A decode step's RoPE and KV-cache write in one launch (instead of rotary + two scatters).

    qkv [B, (H + 2*Hkv) * D]: the fused q|k|v projection of one token per row; cos/sin [P, D]
    tables indexed by absolute position (rows computed like the engine's per-step angles); pos [B]
    long (< P and < Tmax, not checked on the device); k_cache/v_cache [S, Hkv, Tmax, D] (one
    layer's view); slots [B] long. Returns q' [B, H, D]; k' and v land in cache[slots[b], :, pos[b]].
    """
    if not use_triton("rotary_cache_write", qkv, cos, sin, pos, k_cache, v_cache, slots):
        return rotary_cache_write_ref(qkv, cos, sin, pos, k_cache, v_cache, slots, n_heads, n_kv_heads)
    check(qkv.dim() == 2 and cos.dim() == 2 and cos.shape == sin.shape, f"qkv must be [B, N] and cos/sin [P, D], got {tuple(qkv.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")
    b = qkv.shape[0]
    d = cos.shape[1]
    check(d % 2 == 0 and qkv.shape[1] == (n_heads + 2 * n_kv_heads) * d, f"qkv {tuple(qkv.shape)} is not [B, (H={n_heads} + 2*Hkv={n_kv_heads}) * D={d}]")
    check(k_cache.dim() == 4 and v_cache.shape == k_cache.shape and k_cache.shape[1] == n_kv_heads and k_cache.shape[3] == d,
          f"k_cache/v_cache must be [S, Hkv={n_kv_heads}, Tmax, D={d}], got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    check(pos.shape == (b,) and slots.shape == (b,) and pos.dtype == torch.long and slots.dtype == torch.long,
          "pos and slots must be int64 [B]")
    check(qkv.stride(1) == 1 and cos.stride(1) == 1 and cos.stride() == sin.stride() and k_cache.stride(3) == 1 and v_cache.stride(3) == 1,
          "the last dims of qkv, cos/sin and the caches must have unit stride")
    check(cos.dtype == qkv.dtype and sin.dtype == qkv.dtype, f"cos/sin must have qkv's dtype {qkv.dtype}")
    _, kernel = _kernels()
    qo = torch.empty((b, n_heads, d), device=qkv.device, dtype=qkv.dtype)
    if b == 0:
        return qo
    half = d // 2
    kernel[(b, n_heads + n_kv_heads)](
        qkv, cos, sin, pos.contiguous(), slots.contiguous(), qo, k_cache, v_cache,
        qkv.stride(0), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        n_heads, n_kv_heads, HALF=half, BLOCK_HALF=triton.next_power_of_2(half), num_warps=1,
        **pdl_launch(qkv),
    )
    return qo


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
    kernel, _ = _kernels()
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
        HALF=half, BLOCK_HALF=block_half, BLOCK_H=block_h, num_warps=4, **pdl_launch(q),
    )
    return qo, ko
