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

With ``rows`` [B] (int64, on the device) query row b attends ring row rows[b] of bigger k / v / kpos
tensors [S, ...] (and writes its new keys there): the server's step over a subset of its slots
then gathers no KV ring before the step and writes none back after it.

``ring_positions`` is the step's position bookkeeping in one kernel: each row's query positions,
their ring slots, the RoPE angles' cos and sin, the ring's position entries and the row's next
position (an arange, an add, a modulo, a scatter, the float angles, a cat, cos, sin, two casts and
an add as PyTorch ops).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ._triton import check, pdl_jit, pdl_launch, state_row_jit, use_triton

__all__ = ["window_attention", "window_attention_ref", "ring_write_ref", "ring_positions", "ring_positions_ref"]

_BLOCK_N = 64  # keys per inner step


def ring_write_ref(k: Tensor, v: Tensor, k_new: Tensor, v_new: Tensor, ring: Tensor) -> None:
    """k_new / v_new [B, Hkv, n, D] into the ring k / v [B, Hkv, C, D] at slots ring [B, n] (two
    scatters: what ``window_attention(..., new=...)`` does inside its kernel)."""
    idx = ring[:, None, :, None].expand(k_new.shape)
    k.scatter_(2, idx, k_new)
    v.scatter_(2, idx, v_new)


def ring_positions_ref(kp: Tensor, inv_freq: Tensor, n: int, dtype: torch.dtype,
                       rows: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """PyTorch reference of ``ring_positions``."""
    cw = kp.shape[1] - 1
    sel = kp if rows is None else kp[rows]
    qpos = sel[:, -1:] + torch.arange(n, device=kp.device)  # [B, n]
    ring = qpos % cw
    sel[:, :-1].scatter_(1, ring, qpos)
    sel[:, -1] += n
    if rows is not None:
        kp[rows] = sel
    freqs = qpos.float()[..., None] * inv_freq.float()
    emb = torch.cat([freqs, freqs], dim=-1)
    return qpos, ring, emb.cos().to(dtype), emb.sin().to(dtype)


def window_attention_ref(q: Tensor, k: Tensor, v: Tensor, qpos: Tensor, kpos: Tensor, window: int,
                         scale: float, new: tuple[Tensor, Tensor, Tensor] | None = None,
                         rows: Tensor | None = None) -> Tensor:
    """PyTorch reference (SDPA with the position mask): q [B, H, n, D], k/v [B, Hkv, C, D],
    qpos [B, n], kpos [B, C] -> out [B, n, H, D]; ``new`` = (k_new, v_new, ring): scattered into
    k and v (in place) first; ``rows``: k, v, kpos are [S, ...] and row b uses their row rows[b]."""
    if rows is not None:
        kr, vr = k[rows], v[rows]
        out = window_attention_ref(q, kr, vr, qpos, kpos[rows], window, scale, new)
        k[rows], v[rows] = kr, vr
        return out
    if new is not None:
        ring_write_ref(k, v, *new)
    diff = qpos[:, :, None] - kpos[:, None, :]
    mask = ((kpos[:, None, :] >= 0) & (diff >= 0) & (diff < window))[:, None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return o.transpose(1, 2)


@functools.cache
def _kernel():
    global triton, tl, libdevice, _pdl_enter, _state_row  # the jit'd functions resolve these through module globals
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
    _pdl_enter = pdl_jit()
    _state_row = state_row_jit()

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
        rows_ptr,  # *rows [B] int64: the k / v / kpos row of each query row (read only when HAS_ROWS)
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
        HAS_ROWS: tl.constexpr,
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
        kb = _state_row(b, rows_ptr, HAS_ROWS)  # the ring's row
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
        k_base = k_ptr + kb * sk_b + kvh * sk_h
        v_base = v_ptr + kb * sv_b + kvh * sv_h
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
            kp = tl.load(kpos_ptr + kb * skp_b + n, mask=nm, other=-1)
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

    @triton.jit
    def _ring_positions_kernel(
        kp_ptr,  # *kp [S, CW + 1] int64: ring positions (-1 empty), then the row's next position
        inv_freq_ptr,  # *inv_freq [HALF] (any float dtype: used as float32, as ``inv_freq.float()``)
        rows_ptr,  # *rows [B] int64 (read only when HAS_ROWS)
        qpos_ptr,  # *qpos [B, NQ] int64 output
        ring_ptr,  # *ring [B, NQ] int64 output
        cos_ptr,  # *cos [B, NQ, 2 * HALF] output (the model dtype)
        sin_ptr,  # *sin [B, NQ, 2 * HALF] output
        CW, skp_b,
        NQ: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK_T: tl.constexpr,  # >= NQ
        BLOCK_HALF: tl.constexpr,  # >= HALF
        HAS_ROWS: tl.constexpr,
        LIBDEVICE: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        _pdl_enter(PDL)
        b = tl.program_id(0).to(tl.int64)
        row = _state_row(b, rows_ptr, HAS_ROWS)
        kp_row = kp_ptr + row * skp_b
        p0 = tl.load(kp_row + CW)
        t = tl.arange(0, BLOCK_T)
        tm = t < NQ
        qp = p0 + t
        ring = qp % CW
        tl.store(qpos_ptr + b * NQ + t, qp, mask=tm)
        tl.store(ring_ptr + b * NQ + t, ring, mask=tm)
        j = tl.arange(0, BLOCK_HALF)
        jm = j < HALF
        f = qp.to(tl.float32)[:, None] * tl.load(inv_freq_ptr + j, mask=jm, other=0.0).to(tl.float32)[None, :]
        if LIBDEVICE:  # the accurate cosf / sinf, as torch's (the angles reach thousands of radians)
            c = libdevice.cos(f)
            s = libdevice.sin(f)
        else:  # the CPU interpreter has no libdevice
            c = tl.cos(f)
            s = tl.sin(f)
        out_t = cos_ptr.dtype.element_ty
        at = (b * NQ + t)[:, None] * (2 * HALF) + j[None, :]
        m = tm[:, None] & jm[None, :]
        tl.store(cos_ptr + at, c.to(out_t), mask=m)
        tl.store(cos_ptr + at + HALF, c.to(out_t), mask=m)
        tl.store(sin_ptr + at, s.to(out_t), mask=m)
        tl.store(sin_ptr + at + HALF, s.to(out_t), mask=m)
        tl.store(kp_row + ring, qp, mask=tm)
        tl.debug_barrier()  # every thread has read the old next position before it is advanced
        tl.store(kp_row + CW + t, p0 + NQ, mask=t == 0)

    return _window_attention_kernel, _ring_positions_kernel


def ring_positions(kp: Tensor, inv_freq: Tensor, n: int, dtype: torch.dtype,
                   rows: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One streaming step's positions for a KV ring of CW slots: kp [B, CW + 1] int64 (the ring's
    positions, -1 empty, then each row's next position p; updated in place), inv_freq [D / 2] ->
    (qpos [B, n] = p + 0..n-1, ring [B, n] = qpos % CW, cos, sin [B, n, D] in ``dtype``: RoPE of
    qpos in float32, as ``cat([f, f]).cos()`` of f = qpos * inv_freq). The ring's entries ``ring``
    get qpos and p advances by n. With ``rows`` [B], kp is [S, CW + 1] and row b is kp's row rows[b].
    n <= CW (the new positions land in distinct slots)."""
    tensors = [kp, inv_freq] + ([rows] if rows is not None else [])
    if not use_triton("ring_positions", *tensors):
        return ring_positions_ref(kp, inv_freq, n, dtype, rows)
    cw = kp.shape[1] - 1
    check(kp.dim() == 2 and kp.dtype == torch.long and kp.stride(1) == 1, "kp must be [B, CW + 1] int64, unit last stride")
    check(1 <= n <= cw, f"need 1 <= n <= CW = {cw}, got n={n}")
    check(inv_freq.dim() == 1 and inv_freq.is_floating_point() and inv_freq.is_contiguous(), "inv_freq must be a float [D / 2]")
    b = kp.shape[0] if rows is None else rows.shape[0]
    if rows is not None:
        check(rows.dim() == 1 and rows.dtype == torch.long and rows.device == kp.device and rows.stride(0) == 1,
              "rows must be a contiguous [B] int64 on kp's device")
    half = inv_freq.shape[0]
    qpos = torch.empty((b, n), device=kp.device, dtype=torch.long)
    ring = torch.empty_like(qpos)
    cos = torch.empty((b, n, 2 * half), device=kp.device, dtype=dtype)
    sin = torch.empty_like(cos)
    if b == 0:
        return qpos, ring, cos, sin
    _kernel()[1][(b,)](
        kp, inv_freq, rows if rows is not None else kp, qpos, ring, cos, sin, cw, kp.stride(0),
        NQ=n, HALF=half, BLOCK_T=max(2, triton.next_power_of_2(n)), BLOCK_HALF=max(2, triton.next_power_of_2(half)),
        HAS_ROWS=rows is not None, LIBDEVICE=kp.is_cuda, num_warps=1, **pdl_launch(kp),
    )
    return qpos, ring, cos, sin


def window_attention(q: Tensor, k: Tensor, v: Tensor, qpos: Tensor, kpos: Tensor, window: int,
                     scale: float | None = None, new: tuple[Tensor, Tensor, Tensor] | None = None,
                     rows: Tensor | None = None) -> Tensor:
    """q [B, H, n, D]; k, v [B, Hkv, C, D]; qpos [B, n], kpos [B, C] int64 -> out [B, n, H, D].

    Query t of row b (at position qpos[b, t]) attends the ring keys c with kpos[b, c] >= 0 and
    0 <= qpos[b, t] - kpos[b, c] < window. A query that sees no key gets zeros here (NaN in the
    reference); Mimi's always sees itself. H % Hkv == 0. ``scale`` defaults to 1/sqrt(D).
    ``new`` = (k_new, v_new [B, Hkv, n, D], ring [B, n] int64, distinct slots per row): written
    into k and v at the ring slots first (in place), as the attention then sees them. ``rows`` [B]
    int64: k, v are [S, Hkv, C, D] and kpos [S, C], and row b of q attends (and writes) their row
    rows[b] (distinct rows, except padding).
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    extra = (*(new or ()), *([rows] if rows is not None else []))
    if not use_triton("window_attention", q, k, v, qpos, kpos, *extra):
        return window_attention_ref(q, k, v, qpos, kpos, window, scale, new, rows)
    check(q.dim() == 4 and k.dim() == 4 and v.shape == k.shape, f"q must be [B, H, n, D] and k, v one shape [B, Hkv, C, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, h, nq, d = q.shape
    s_rows, hkv, c, dk = k.shape
    if rows is None:
        check(s_rows == b, f"k has {s_rows} rows for {b} query rows (pass rows= to attend a subset of them)")
    else:
        check(rows.shape == (b,) and rows.dtype == torch.long and rows.device == q.device and rows.stride(0) == 1,
              f"rows must be a contiguous [{b}] int64 on {q.device}, got {tuple(rows.shape)} {rows.dtype}")
    check(dk == d and h % hkv == 0, f"q {tuple(q.shape)} does not fit k {tuple(k.shape)}")
    check(1 <= d <= 256, f"head dim must be in [1, 256], got {d}")
    check(q.dtype in (torch.float32, torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype, "q, k, v must share a float dtype")
    check(qpos.shape == (b, nq) and kpos.shape == (s_rows, c), f"qpos must be [B, n] and kpos [B, C], got {tuple(qpos.shape)}, {tuple(kpos.shape)}")
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
    kernel = _kernel()[0]
    out = torch.empty((b, nq, h, d), device=q.device, dtype=q.dtype)
    if b == 0:
        return out
    g = h // hkv
    if q.dtype == torch.float32 or not q.is_cuda:  # see decode_attention: the interpreter dots in float32
        dot_dtype, precision = tl.float32, "ieee"
    else:
        dot_dtype, precision = (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16), "tf32"
    kernel[(b, hkv)](
        q, k, v, qpos, kpos, out, k_new, v_new, ring, rows if rows is not None else qpos,
        float(scale) * math.log2(math.e), c, int(window),
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        qpos.stride(0), kpos.stride(0),
        k_new.stride(0), k_new.stride(1), k_new.stride(2),
        v_new.stride(0), v_new.stride(1), v_new.stride(2),
        ring.stride(0),
        WRITE=new is not None, HAS_ROWS=rows is not None, BLOCK_T=max(2, triton.next_power_of_2(nq)),
        H=h, G=g, NQ=nq, D=d, BLOCK_R=max(16, triton.next_power_of_2(g * nq)),
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_N=_BLOCK_N, N_BLOCKS=triton.cdiv(c, _BLOCK_N),
        DOT_DTYPE=dot_dtype, PRECISION=precision, num_warps=4,
        **pdl_launch(q),
    )
    return out
