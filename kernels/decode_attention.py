"""Decode attention (one query token per row) over a static per-slot KV cache, GQA, split over S.

Flash-decoding: the key range [0, Tmax) is cut into NUM_SPLITS chunks; program (b, kv head, split)
attends the G = H / Hkv query heads of that kv head to its chunk (online softmax in float32) and
writes an unnormalised partial; a second small kernel merges the splits. The split count depends
only on static shapes (B, Hkv, Tmax), never on the lengths, so the launch is CUDA-graph friendly;
chunks past a row's length exit at once.

Cache layout is the engine's per-layer view ``KVCache.k[layer]``: [S slots, Hkv, Tmax, D].

With programmatic dependent launch the split kernel starts while the kernel before it (in the
engine, the RoPE + cache write of the step's own key and value) is still running; the kernels
before that one have completed (each kernel of this package waits for its predecessor before it
lets the next one launch). With EARLY_KV each split loads its first block of the keys and values
that earlier steps wrote (positions < length - 1) before its PDL wait, and puts the own key and
value into the block after it. The slots and lengths it reads early are checked after the wait.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ._triton import check, pdl_jit, pdl_launch, use_triton

__all__ = ["decode_attention", "decode_attention_ref"]

_BLOCK_N = 64  # keys per inner step
_TARGET_PROGRAMS = 264  # ~2 waves on a 132-SM H200
EARLY_KV = True  # the split kernel's first key block before its PDL wait; decode_attention(early_kv=) overrides


def decode_attention_ref(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, lengths: Tensor, scale: float
) -> Tensor:
    """PyTorch reference (SDPA with a key mask): q [B, H, D] -> out [B, H, D]."""
    k = k_cache[slots].to(q.dtype)  # [B, Hkv, Tmax, D]
    v = v_cache[slots].to(q.dtype)
    tmax = k.shape[2]
    mask = torch.arange(tmax, device=q.device)[None, :] < lengths.to(q.device)[:, None]  # [B, Tmax]
    out = F.scaled_dot_product_attention(
        q[:, :, None], k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out[:, :, 0]


@functools.cache
def _kernels():
    global triton, tl, _pdl_enter, _scores, _accumulate  # the jit'd functions resolve these through module globals
    import triton
    import triton.language as tl
    _pdl_enter = pdl_jit()

    @triton.jit
    def _scores(q, k, nm, m_i, l_i, qk_scale, QDT: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
        """A block's softmax step: q [BLOCK_G, BLOCK_D] in DOT_DTYPE; k [BLOCK_N, BLOCK_D] as the cache
        holds it (zeros past the keys); nm [BLOCK_N] the valid keys -> (p, alpha, m_new, l_i)."""
        k = k.to(QDT).to(DOT_DTYPE)  # the engine casts the cache to q's dtype
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(nm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        return p, alpha, m_new, l_i

    @triton.jit
    def _accumulate(acc, p, alpha, v, QDT: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
        """acc [BLOCK_G, BLOCK_D] rescaled by alpha, plus p @ v (v as the cache holds it)."""
        v = v.to(QDT).to(DOT_DTYPE)
        # p in the dot dtype (bf16 on tensor cores, as flash attention does; float32 stays exact).
        return acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)

    @triton.jit
    def _decode_split_kernel(
        q_ptr,  # *q [B, H, D], strides sq_b, sq_h (unit stride on D)
        k_ptr,  # *k_cache [S, Hkv, Tmax, D], strides sk_s, sk_h, sk_t
        v_ptr,  # *v_cache [S, Hkv, Tmax, D], strides sv_s, sv_h, sv_t
        slots_ptr,  # *slots [B] int64: cache slot of each row
        len_ptr,  # *lengths [B] int64: valid key positions [0, length) of each row
        acc_ptr,  # *acc [B, H, NUM_SPLITS, D] float32 output: unnormalised sum p * v per split
        ml_ptr,  # *ml [B, H, NUM_SPLITS, 2] float32 output: (running max in log2 units, sum p) per split
        qk_scale,  # softmax scale * log2(e): exp2 instead of exp
        TMAX,
        S,  # cache slots: bounds the slot read before the PDL wait (EARLY)
        sq_b, sq_h,
        sk_s, sk_h, sk_t,
        sv_s, sv_h, sv_t,
        H: tl.constexpr,
        G: tl.constexpr,
        D: tl.constexpr,
        CHUNK: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
        PRECISION: tl.constexpr,
        DIRECT: tl.constexpr,  # one split: normalise and write out[B, H, D] (acc_ptr) here, no merge
        EARLY: tl.constexpr = False,  # the split's first key/value block loaded before the PDL wait (EARLY_KV)
        PDL: tl.constexpr = False,  # launched with programmatic dependent launch (see _triton.pdl)
    ):
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1).to(tl.int64)
        split = tl.program_id(2)
        lo = split * CHUNK
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        n0 = lo + tl.arange(0, BLOCK_N)  # the split's first block of keys
        QDT: tl.constexpr = q_ptr.dtype.element_ty
        if EARLY:
            # Before the wait, only what the kernel before cannot be writing: the keys and values
            # that earlier steps wrote, at positions < length - 1 (that kernel writes the step's own
            # key at length - 1). The row's slot and length are read here too but may be stale (a
            # caller may compute them in the kernel just before), so they are read again after the
            # wait and the block is reloaded if they changed; the slot is clamped so that a stale
            # one never reads outside the cache.
            slot_e = tl.minimum(tl.maximum(tl.load(slots_ptr + b), 0), S - 1)
            len_e = tl.minimum(tl.load(len_ptr + b), TMAX)
            old = (n0 < tl.minimum(lo + CHUNK, len_e - 1))[:, None] & dm[None, :]
            k_early = k_ptr + slot_e * sk_s + kvh * sk_h + n0[:, None].to(tl.int64) * sk_t + d[None, :]
            v_early = v_ptr + slot_e * sv_s + kvh * sv_h + n0[:, None].to(tl.int64) * sv_t + d[None, :]
            k0 = tl.load(k_early, mask=old, other=0.0)
            v0 = tl.load(v_early, mask=old, other=0.0)
        _pdl_enter(PDL)
        slot = tl.load(slots_ptr + b)
        length = tl.minimum(tl.load(len_ptr + b), TMAX)  # never read past the cache
        hi = tl.minimum(lo + CHUNK, length)

        g = tl.arange(0, BLOCK_G)
        gm = g < G
        heads = kvh * G + g  # the query heads sharing this kv head
        q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
        q = q.to(DOT_DTYPE)

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        k_base = k_ptr + slot * sk_s + kvh * sk_h
        v_base = v_ptr + slot * sv_s + kvh * sv_h
        if EARLY:
            # The own key and value, if in the first block, from the addresses the block was read at
            # (independent of the slot and length just read, so these loads go out together).
            own = (n0 == len_e - 1)[:, None] & dm[None, :]
            k0 = tl.where(own, tl.load(k_early, mask=own, other=0.0), k0)
            v0 = tl.where(own, tl.load(v_early, mask=own, other=0.0), v0)
            if lo < hi:
                if (slot != slot_e) | (length != len_e):  # stale before the wait: read the block now
                    kv_mask = (n0 < hi)[:, None] & dm[None, :]
                    k0 = tl.load(k_base + n0[:, None].to(tl.int64) * sk_t + d[None, :], mask=kv_mask, other=0.0)
                    v0 = tl.load(v_base + n0[:, None].to(tl.int64) * sv_t + d[None, :], mask=kv_mask, other=0.0)
                # (the values the loop below would read for this block: the same result)
                p, alpha, m_i, l_i = _scores(q, k0, n0 < hi, m_i, l_i, qk_scale, QDT, DOT_DTYPE, PRECISION)
                acc = _accumulate(acc, p, alpha, v0, QDT, DOT_DTYPE, PRECISION)
        # A constexpr trip count with a runtime guard: blocks past the row's length are skipped
        # (runtime loop bounds also trip the CPU interpreter, which keeps scalars as 1-element arrays).
        FIRST: tl.constexpr = 1 if EARLY else 0  # the block the early path attended
        for i in range(FIRST, CHUNK // BLOCK_N):
            start = lo + i * BLOCK_N
            if start < hi:
                n = start + tl.arange(0, BLOCK_N)
                nm = n < hi
                kv_mask = nm[:, None] & dm[None, :]
                k = tl.load(k_base + n[:, None].to(tl.int64) * sk_t + d[None, :], mask=kv_mask, other=0.0)
                p, alpha, m_i, l_i = _scores(q, k, nm, m_i, l_i, qk_scale, QDT, DOT_DTYPE, PRECISION)
                v = tl.load(v_base + n[:, None].to(tl.int64) * sv_t + d[None, :], mask=kv_mask, other=0.0)
                acc = _accumulate(acc, p, alpha, v, QDT, DOT_DTYPE, PRECISION)

        if DIRECT:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # (the merge kernel's zero-length guard)
            tl.store(acc_ptr + (b * H + heads)[:, None] * D + d[None, :], out.to(acc_ptr.dtype.element_ty),
                     mask=gm[:, None] & dm[None, :])
            return
        row = (b * H + heads) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=gm[:, None] & dm[None, :])
        tl.store(ml_ptr + row * 2, m_i, mask=gm)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=gm)

    @triton.jit
    def _decode_merge_kernel(
        acc_ptr,  # *acc [B, H, NUM_SPLITS, D] float32 partials
        ml_ptr,  # *ml [B, H, NUM_SPLITS, 2] float32 (max in log2 units, sum p)
        o_ptr,  # *out [B, H, D] output, contiguous, in q's dtype
        D: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        BLOCK_SPLITS: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PDL: tl.constexpr = False,  # launched with programmatic dependent launch (see _triton.pdl)
    ):
        _pdl_enter(PDL)
        bh = tl.program_id(0).to(tl.int64)
        sp = tl.arange(0, BLOCK_SPLITS)
        d = tl.arange(0, BLOCK_D)
        spm = sp < NUM_SPLITS
        m = tl.load(ml_ptr + (bh * NUM_SPLITS + sp) * 2, mask=spm, other=float("-inf"))
        l = tl.load(ml_ptr + (bh * NUM_SPLITS + sp) * 2 + 1, mask=spm, other=0.0)
        m_max = tl.max(m, axis=0)
        # Empty splits carry m = -inf, l = 0; guard the all-empty row (length 0) against -inf - -inf.
        w = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)
        acc = tl.load(acc_ptr + (bh * NUM_SPLITS + sp)[:, None] * D + d[None, :], mask=spm[:, None] & (d[None, :] < D), other=0.0)
        num = tl.sum(acc * w[:, None], axis=0)
        den = tl.sum(l * w, axis=0)
        out = num / tl.where(den > 0, den, 1.0)
        tl.store(o_ptr + bh * D + d, out.to(o_ptr.dtype.element_ty), mask=d < D)

    return _decode_split_kernel, _decode_merge_kernel


def _num_splits(b: int, hkv: int, tmax: int) -> int:
    """Enough (b, kv head, split) programs to fill the GPU, each at least one BLOCK_N of keys."""
    return max(1, min(triton.cdiv(_TARGET_PROGRAMS, b * hkv), triton.cdiv(tmax, _BLOCK_N)))


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    lengths: Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
    early_kv: bool | None = None,
) -> Tensor:
    """q [B, H, D]; k_cache, v_cache [S, Hkv, Tmax, D]; slots [B] long; lengths [B] long -> out [B, H, D].

    Row b attends q[b] to cache slot slots[b] at positions [0, lengths[b]) (lengths in [1, Tmax];
    not checked on the device, which would need a host sync; lengths > Tmax are clamped, a length
    of 0 gives zeros here and NaN in the reference). H % Hkv == 0 (GQA). ``scale`` defaults to
    1/sqrt(D). The cache may have another dtype than q (it is cast on load, like the engine does).
    ``num_splits`` in [1, cdiv(Tmax, 64)] overrides the static split heuristic (for benchmarks;
    rounded down to a count of whole 64-key chunks, e.g. 3 of 4 blocks gives 2 splits).
    ``early_kv`` overrides EARLY_KV (same result either way): each split reads its first block of
    keys before the PDL wait, so the kernel launched just before this one must not write the cache
    at positions < lengths[b] - 1 (a decode step writes only its own key, at lengths[b] - 1); q,
    slots, lengths and the own key may come from that kernel.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if not use_triton("decode_attention", q, k_cache, v_cache, slots, lengths):
        return decode_attention_ref(q, k_cache, v_cache, slots, lengths, scale)
    check(q.dim() == 3, f"q must be [B, H, D], got {tuple(q.shape)}")
    b, h, d = q.shape
    check(k_cache.dim() == 4 and v_cache.shape == k_cache.shape, f"k_cache/v_cache must be one shape [S, Hkv, Tmax, D], got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    n_slots, hkv, tmax, dk = k_cache.shape
    check(dk == d, f"cache head dim {dk} != q head dim {d}")
    check(h % hkv == 0, f"H={h} must be a multiple of Hkv={hkv}")
    check(16 <= d <= 256, f"head dim must be in [16, 256], got {d}")
    check(q.dtype in (torch.float32, torch.float16, torch.bfloat16), f"q dtype {q.dtype} not supported")
    check(k_cache.dtype == v_cache.dtype and k_cache.is_floating_point(), "k_cache/v_cache must share a float dtype")
    check(slots.shape == (b,) and lengths.shape == (b,), f"slots and lengths must be [B={b}], got {tuple(slots.shape)}, {tuple(lengths.shape)}")
    check(slots.dtype == torch.long and lengths.dtype == torch.long, "slots and lengths must be int64")
    check(slots.is_contiguous() and lengths.is_contiguous(), "slots and lengths must be contiguous")
    check(q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "the last dim (D) must have unit stride")
    max_splits = (tmax + _BLOCK_N - 1) // _BLOCK_N  # each split at least one BLOCK_N of keys
    check(num_splits is None or 1 <= num_splits <= max_splits,
          f"num_splits must be in [1, {max_splits}] (Tmax={tmax}, {_BLOCK_N} keys a block), got {num_splits}")
    split_kernel, merge_kernel = _kernels()
    out = torch.empty((b, h, d), device=q.device, dtype=q.dtype)
    if b == 0:
        return out
    ns = num_splits if num_splits is not None else _num_splits(b, hkv, tmax)
    chunk = triton.cdiv(triton.cdiv(tmax, ns), _BLOCK_N) * _BLOCK_N  # a whole number of BLOCK_N
    ns = triton.cdiv(tmax, chunk)
    g = h // hkv
    block_d = triton.next_power_of_2(d)
    # Dots in q's dtype on the GPU (bf16/fp16 tensor cores). The CPU interpreter multiplies bf16 as
    # raw integers, so it dots in float32; float32 dots are always exact ("ieee", not tf32).
    if q.dtype == torch.float32 or not q.is_cuda:
        dot_dtype, precision = tl.float32, "ieee"
    else:
        dot_dtype, precision = (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16), "tf32"
    direct = ns == 1  # one split (short caches, e.g. CSM's depth decoder): no partials, no merge launch
    acc = out if direct else torch.empty((b, h, ns, d), device=q.device, dtype=torch.float32)
    ml = acc if direct else torch.empty((b, h, ns, 2), device=q.device, dtype=torch.float32)
    split_kernel[(b, hkv, ns)](
        q, k_cache, v_cache, slots, lengths, acc, ml, float(scale) * math.log2(math.e), tmax, n_slots,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        H=h, G=g, D=d, CHUNK=chunk, NUM_SPLITS=ns,
        BLOCK_G=max(16, triton.next_power_of_2(g)),  # tl.dot needs M >= 16
        BLOCK_D=block_d, BLOCK_N=_BLOCK_N, DOT_DTYPE=dot_dtype, PRECISION=precision, DIRECT=direct,
        EARLY=EARLY_KV if early_kv is None else bool(early_kv), num_warps=4,
        **pdl_launch(q),
    )
    if direct:
        return out
    merge_kernel[(b * h,)](
        acc, ml, out, D=d, NUM_SPLITS=ns, BLOCK_SPLITS=triton.next_power_of_2(ns), BLOCK_D=block_d, num_warps=4,
        **pdl_launch(q),
    )
    return out
