"""Sliding-window attention of a few new queries over a KV ring whose slots carry absolute positions.

Mimi's streaming transformer step: each row has n new query tokens (2 per code frame) at positions
qpos [B, n], and a ring of C keys whose positions are kpos [B, C] (-1 = empty slot). Query at
position p sees the keys at positions p - W + 1 .. p. One program per (row, kv head) attends the
G = H / Hkv query heads times n queries of that head to the whole ring (online softmax in float32)
and writes [B, n, H, D], the layout the output projection reads, so no transpose follows.

On the H200 cuDNN's SDPA took 11.6 µs for this (batch 1: 2 queries, 251 keys, 8 heads of 64), a
kernel sized for long sequences.

With ``new=(k_new, v_new, ring)`` the kernel first writes the step's own keys and values into the
ring (k_new/v_new [B, Hkv, n, D] at ring slots ring [B, n]), then attends: each program writes the
rows of its own (row, kv head), so a block barrier orders the write before its reads. That replaces
two scatter kernels a layer (16 of ~3.6 µs a Mimi step on the H200).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ._triton import check, pdl_jit, pdl_launch, use_triton

__all__ = ["window_attention", "window_attention_ref", "ring_write_ref"]

_BLOCK_N = 64  # keys per inner step


def ring_write_ref(k: Tensor, v: Tensor, k_new: Tensor, v_new: Tensor, ring: Tensor) -> None:
    """k_new / v_new [B, Hkv, n, D] into the ring k / v [B, Hkv, C, D] at slots ring [B, n] (two
    scatters: what ``window_attention(..., new=...)`` does inside its kernel)."""
    idx = ring[:, None, :, None].expand(k_new.shape)
    k.scatter_(2, idx, k_new)
    v.scatter_(2, idx, v_new)


def window_attention_ref(q: Tensor, k: Tensor, v: Tensor, qpos: Tensor, kpos: Tensor, window: int,
                         scale: float, new: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """PyTorch reference (SDPA with the position mask): q [B, H, n, D], k/v [B, Hkv, C, D],
    qpos [B, n], kpos [B, C] -> out [B, n, H, D]; ``new`` = (k_new, v_new, ring): scattered into
    k and v (in place) first."""
    if new is not None:
        ring_write_ref(k, v, *new)
    diff = qpos[:, :, None] - kpos[:, None, :]
    mask = ((kpos[:, None, :] >= 0) & (diff >= 0) & (diff < window))[:, None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return o.transpose(1, 2)


@functools.cache
def _kernel():
    global triton, tl, _pdl_enter  # the jit'd function resolves these through module globals
    import triton
    import triton.language as tl
    _pdl_enter = pdl_jit()

    @triton.jit
    def _window_attention_kernel(
        q_ptr,  # *q [B, H, NQ, D], strides sq_b, sq_h, sq_t (unit stride on D)
        k_ptr,  # *k [B, Hkv, C, D], strides sk_b, sk_h, sk_t
        v_ptr,  # *v [B, Hkv, C, D], strides sv_b, sv_h, sv_t
        qpos_ptr,  # *qpos [B, NQ] int64, strides sqp_b, 1
        kpos_ptr,  # *kpos [B, C] int64 (-1 = empty), strides skp_b, 1
        o_ptr,  # *out [B, NQ, H, D] contiguous, q's dtype
        kn_ptr,  # *k_new [B, Hkv, NQ, D], strides skn_b, skn_h, skn_t (read only when WRITE)
        vn_ptr,  # *v_new [B, Hkv, NQ, D], strides svn_b, svn_h, svn_t (read only when WRITE)
        ring_ptr,  # *ring [B, NQ] int64: the ring slot of each new key, strides sr_b, 1 (WRITE)
        qk_scale,  # softmax scale * log2(e)
        C, WINDOW,
        sq_b, sq_h, sq_t,
        sk_b, sk_h, sk_t,
        sv_b, sv_h, sv_t,
        sqp_b, skp_b,
        skn_b, skn_h, skn_t,
        svn_b, svn_h, svn_t,
        sr_b,
        WRITE: tl.constexpr,  # write k_new / v_new into the ring first
        BLOCK_T: tl.constexpr,  # >= NQ, the new keys' rows
        H: tl.constexpr,
        G: tl.constexpr,
        NQ: tl.constexpr,
        D: tl.constexpr,
        BLOCK_R: tl.constexpr,  # >= G * NQ rows (query head g, query token t) -> r = g * NQ + t
        BLOCK_D: tl.constexpr,  # >= D and >= 16 (tl.dot's minimum; the padding lanes load zeros)
        BLOCK_N: tl.constexpr,
        N_BLOCKS: tl.constexpr,  # cdiv(C, BLOCK_N)
        DOT_DTYPE: tl.constexpr,
        PRECISION: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        _pdl_enter(PDL)
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1).to(tl.int64)
        r = tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        rm = r < G * NQ
        dm = d < D
        head = kvh * G + r // NQ
        t = r % NQ
        q = tl.load(q_ptr + b * sq_b + head[:, None] * sq_h + t[:, None] * sq_t + d[None, :],
                    mask=rm[:, None] & dm[None, :], other=0.0).to(DOT_DTYPE)
        qp = tl.load(qpos_ptr + b * sqp_b + t, mask=rm, other=0)

        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        k_base = k_ptr + b * sk_b + kvh * sk_h
        v_base = v_ptr + b * sv_b + kvh * sv_h
        if WRITE:
            # This (row, kv head)'s new keys and values into their ring slots; only this program
            # reads them, after the barrier.
            tn = tl.arange(0, BLOCK_T)
            tm = tn < NQ
            wm = tm[:, None] & dm[None, :]
            slot = tl.load(ring_ptr + b * sr_b + tn, mask=tm, other=0)
            kn = tl.load(kn_ptr + b * skn_b + kvh * skn_h + tn[:, None] * skn_t + d[None, :], mask=wm, other=0.0)
            vn = tl.load(vn_ptr + b * svn_b + kvh * svn_h + tn[:, None] * svn_t + d[None, :], mask=wm, other=0.0)
            tl.store(k_base + slot[:, None] * sk_t + d[None, :], kn, mask=wm)
            tl.store(v_base + slot[:, None] * sv_t + d[None, :], vn, mask=wm)
            tl.debug_barrier()
        for i in range(N_BLOCKS):
            n = i * BLOCK_N + tl.arange(0, BLOCK_N)
            nm = n < C
            kp = tl.load(kpos_ptr + b * skp_b + n, mask=nm, other=-1)
            kv_mask = nm[:, None] & dm[None, :]
            k = tl.load(k_base + n[:, None].to(tl.int64) * sk_t + d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_R, BLOCK_N]
            diff = qp[:, None] - kp[None, :]
            ok = (kp[None, :] >= 0) & (diff >= 0) & (diff < WINDOW)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row with no key yet: nothing to scale
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + n[:, None].to(tl.int64) * sv_t + d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o = o_ptr + ((b * NQ + t) * H + head)[:, None] * D + d[None, :]
        tl.store(o, out.to(o_ptr.dtype.element_ty), mask=rm[:, None] & dm[None, :])

    return _window_attention_kernel


def window_attention(q: Tensor, k: Tensor, v: Tensor, qpos: Tensor, kpos: Tensor, window: int,
                     scale: float | None = None, new: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """q [B, H, n, D]; k, v [B, Hkv, C, D]; qpos [B, n], kpos [B, C] int64 -> out [B, n, H, D].

    Query t of row b (at position qpos[b, t]) attends the ring keys c with kpos[b, c] >= 0 and
    0 <= qpos[b, t] - kpos[b, c] < window. A query that sees no key gets zeros here (NaN in the
    reference); Mimi's always sees itself. H % Hkv == 0. ``scale`` defaults to 1/sqrt(D).
    ``new`` = (k_new, v_new [B, Hkv, n, D], ring [B, n] int64, distinct slots per row): written
    into k and v at the ring slots first (in place), as the attention then sees them.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if not use_triton("window_attention", q, k, v, qpos, kpos, *(new or ())):
        return window_attention_ref(q, k, v, qpos, kpos, window, scale, new)
    check(q.dim() == 4 and k.dim() == 4 and v.shape == k.shape, f"q must be [B, H, n, D] and k, v one shape [B, Hkv, C, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, h, nq, d = q.shape
    _, hkv, c, dk = k.shape
    check(k.shape[0] == b and dk == d and h % hkv == 0, f"q {tuple(q.shape)} does not fit k {tuple(k.shape)}")
    check(1 <= d <= 256, f"head dim must be in [1, 256], got {d}")
    check(q.dtype in (torch.float32, torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype, "q, k, v must share a float dtype")
    check(qpos.shape == (b, nq) and kpos.shape == (b, c), f"qpos must be [B, n] and kpos [B, C], got {tuple(qpos.shape)}, {tuple(kpos.shape)}")
    check(qpos.dtype == kpos.dtype == torch.long, "positions must be int64")
    check(qpos.stride(-1) == 1 and kpos.stride(-1) == 1, "positions need a unit stride on their last dim")
    check(q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "the last dim (D) must have unit stride")
    if new is not None:
        k_new, v_new, ring = new
        check(k_new.shape == v_new.shape == (b, hkv, nq, d) and k_new.dtype == v_new.dtype == k.dtype,
              f"k_new and v_new must be [B, Hkv, n, D] = {(b, hkv, nq, d)} in k's dtype, got {tuple(k_new.shape)}, {tuple(v_new.shape)}")
        check(k_new.stride(-1) == 1 and v_new.stride(-1) == 1, "k_new and v_new need a unit stride on D")
        check(ring.shape == (b, nq) and ring.dtype == torch.long and ring.stride(-1) == 1,
              f"ring must be [B, n] int64 with a unit last stride, got {tuple(ring.shape)} {ring.dtype}")
    else:
        k_new = v_new = k
        ring = qpos
    kernel = _kernel()
    out = torch.empty((b, nq, h, d), device=q.device, dtype=q.dtype)
    if b == 0:
        return out
    g = h // hkv
    if q.dtype == torch.float32 or not q.is_cuda:  # see decode_attention: the interpreter dots in float32
        dot_dtype, precision = tl.float32, "ieee"
    else:
        dot_dtype, precision = (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16), "tf32"
    kernel[(b, hkv)](
        q, k, v, qpos, kpos, out, k_new, v_new, ring, float(scale) * math.log2(math.e), c, int(window),
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        qpos.stride(0), kpos.stride(0),
        k_new.stride(0), k_new.stride(1), k_new.stride(2),
        v_new.stride(0), v_new.stride(1), v_new.stride(2),
        ring.stride(0),
        WRITE=new is not None, BLOCK_T=max(2, triton.next_power_of_2(nq)),
        H=h, G=g, NQ=nq, D=d, BLOCK_R=max(16, triton.next_power_of_2(g * nq)),
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_N=_BLOCK_N, N_BLOCKS=triton.cdiv(c, _BLOCK_N),
        DOT_DTYPE=dot_dtype, PRECISION=precision, num_warps=4,
        **pdl_launch(q),
    )
    return out
