"""A whole decoder stack's one-token step in ONE persistent kernel (Llama layers, M <= 4 rows).

    h = final_norm(layers(x))    x [M, dim] -> h [M, dim]; K/V of the step written into the cache

The layer-by-layer decode launches ~5 kernels a layer besides its 4 GEMVs; at batch 1 each of
them is latency, not bytes, and the HBM idles between them. Here one program runs on every SM
and walks the layers through five phases, separated by grid barriers (a monotonic counter):

    0  input RMSNorm (each program normalises the rows into its own scratch) + q|k|v GEMV rows
    1  RoPE, this step's K/V written into the cache, split attention over the cache; the last
       split of a (row, kv head) to finish merges the partials (a counter per group)
    2  o GEMV rows (from the merged attention output) + residual add
    3  post-attention RMSNorm + gate|up GEMV rows with SwiGLU
    4  down GEMV rows + residual add
    then the final RMSNorm.

Every GEMV gives each program cdiv(N, P) consecutive rows of the weight (one contiguous slice),
and a phase is kept to few dependent trips to memory. An L2 prefetch of a later phase's weights
before each barrier (``cp.async.bulk.prefetch.L2``) is a switch, off: on the H100 it cost time.
ATT_PREFETCH has the programs with no attention work ask the L2 for the o slices and part of
the gate|up slices at the start of the attention phase, while the HBM is otherwise idle (its
first form, every program prefetching its own slices with a request a thread, lengthened the
attention on an H100). ATT_REGS (one attention item a program) loads the item's position, slot,
angle rows and the first block of its cached keys and values into registers before the
attention's barrier: after the barrier only q and the step's own key and value (from q|k|v) are
read, and the own key goes into its row of the block in registers instead of through the cache.
FMA is a mask of the GEMV phases that multiply elementwise at one row (1 q|k|v, 2 o, 4 gate|up,
8 down) instead of padding x to a [16, BK] tile for tl.dot. At one row the three are the
defaults (launch_meta): on an H100 they took a Llama-3.2-1B step from 1,124 to 964 µs, still
1-2 % slower than the layer-by-layer path, which is why the engines keep the stack off.

Numerics are the layer-by-layer kernels' (rmsnorm.add_rmsnorm, rotary.rotary_cache_write,
decode_attention, gemv.swiglu): products accumulated in float32 and rounded to the activation
dtype, residual sums rounded, attention scores in float32 with p·v in the activation dtype.

The CPU interpreter runs programs one after another, so a grid barrier cannot work there: off the
GPU the launcher runs one phase per launch (``only=``) and the launch boundary is the barrier.
The kernel assumes all P programs are resident at once (P <= SMs, one program per SM): do not run
two persistent kernels on one GPU concurrently (the engines enable it for the text model only).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ._triton import check, interpret_mode, pdl, use_triton

__all__ = ["StackWeights", "stack_weights", "decode_stack", "launch_meta", "takes_shapes", "errors", "trace_summary",
           "MAX_M", "PHASES"]

MAX_M = 4
PHASES = 5  # per layer
_BLOCK_N = 64  # keys per attention step
_MAX_SPLITS = 16  # attention splits of a (row, kv head) at most
# 8 warps: at 4 the 1B-shape kernel spills ~1.1 KB a thread (255 registers either way; 8 x 32 x 255
# is the whole register file, one program per SM, which is what the barrier needs anyway)
_WARPS = 8
_SPIN_LIMIT = 1 << 24  # barrier polls before giving up (a bug, not a wait: sets the error flag)
# The one-poller grid barrier (ONE_POLLER): thread 0 of the program adds its arrival with release
# semantics, computes the barrier's target (the next multiple of P), polls the counter with acquire
# loads (at most $3 times) and on a timeout ORs 1 into the error flag at [$1 + 8]. Other threads
# skip to the end; the block barrier after the asm makes them wait for thread 0 (bar.sync orders
# their later reads after thread 0's acquire). ${:uid} keeps the labels of the six sites apart.
_POLL_ASM = """{
 .reg .pred gbp, gbq;
 .reg .b32 gbt, gbn;
 .reg .b64 gbo, gbg, gbc;
 mov.u32 $0, 0;
 mov.u32 gbt, %tid.x;
 setp.ne.u32 gbp, gbt, 0;
 @gbp bra GB_DONE_${:uid};
 atom.add.release.gpu.global.u64 gbo, [$1], 1;
 div.u64 gbg, gbo, $2;
 add.u64 gbg, gbg, 1;
 mul.lo.u64 gbg, gbg, $2;
 mov.u32 gbn, 0;
GB_POLL_${:uid}:
 ld.acquire.gpu.global.u64 gbc, [$1];
 setp.ge.u64 gbq, gbc, gbg;
 @gbq bra GB_DONE_${:uid};
 add.u32 gbn, gbn, 1;
 setp.lt.u32 gbq, gbn, $3;
 @gbq bra GB_POLL_${:uid};
 red.global.or.b64 [$1+8], 1;
 mov.u32 $0, 1;
GB_DONE_${:uid}:
}"""
# what decode_stack's ``tune`` may override (WARPS: 4 lets two programs share an SM, up to 2 x SMs programs)
_TUNABLE = {"STAGES", "BK_QKV", "BK_O", "BK_GU", "BK_D", "GU_ONE_LOOP", "ONE_POLLER", "EARLY", "WARPS", "ATT_PREFETCH",
            "FMA", "ATT_EARLY", "ATT_REGS", "PREFETCH"}


@functools.cache
def _kernels():
    # the jit'd functions resolve these through module globals
    global triton, tl, gdc_wait, _stamp, _grid_barrier, _own, _prefetch, _norm_rows, _merge_splits, _tile0, _dot_acc, \
        _rows_dot, _rows_dot2, _add_residual, _rotate, _att_block, _att_out, _att_query, _att_arrive, _att_item
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_wait

    globals()["_POLL"] = tl.constexpr(_POLL_ASM)  # a jit function reads only constexpr globals

    @triton.jit
    def _stamp(tr_ptr, THREADS: tl.constexpr):
        # TRACE: thread 0 stores this SM's cycle counter at tr_ptr[0] and the global ns timer at tr_ptr[2]
        t = tl.arange(0, THREADS)
        clk = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [t], dtype=tl.int64, is_pure=False, pack=1)
        ns = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [t], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(tr_ptr + t * 0, clk, mask=t == 0)
        tl.store(tr_ptr + 2 + t * 0, ns, mask=t == 0)

    @triton.jit
    def _grid_barrier(cnt_ptr, P: tl.constexpr, SPIN_LIMIT: tl.constexpr, ONE_POLLER: tl.constexpr,
                      THREADS: tl.constexpr, tr_ptr, TRACE: tl.constexpr):
        # cnt_ptr[0] (int64) only grows: P arrivals per barrier, so barrier j of any launch waits
        # for the next multiple of P above the value it arrived at. cnt_ptr[1]: error flag.
        # TRACE: the program's arrival (tr_ptr[0], [2]) and release ([1], [3]) times (_stamp).
        tl.debug_barrier()  # every thread's stores before the arrival
        if TRACE:
            _stamp(tr_ptr, THREADS)
        if ONE_POLLER:
            # thread 0 arrives (release), polls with acquire loads and flags a timeout; the block
            # barrier after it holds the other threads (132 pollers on the counter's line, not 1,056)
            t = tl.arange(0, THREADS)
            tl.inline_asm_elementwise(_POLL, "=r,l,l,r", [cnt_ptr + t * 0, tl.full([THREADS], P, tl.int64),
                                                             tl.full([THREADS], SPIN_LIMIT, tl.int32)],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:
            old = tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
            target = (old // P + 1) * P
            cur = tl.load(cnt_ptr, volatile=True)
            n = 0
            while (cur < target) & (n < SPIN_LIMIT):
                cur = tl.load(cnt_ptr, volatile=True)
                n += 1
            # the acquire that orders the reads after the barrier: a compare-and-swap that never swaps
            # (the counter is never -1; an atomic add of 0 is folded away by the compiler)
            never = tl.cast(-1, tl.int64)
            cur = tl.atomic_cas(cnt_ptr, never, never, sem="acquire", scope="gpu")
            if cur < target:
                tl.atomic_or(cnt_ptr + 1, 1)
        tl.debug_barrier()
        if TRACE:
            _stamp(tr_ptr + 1, THREADS)

    @triton.jit
    def _own(pid, R, N):
        # how many of the R rows from pid * R are inside the N rows (the last programs may hold none)
        return tl.maximum(tl.minimum(R, N - pid * R), 0)

    @triton.jit
    def _prefetch(ptr, n_elems, THREADS: tl.constexpr, ON: tl.constexpr, SPLIT: tl.constexpr = 0):
        # L2 prefetch of n_elems elements from ptr in SPLIT bulk requests (0: THREADS), one per thread
        # (THREADS = the program's threads, so each element of the arange is one thread's: no request
        # repeats; threads past the last request issue none).
        if ON:
            n = n_elems // 8 * 8  # whole 16-byte units (2-byte elements): the size's required granule
            per = (tl.cdiv(n, SPLIT if SPLIT > 0 else THREADS) + 7) // 8 * 8
            offs = tl.arange(0, THREADS) * per
            size = (tl.minimum(tl.maximum(n - offs, 0), per) * 2).to(tl.int32)  # bytes (bf16/fp16)
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r", [ptr + offs, size], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _norm_rows(src_ptr, w_ptr, dst_ptr, stride_dst, M: tl.constexpr, DIM: tl.constexpr, eps,
                   BLOCK_M: tl.constexpr, BD: tl.constexpr):
        # dst[m] = RMSNorm(src[m]) * w for the M rows (rmsnorm kernel's roundings); dst is private.
        rm = tl.arange(0, BLOCK_M)
        mm = rm < M
        if BD == DIM:  # one chunk: the rows are read once
            cols = tl.arange(0, BD)
            w = tl.load(w_ptr + cols).to(tl.float32)
            x = tl.load(src_ptr + rm[:, None] * DIM + cols[None, :], mask=mm[:, None], other=0.0, cache_modifier=".cg")
            h = x.to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(h * h, axis=1) / DIM + eps)
            y = (h * rstd[:, None]).to(x.dtype).to(tl.float32) * w[None, :]
            tl.store(dst_ptr + rm[:, None] * stride_dst + cols[None, :], y.to(x.dtype), mask=mm[:, None])
            return
        ss = tl.zeros([BLOCK_M], tl.float32)
        for c in range(DIM // BD):
            cols = c * BD + tl.arange(0, BD)
            x = tl.load(src_ptr + rm[:, None] * DIM + cols[None, :], mask=mm[:, None], other=0.0, cache_modifier=".cg")
            h = x.to(tl.float32)
            ss += tl.sum(h * h, axis=1)
        rstd = tl.math.rsqrt(ss / DIM + eps)
        for c in range(DIM // BD):
            cols = c * BD + tl.arange(0, BD)
            x = tl.load(src_ptr + rm[:, None] * DIM + cols[None, :], mask=mm[:, None], other=0.0, cache_modifier=".cg")
            w = tl.load(w_ptr + cols).to(tl.float32)
            y = (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32) * w[None, :]
            tl.store(dst_ptr + rm[:, None] * stride_dst + cols[None, :], y.to(x.dtype), mask=mm[:, None])

    @triton.jit
    def _merge_splits(part_ptr, ml_ptr, attn_ptr, m, kvh, length, H: tl.constexpr, G: tl.constexpr, HD: tl.constexpr,
                      NS: tl.constexpr, CHUNK: tl.constexpr, NS_B: tl.constexpr, HD_B: tl.constexpr):
        # attn[m, head] = sum_s 2^(max_s - max) o_s / sum_s 2^(max_s - max) l_s over the splits that
        # hold keys, for the kv head's G query heads; each head's loads are issued at once.
        s = tl.arange(0, NS_B)
        sm = (s < NS) & (s * CHUNK < length)
        d = tl.arange(0, HD_B)
        dm = d < HD
        for g in tl.static_range(G):
            r = (m * H + kvh * G + g) * NS + s
            ms = tl.load(ml_ptr + r * 2, mask=sm, other=float("-inf"), cache_modifier=".cg")
            ls = tl.load(ml_ptr + r * 2 + 1, mask=sm, other=0.0, cache_modifier=".cg")
            a = tl.load(part_ptr + r[:, None] * HD + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0,
                        cache_modifier=".cg")
            w = tl.where(sm, tl.exp2(ms - tl.max(ms, axis=0)), 0.0)
            den = tl.sum(ls * w, axis=0)
            out = tl.sum(a * w[:, None], axis=0) / tl.where(den > 0, den, 1.0)
            tl.store(attn_ptr + m * (H * HD) + (kvh * G + g) * HD + d, out.to(attn_ptr.dtype.element_ty), mask=dm)

    @triton.jit
    def _tile0(w_ptr, row0, R, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # The first K step's weight tile [BN, BK] of the rows [row0, row0 + R): loaded ahead (EARLY),
        # before the grid barrier that the product's input waits for (weights need no barrier).
        rr = tl.arange(0, BN)
        rn = row0 + rr
        nm = (rr < R) & (rn < N)
        return tl.load(w_ptr + rn[:, None].to(tl.int64) * K + tl.arange(0, BK)[None, :], mask=nm[:, None], other=0.0)

    @triton.jit
    def _dot_acc(acc, x, w, DOT_F32: tl.constexpr):
        # acc [16, BN] += x [16, BK] @ w [BN, BK].T
        if DOT_F32:
            return acc + tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        return acc + tl.dot(x, tl.trans(w))

    @triton.jit
    def _rows_dot(x_ptr, stride_x, w_ptr, row0, R, N, K: tl.constexpr, M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  STAGES: tl.constexpr, DOT_F32: tl.constexpr, w0, EARLY: tl.constexpr, FMA: tl.constexpr):
        # acc [16, BN] = x[0:M] (row stride stride_x) @ w[row0 : row0 + R].T: rows padded to 16 for tl.dot,
        # the K loop software-pipelined (STAGES tiles in flight). EARLY (0 or 1): w0 is the first
        # K step's tile, already loaded (_tile0), and the loop starts at the second. FMA (one row
        # only): elementwise products instead of tl.dot, so a K step stages x's BK values, not a
        # [16, BK] tile that is 15/16 zeros (as many copies into shared memory as the weights').
        rm = tl.arange(0, 16)
        mm = rm < M
        rr = tl.arange(0, BN)
        rn = row0 + rr
        nm = (rr < R) & (rn < N)
        w_rows = w_ptr + rn[:, None].to(tl.int64) * K
        if FMA:
            rk0 = tl.arange(0, BK)
            part = tl.zeros([BN, BK], tl.float32)
            if EARLY:
                part += w0.to(tl.float32) * tl.load(x_ptr + rk0, cache_modifier=".cg").to(tl.float32)[None, :]
            for i in tl.range(EARLY, K // BK, num_stages=STAGES):
                rk = i * BK + rk0
                w = tl.load(w_rows + rk[None, :], mask=nm[:, None], other=0.0)
                part += w.to(tl.float32) * tl.load(x_ptr + rk, cache_modifier=".cg").to(tl.float32)[None, :]
            return tl.where((rm == 0)[:, None], tl.sum(part, axis=1)[None, :], 0.0)
        acc = tl.zeros([16, BN], tl.float32)
        if EARLY:
            x = tl.load(x_ptr + rm[:, None] * stride_x + tl.arange(0, BK)[None, :], mask=mm[:, None], other=0.0,
                        cache_modifier=".cg")
            acc = _dot_acc(acc, x, w0, DOT_F32)
        for i in tl.range(EARLY, K // BK, num_stages=STAGES):
            rk = i * BK + tl.arange(0, BK)
            w = tl.load(w_rows + rk[None, :], mask=nm[:, None], other=0.0)
            x = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=mm[:, None], other=0.0, cache_modifier=".cg")
            acc = _dot_acc(acc, x, w, DOT_F32)
        return acc

    @triton.jit
    def _rows_dot2(x_ptr, stride_x, w_ptr, w2_ptr, row0, R, N, K: tl.constexpr, M: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, STAGES: tl.constexpr, DOT_F32: tl.constexpr, w0, w20, EARLY: tl.constexpr,
                   FMA: tl.constexpr):
        # _rows_dot for two weights of one shape in ONE K loop (gate and up): twice the bytes in
        # flight a stage, and one pipeline fill and drain instead of two.
        rm = tl.arange(0, 16)
        mm = rm < M
        rr = tl.arange(0, BN)
        rn = row0 + rr
        nm = (rr < R) & (rn < N)
        offs = rn[:, None].to(tl.int64) * K
        if FMA:
            rk0 = tl.arange(0, BK)
            part = tl.zeros([BN, BK], tl.float32)
            part2 = tl.zeros([BN, BK], tl.float32)
            if EARLY:
                x = tl.load(x_ptr + rk0, cache_modifier=".cg").to(tl.float32)[None, :]
                part += w0.to(tl.float32) * x
                part2 += w20.to(tl.float32) * x
            for i in tl.range(EARLY, K // BK, num_stages=STAGES):
                rk = i * BK + rk0
                w = tl.load(w_ptr + offs + rk[None, :], mask=nm[:, None], other=0.0)
                w2 = tl.load(w2_ptr + offs + rk[None, :], mask=nm[:, None], other=0.0)
                x = tl.load(x_ptr + rk, cache_modifier=".cg").to(tl.float32)[None, :]
                part += w.to(tl.float32) * x
                part2 += w2.to(tl.float32) * x
            first = (rm == 0)[:, None]
            return tl.where(first, tl.sum(part, axis=1)[None, :], 0.0), tl.where(first, tl.sum(part2, axis=1)[None, :], 0.0)
        acc = tl.zeros([16, BN], tl.float32)
        acc2 = tl.zeros([16, BN], tl.float32)
        if EARLY:
            x = tl.load(x_ptr + rm[:, None] * stride_x + tl.arange(0, BK)[None, :], mask=mm[:, None], other=0.0,
                        cache_modifier=".cg")
            acc = _dot_acc(acc, x, w0, DOT_F32)
            acc2 = _dot_acc(acc2, x, w20, DOT_F32)
        for i in tl.range(EARLY, K // BK, num_stages=STAGES):
            rk = i * BK + tl.arange(0, BK)
            w = tl.load(w_ptr + offs + rk[None, :], mask=nm[:, None], other=0.0)
            w2 = tl.load(w2_ptr + offs + rk[None, :], mask=nm[:, None], other=0.0)
            x = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=mm[:, None], other=0.0, cache_modifier=".cg")
            acc = _dot_acc(acc, x, w, DOT_F32)
            acc2 = _dot_acc(acc2, x, w2, DOT_F32)
        return acc, acc2

    @triton.jit
    def _add_residual(acc, r_ptr, res_ptr, row0, R, M: tl.constexpr, DIM: tl.constexpr, BN: tl.constexpr):
        # res[0:M, row0 : row0 + R] = r + acc, the product rounded to the residual dtype first and
        # the sum rounded (add_rmsnorm's roundings); r_ptr is res_ptr, or the stack's input.
        rm = tl.arange(0, 16)
        rr = tl.arange(0, BN)
        rn = row0 + rr
        om = (rm < M)[:, None] & ((rr < R) & (rn < DIM))[None, :]
        r = tl.load(r_ptr + rm[:, None] * DIM + rn[None, :], mask=om, other=0.0, cache_modifier=".cg")
        y = (acc.to(r.dtype).to(tl.float32) + r.to(tl.float32)).to(r.dtype)
        tl.store(res_ptr + rm[:, None] * DIM + rn[None, :], y, mask=om)

    @triton.jit
    def _rotate(x1, x2, c1, c2, s1, s2):
        # The rotary kernel's bf16 expression on halves (float32 in, rounded like the engine).
        dt = x1.dtype
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        o1 = ((a * c1).to(dt).to(tl.float32) - (b * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((b * c2).to(dt).to(tl.float32) + (a * s2).to(dt).to(tl.float32)).to(dt)
        return o1, o2

    @triton.jit
    def _att_block(q1, q2, k1, k2, v, nmask, m_i, l_i, o, qk_scale, DOT_F32: tl.constexpr):
        # One block of keys of the online softmax: scores of the G query heads (halves q1, q2 against
        # the keys' halves k1, k2), then the running max, sum and p.v update.
        if DOT_F32:
            s = tl.dot(q1, tl.trans(k1.to(tl.float32)), input_precision="ieee")
            s += tl.dot(q2, tl.trans(k2.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q1, tl.trans(k1)) + tl.dot(q2, tl.trans(k2))
        s = tl.where(nmask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        if DOT_F32:
            o = o * alpha[:, None] + tl.dot(pr, v.to(tl.float32), input_precision="ieee")
        else:
            o = o * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
        return m_new, l_i, o

    @triton.jit
    def _att_item(item, pos_ptr, slots_ptr, HKV: tl.constexpr, NS: tl.constexpr, CHUNK: tl.constexpr,
                  TMAX: tl.constexpr):
        # An attention item (row, kv head, split): m, kvh, sp, the row's position and slot, its
        # key count, and the split's key range [lo, hi) (empty where the split is past the keys).
        m = item // (HKV * NS)
        kvh = (item // NS) % HKV
        sp = item % NS
        p = tl.load(pos_ptr + m)
        slot = tl.load(slots_ptr + m)
        length = tl.minimum(p + 1, TMAX)
        lo = sp * CHUNK
        hi = tl.minimum(lo + CHUNK, length)
        return m, kvh, sp, p, slot, length, lo, hi

    @triton.jit
    def _att_query(qkv_ptr, m, kvh, g_, gm, dh, dmh, c1, c2, s1, s2, NQKV: tl.constexpr, G: tl.constexpr,
                   HD: tl.constexpr, HALF: tl.constexpr, DOT_F32: tl.constexpr):
        # The kv head's G query heads of row m, rotated: (heads, q1, q2), halves of [BLOCK_G, HALF_B].
        heads = kvh * G + g_
        qin = qkv_ptr + m * NQKV + heads[:, None] * HD + dh[None, :]
        qm = gm[:, None] & dmh[None, :]
        q1, q2 = _rotate(tl.load(qin, mask=qm, other=0.0, cache_modifier=".cg"),
                         tl.load(qin + HALF, mask=qm, other=0.0, cache_modifier=".cg"),
                         c1[None, :], c2[None, :], s1[None, :], s2[None, :])
        if DOT_F32:
            q1 = q1.to(tl.float32)
            q2 = q2.to(tl.float32)
        return heads, q1, q2

    @triton.jit
    def _att_arrive(cnt_ptr, part_ptr, ml_ptr, attn_ptr, m, kvh, length, H: tl.constexpr, HKV: tl.constexpr,
                    G: tl.constexpr, HD: tl.constexpr, NS: tl.constexpr, CHUNK: tl.constexpr, NS_B: tl.constexpr,
                    HD_B: tl.constexpr):
        # The last of the (row, kv head)'s NS splits to finish merges them: a counter per group
        # that only grows (NS arrivals a layer), so no reset.
        tl.debug_barrier()  # every thread's partial stores before the arrival
        done = tl.atomic_add(cnt_ptr + 2 + m * HKV + kvh, 1, sem="acq_rel", scope="gpu")
        if done % NS == NS - 1:
            _merge_splits(part_ptr, ml_ptr, attn_ptr, m, kvh, length, H, G, HD, NS, CHUNK, NS_B, HD_B)

    @triton.jit
    def _att_out(o, m_i, l_i, m, heads, sp, gm, d, dm, attn_ptr, part_ptr, ml_ptr, H: tl.constexpr, HD: tl.constexpr,
                 NS: tl.constexpr):
        # A split's result: the attention output itself (one split), else its partial o, max and sum.
        if NS == 1:
            out = o / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(attn_ptr + m * (H * HD) + heads[:, None] * HD + d[None, :], out.to(attn_ptr.dtype.element_ty),
                     mask=gm[:, None] & dm[None, :])
        else:
            row = (m * H + heads) * NS + sp
            tl.store(part_ptr + row[:, None] * HD + d[None, :], o, mask=gm[:, None] & dm[None, :])
            tl.store(ml_ptr + row * 2, m_i, mask=gm)
            tl.store(ml_ptr + row * 2 + 1, l_i, mask=gm)

    @triton.jit
    def _stack_kernel(
        x_ptr,  # *x [M, DIM]: the step's input hidden rows (read, not written)
        h_ptr,  # *h [M, DIM] output: the final RMSNorm of the residual
        res_ptr,  # *residual scratch [M, DIM]
        qkv_ptr,  # *q|k|v scratch [M, (H + 2 HKV) HD]
        attn_ptr,  # *attention output [M, H HD] (merged)
        part_ptr,  # *attention partials [M, H, NS, HD] float32
        ml_ptr,  # *(max in log2 units, sum p) [M, H, NS, 2] float32
        act_ptr,  # *SwiGLU output scratch [M, I]
        priv_ptr,  # *per-program input rows [P, M, DIM] (the normalised row a GEMV reads)
        cnt_ptr,  # *int64 [2 + M HKV]: barrier counter, error flag, a split counter per (row, kv head)
        trace_ptr,  # *int64 [P, NPH L + 1, 4] (TRACE): per program and barrier, arrival/release cycles and ns
        wqkv_ptr,  # *[L, (H + 2 HKV) HD, DIM]
        wo_ptr,  # *[L, DIM, H HD]
        wgu_ptr,  # *[L, 2 I, DIM] (gate rows, then up rows)
        wd_ptr,  # *[L, DIM, I]
        nrm_ptr,  # *[L, 2, DIM]: input and post-attention RMSNorm weights
        fnorm_ptr,  # *[DIM] final RMSNorm weight
        k_ptr, v_ptr,  # *caches [L, S, HKV, TMAX, HD], strides sk_* (both caches)
        cos_ptr, sin_ptr,  # *[P_tab, HD] tables by position, row stride s_tab
        pos_ptr, slots_ptr,  # *[M] int64
        eps, qk_scale,
        sk_l, sk_s, sk_h, sk_t, s_tab,
        only,  # the one phase to run (5 l + k, or 5 L for the final norm); -1: all, with barriers
        M: tl.constexpr, DIM: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr,
        I: tl.constexpr, L: tl.constexpr, TMAX: tl.constexpr, CHUNK: tl.constexpr, NS: tl.constexpr,
        P: tl.constexpr,
        R_QKV: tl.constexpr, BN_QKV: tl.constexpr, BK_QKV: tl.constexpr,
        R_O: tl.constexpr, BN_O: tl.constexpr, BK_O: tl.constexpr,
        R_GU: tl.constexpr, BN_GU: tl.constexpr, BK_GU: tl.constexpr,
        R_D: tl.constexpr, BN_D: tl.constexpr, BK_D: tl.constexpr,
        STAGES: tl.constexpr, BD: tl.constexpr, NS_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr,
        HALF_B: tl.constexpr, HD_B: tl.constexpr, ITEMS: tl.constexpr,
        THREADS: tl.constexpr, BLOCK_KV: tl.constexpr,  # the program's threads; keys per attention step
        NPH: tl.constexpr, SPIN_LIMIT: tl.constexpr,  # phases a layer (PHASES); barrier polls before giving up
        BARRIER: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr,
        PREFETCH: tl.constexpr,  # L2 prefetches of later phases' weights (bits: 1 q|k|v at down's end, 2 o, 4 gate|up, 8 down)
        GU_ONE_LOOP: tl.constexpr,  # gate and up in one K loop (_rows_dot2), or one loop each
        EARLY: tl.constexpr,  # 1: each GEMV's first weight tile is loaded before the barrier it waits at
        ONE_POLLER: tl.constexpr,  # the grid barrier polled by one thread a program (_POLL_ASM), or by all
        ATT_EARLY: tl.constexpr,  # the attention's K/V and angle rows L2-prefetched before its barrier
        ATT_REGS: tl.constexpr,  # (ITEMS == 1) the attention's first key block in registers before its barrier
        FMA: tl.constexpr,  # one row: these GEMV phases (bits: 1 q|k|v, 2 o, 4 gate|up, 8 down) multiply elementwise
        ATT_PREFETCH: tl.constexpr,  # > 0: idle programs L2-prefetch o and 1/this of gate|up at the attention's start
        TRACE: tl.constexpr,  # time stamps at every barrier (trace_ptr); slot 0 is the kernel's start
    ):
        pid = tl.program_id(0)
        NQKV: tl.constexpr = (H + 2 * HKV) * HD
        G: tl.constexpr = H // HKV
        HALF: tl.constexpr = HD // 2
        priv = priv_ptr + pid * (M * DIM)
        rm16 = tl.arange(0, 16)
        mm16 = rm16 < M
        # The first layer's q|k|v slice, while the kernel before (the embedding) finishes.
        # Prefetched ahead of their phase: all of a program's q|k|v and o slices, a quarter of its
        # gate, up and down slices (the L2 holds ~50 MB; a layer's gate|up alone is 67 MB at 1B).
        _prefetch(wqkv_ptr + pid * R_QKV * DIM, _own(pid, R_QKV, NQKV) * DIM, THREADS, PREFETCH & 1)
        if PDL:
            gdc_wait()  # the kernel before has completed and its writes are visible
        tr = trace_ptr + pid * ((NPH * L + 1) * 4)
        dh = tl.arange(0, HALF_B)
        dmh = dh < HALF
        d = tl.arange(0, HD_B)
        dm = d < HD
        g_ = tl.arange(0, BLOCK_G)
        gm = g_ < G
        NITEM: tl.constexpr = M * HKV * NS  # attention items: (row, kv head, split)
        if TRACE:  # the start, in the release slot of the barrier the first phase does not have
            _stamp(tr + 1, THREADS)
        for layer in range(L):
            l64 = tl.cast(layer, tl.int64)
            src = res_ptr
            if layer == 0:
                src = x_ptr
            # ---- 0: input norm + q|k|v rows
            if (only < 0) | (only == NPH * layer):
                row0 = pid * R_QKV
                wq = wqkv_ptr + l64 * NQKV * DIM
                w0 = _tile0(wq, row0, R_QKV, NQKV, DIM, BN_QKV, BK_QKV) if EARLY else 0
                if BARRIER:
                    if layer > 0:  # the previous layer's down rows
                        _grid_barrier(cnt_ptr, P, SPIN_LIMIT, ONE_POLLER, THREADS, tr + (NPH * layer) * 4, TRACE)
                _norm_rows(src, nrm_ptr + l64 * 2 * DIM, priv, DIM, M, DIM, eps, BLOCK_M, BD)
                tl.debug_barrier()
                acc = _rows_dot(priv, DIM, wq, row0, R_QKV, NQKV, DIM, M, BN_QKV, BK_QKV, STAGES, DOT_F32, w0, EARLY, FMA & 1)
                rn = row0 + tl.arange(0, BN_QKV)
                nm = (tl.arange(0, BN_QKV) < R_QKV) & (rn < NQKV)
                tl.store(qkv_ptr + rm16[:, None] * NQKV + rn[None, :], acc.to(qkv_ptr.dtype.element_ty),
                         mask=mm16[:, None] & nm[None, :])
                _prefetch(wo_ptr + (l64 * DIM + pid * R_O) * (H * HD), _own(pid, R_O, DIM) * H * HD, THREADS,
                          (PREFETCH >> 1) & 1)
            # ---- 1: RoPE, cache write, split attention
            if (only < 0) | (only == NPH * layer + 1):
                if ATT_REGS:
                    # The first block of the item's keys and values that earlier steps wrote does
                    # not depend on q|k|v: it is loaded into registers before the barrier, and the
                    # step's own key and value are put in its row after it (no cache round trip).
                    # (the item's position, slot and angle rows too: L1 hits after the first layer,
                    # read here rather than kept in registers across the layer's GEMV phases)
                    a_item = pid < NITEM
                    a_m, a_kvh, a_sp, a_p, a_slot, a_len, a_lo, a_hi = _att_item(tl.minimum(pid, NITEM - 1), pos_ptr,
                                                                                 slots_ptr, HKV, NS, CHUNK, TMAX)
                    a_on = a_item & (a_lo < a_hi)
                    a_off = a_p * s_tab + dh
                    a_c1 = tl.load(cos_ptr + a_off, mask=dmh & a_on, other=0.0).to(tl.float32)
                    a_c2 = tl.load(cos_ptr + a_off + HALF, mask=dmh & a_on, other=0.0).to(tl.float32)
                    a_s1 = tl.load(sin_ptr + a_off, mask=dmh & a_on, other=0.0).to(tl.float32)
                    a_s2 = tl.load(sin_ptr + a_off + HALF, mask=dmh & a_on, other=0.0).to(tl.float32)
                    a_n0 = a_lo + tl.arange(0, BLOCK_KV)
                    a_old0 = (a_n0 < tl.minimum(a_hi, a_p)) & a_on  # the first block's keys earlier steps wrote
                    kb_r = layer * sk_l + a_slot * sk_s + a_kvh * sk_h
                    kr0 = k_ptr + kb_r + a_n0[:, None].to(tl.int64) * sk_t
                    om0 = a_old0[:, None] & dmh[None, :]
                    pk1 = tl.load(kr0 + dh[None, :], mask=om0, other=0.0, cache_modifier=".cg")
                    pk2 = tl.load(kr0 + HALF + dh[None, :], mask=om0, other=0.0, cache_modifier=".cg")
                    pv = tl.load(v_ptr + kb_r + a_n0[:, None].to(tl.int64) * sk_t + d[None, :],
                                 mask=a_old0[:, None] & dm[None, :], other=0.0, cache_modifier=".cg")
                elif ATT_EARLY:
                    # What the program's first attention item reads and q|k|v does not write: its
                    # keys' and values' rows and the angle rows, asked of the L2 before the barrier.
                    if pid < NITEM:
                        _, kvh0, _, p0, slot0, _, lo0, hi0 = _att_item(pid, pos_ptr, slots_ptr, HKV, NS, CHUNK, TMAX)
                        if lo0 < hi0:
                            kb0 = layer * sk_l + slot0 * sk_s + kvh0 * sk_h + lo0 * sk_t
                            span = (hi0 - lo0 - 1) * sk_t + HD
                            _prefetch(k_ptr + kb0, span, THREADS, True, 2)
                            _prefetch(v_ptr + kb0, span, THREADS, True, 2)
                            _prefetch(cos_ptr + p0 * s_tab, HD, THREADS, True, 1)
                            _prefetch(sin_ptr + p0 * s_tab, HD, THREADS, True, 1)
                if BARRIER:  # q|k|v
                    _grid_barrier(cnt_ptr, P, SPIN_LIMIT, ONE_POLLER, THREADS, tr + (NPH * layer + 1) * 4, TRACE)
                if ATT_PREFETCH > 0:
                    # The attention keeps the first M HKV NS programs busy on latency and the HBM idle:
                    # the others ask the L2 for every program's o slice and 1/ATT_PREFETCH of its gate
                    # and up slices (idle program j covers programs j, j + idle, ...), 8 requests a
                    # slice, so nothing is added to the attention's critical path.
                    BUSY: tl.constexpr = M * HKV * NS
                    if (P > BUSY) & (pid >= BUSY):
                        IDLE: tl.constexpr = P - BUSY
                        for c in tl.static_range((P + IDLE - 1) // IDLE):
                            q = pid - BUSY + c * IDLE
                            if q < P:
                                _prefetch(wo_ptr + (l64 * DIM + q * R_O) * (H * HD), _own(q, R_O, DIM) * H * HD, THREADS,
                                          True, 8)
                                _prefetch(wgu_ptr + (l64 * 2 * I + q * R_GU) * DIM, _own(q, R_GU, I) * DIM // ATT_PREFETCH,
                                          THREADS, True, 8)
                                _prefetch(wgu_ptr + (l64 * 2 * I + I + q * R_GU) * DIM,
                                          _own(q, R_GU, I) * DIM // ATT_PREFETCH, THREADS, True, 8)
                if ATT_REGS:
                    if a_item:
                        if a_on:
                            qdt = qkv_ptr.dtype.element_ty
                            kin = qkv_ptr + a_m * NQKV + (H + a_kvh) * HD
                            kn1, kn2 = _rotate(tl.load(kin + dh, mask=dmh, other=0.0, cache_modifier=".cg"),
                                               tl.load(kin + HALF + dh, mask=dmh, other=0.0, cache_modifier=".cg"),
                                               a_c1, a_c2, a_s1, a_s2)
                            vn = tl.load(kin + HKV * HD + d, mask=dm, other=0.0, cache_modifier=".cg")
                            if (a_p >= a_lo) & (a_p < a_hi):  # this split holds the step's own key
                                tl.store(k_ptr + kb_r + a_p * sk_t + dh, kn1.to(k_ptr.dtype.element_ty), mask=dmh)
                                tl.store(k_ptr + kb_r + a_p * sk_t + HALF + dh, kn2.to(k_ptr.dtype.element_ty), mask=dmh)
                                tl.store(v_ptr + kb_r + a_p * sk_t + d, vn.to(v_ptr.dtype.element_ty), mask=dm)
                            # as the cache holds them (its dtype), for the key row of this step
                            kn1 = kn1.to(k_ptr.dtype.element_ty).to(qdt)
                            kn2 = kn2.to(k_ptr.dtype.element_ty).to(qdt)
                            vn = vn.to(v_ptr.dtype.element_ty).to(qdt)
                            heads, q1, q2 = _att_query(qkv_ptr, a_m, a_kvh, g_, gm, dh, dmh, a_c1, a_c2, a_s1, a_s2,
                                                       NQKV, G, HD, HALF, DOT_F32)
                            m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
                            l_i = tl.zeros([BLOCK_G], tl.float32)
                            o = tl.zeros([BLOCK_G, HD_B], tl.float32)
                            new0 = (a_n0 == a_p)[:, None]
                            k1 = tl.where(new0, kn1[None, :], pk1.to(qdt))
                            k2 = tl.where(new0, kn2[None, :], pk2.to(qdt))
                            v = tl.where(new0, vn[None, :], pv.to(qdt))
                            m_i, l_i, o = _att_block(q1, q2, k1, k2, v, a_n0 < a_hi, m_i, l_i, o, qk_scale, DOT_F32)
                            for i in range(1, CHUNK // BLOCK_KV):
                                start = a_lo + i * BLOCK_KV
                                if start < a_hi:
                                    n = start + tl.arange(0, BLOCK_KV)
                                    new = (n == a_p)[:, None]
                                    om = (n < a_p)[:, None] & dmh[None, :]
                                    kr = k_ptr + kb_r + n[:, None].to(tl.int64) * sk_t
                                    k1 = tl.load(kr + dh[None, :], mask=om, other=0.0, cache_modifier=".cg").to(qdt)
                                    k2 = tl.load(kr + HALF + dh[None, :], mask=om, other=0.0, cache_modifier=".cg").to(qdt)
                                    v = tl.load(v_ptr + kb_r + n[:, None].to(tl.int64) * sk_t + d[None, :],
                                                mask=(n < a_p)[:, None] & dm[None, :], other=0.0, cache_modifier=".cg").to(qdt)
                                    k1 = tl.where(new, kn1[None, :], k1)
                                    k2 = tl.where(new, kn2[None, :], k2)
                                    v = tl.where(new, vn[None, :], v)
                                    m_i, l_i, o = _att_block(q1, q2, k1, k2, v, n < a_hi, m_i, l_i, o, qk_scale, DOT_F32)
                            _att_out(o, m_i, l_i, a_m, heads, a_sp, gm, d, dm, attn_ptr, part_ptr, ml_ptr, H, HD, NS)
                        if NS > 1:
                            _att_arrive(cnt_ptr, part_ptr, ml_ptr, attn_ptr, a_m, a_kvh, a_len, H, HKV, G, HD, NS, CHUNK,
                                        NS_B, HD_B)
                else:
                    for it in range(ITEMS):
                        item = pid + it * P
                        if item < NITEM:
                            m, kvh, sp, p, slot, length, lo, hi = _att_item(item, pos_ptr, slots_ptr, HKV, NS, CHUNK, TMAX)
                            if lo < hi:
                                c_off = p * s_tab + dh
                                c1 = tl.load(cos_ptr + c_off, mask=dmh, other=0.0).to(tl.float32)
                                c2 = tl.load(cos_ptr + c_off + HALF, mask=dmh, other=0.0).to(tl.float32)
                                s1 = tl.load(sin_ptr + c_off, mask=dmh, other=0.0).to(tl.float32)
                                s2 = tl.load(sin_ptr + c_off + HALF, mask=dmh, other=0.0).to(tl.float32)
                                kb = layer * sk_l + slot * sk_s + kvh * sk_h
                                if (p >= lo) & (p < hi):  # this split holds the step's own key: write it first
                                    kin = qkv_ptr + m * NQKV + (H + kvh) * HD
                                    k1, k2 = _rotate(tl.load(kin + dh, mask=dmh, other=0.0, cache_modifier=".cg"),
                                                     tl.load(kin + HALF + dh, mask=dmh, other=0.0, cache_modifier=".cg"),
                                                     c1, c2, s1, s2)
                                    tl.store(k_ptr + kb + p * sk_t + dh, k1.to(k_ptr.dtype.element_ty), mask=dmh)
                                    tl.store(k_ptr + kb + p * sk_t + HALF + dh, k2.to(k_ptr.dtype.element_ty), mask=dmh)
                                    vv = tl.load(kin + HKV * HD + d, mask=dm, other=0.0, cache_modifier=".cg")
                                    tl.store(v_ptr + kb + p * sk_t + d, vv.to(v_ptr.dtype.element_ty), mask=dm)
                                    tl.debug_barrier()
                                heads, q1, q2 = _att_query(qkv_ptr, m, kvh, g_, gm, dh, dmh, c1, c2, s1, s2, NQKV, G, HD,
                                                           HALF, DOT_F32)
                                m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
                                l_i = tl.zeros([BLOCK_G], tl.float32)
                                o = tl.zeros([BLOCK_G, HD_B], tl.float32)
                                for i in range(CHUNK // BLOCK_KV):
                                    start = lo + i * BLOCK_KV
                                    if start < hi:
                                        n = start + tl.arange(0, BLOCK_KV)
                                        nmask = n < hi
                                        kr = k_ptr + kb + n[:, None].to(tl.int64) * sk_t
                                        k1 = tl.load(kr + dh[None, :], mask=nmask[:, None] & dmh[None, :], other=0.0,
                                                     cache_modifier=".cg").to(qkv_ptr.dtype.element_ty)
                                        k2 = tl.load(kr + HALF + dh[None, :], mask=nmask[:, None] & dmh[None, :], other=0.0,
                                                     cache_modifier=".cg").to(qkv_ptr.dtype.element_ty)
                                        vr = v_ptr + kb + n[:, None].to(tl.int64) * sk_t + d[None, :]
                                        v = tl.load(vr, mask=nmask[:, None] & dm[None, :], other=0.0,
                                                    cache_modifier=".cg").to(qkv_ptr.dtype.element_ty)
                                        m_i, l_i, o = _att_block(q1, q2, k1, k2, v, nmask, m_i, l_i, o, qk_scale, DOT_F32)
                                _att_out(o, m_i, l_i, m, heads, sp, gm, d, dm, attn_ptr, part_ptr, ml_ptr, H, HD, NS)
                            if NS > 1:
                                _att_arrive(cnt_ptr, part_ptr, ml_ptr, attn_ptr, m, kvh, length, H, HKV, G, HD, NS, CHUNK,
                                            NS_B, HD_B)
                _prefetch(wgu_ptr + (l64 * 2 * I + pid * R_GU) * DIM, _own(pid, R_GU, I) * DIM // 4, THREADS,
                          (PREFETCH >> 2) & 1)
                _prefetch(wgu_ptr + (l64 * 2 * I + I + pid * R_GU) * DIM, _own(pid, R_GU, I) * DIM // 4, THREADS,
                          (PREFETCH >> 2) & 1)
            # ---- 2: o rows (from the merged attention output) + residual
            if (only < 0) | (only == NPH * layer + 2):
                row0 = pid * R_O
                wo = wo_ptr + l64 * DIM * (H * HD)
                w0 = _tile0(wo, row0, R_O, DIM, H * HD, BN_O, BK_O) if EARLY else 0
                if BARRIER:  # the attention output
                    _grid_barrier(cnt_ptr, P, SPIN_LIMIT, ONE_POLLER, THREADS, tr + (NPH * layer + 2) * 4, TRACE)
                acc = _rows_dot(attn_ptr, H * HD, wo, row0, R_O, DIM, H * HD, M, BN_O, BK_O, STAGES, DOT_F32, w0, EARLY,
                                (FMA >> 1) & 1)
                _add_residual(acc, src, res_ptr, row0, R_O, M, DIM, BN_O)
            # ---- 3: post-attention norm + gate|up rows + SwiGLU
            if (only < 0) | (only == NPH * layer + 3):
                row0 = pid * R_GU
                wg = wgu_ptr + l64 * 2 * I * DIM
                w0 = _tile0(wg, row0, R_GU, I, DIM, BN_GU, BK_GU) if EARLY else 0
                w20 = _tile0(wg + I * DIM, row0, R_GU, I, DIM, BN_GU, BK_GU) if EARLY else 0
                if BARRIER:  # the residual after attention
                    _grid_barrier(cnt_ptr, P, SPIN_LIMIT, ONE_POLLER, THREADS, tr + (NPH * layer + 3) * 4, TRACE)
                _norm_rows(res_ptr, nrm_ptr + (l64 * 2 + 1) * DIM, priv, DIM, M, DIM, eps, BLOCK_M, BD)
                tl.debug_barrier()
                if GU_ONE_LOOP:
                    gacc, uacc = _rows_dot2(priv, DIM, wg, wg + I * DIM, row0, R_GU, I, DIM, M, BN_GU, BK_GU, STAGES,
                                            DOT_F32, w0, w20, EARLY, (FMA >> 2) & 1)
                else:
                    gacc = _rows_dot(priv, DIM, wg, row0, R_GU, I, DIM, M, BN_GU, BK_GU, STAGES, DOT_F32, w0, EARLY, (FMA >> 2) & 1)
                    uacc = _rows_dot(priv, DIM, wg + I * DIM, row0, R_GU, I, DIM, M, BN_GU, BK_GU, STAGES, DOT_F32, w20,
                                     EARLY, (FMA >> 2) & 1)
                out_t = act_ptr.dtype.element_ty
                gv = gacc.to(out_t).to(tl.float32)
                sv = (gv / (1.0 + tl.exp(-gv))).to(out_t).to(tl.float32)
                y = sv * uacc.to(out_t).to(tl.float32)
                rn = row0 + tl.arange(0, BN_GU)
                nm = (tl.arange(0, BN_GU) < R_GU) & (rn < I)
                tl.store(act_ptr + rm16[:, None] * I + rn[None, :], y.to(out_t), mask=mm16[:, None] & nm[None, :])
                _prefetch(wd_ptr + (l64 * DIM + pid * R_D) * I, _own(pid, R_D, DIM) * I // 4, THREADS,
                          (PREFETCH >> 3) & 1)
            # ---- 4: down rows + residual
            if (only < 0) | (only == NPH * layer + 4):
                row0 = pid * R_D
                wd = wd_ptr + l64 * DIM * I
                w0 = _tile0(wd, row0, R_D, DIM, I, BN_D, BK_D) if EARLY else 0
                if BARRIER:  # the SwiGLU rows
                    _grid_barrier(cnt_ptr, P, SPIN_LIMIT, ONE_POLLER, THREADS, tr + (NPH * layer + 4) * 4, TRACE)
                acc = _rows_dot(act_ptr, I, wd, row0, R_D, DIM, I, M, BN_D, BK_D, STAGES, DOT_F32, w0, EARLY, (FMA >> 3) & 1)
                _add_residual(acc, res_ptr, res_ptr, row0, R_D, M, DIM, BN_D)
                if layer + 1 < L:
                    _prefetch(wqkv_ptr + ((l64 + 1) * NQKV + pid * R_QKV) * DIM, _own(pid, R_QKV, NQKV) * DIM, THREADS,
                              PREFETCH & 1)
        # ---- the final norm (one program: M rows of DIM)
        if (only < 0) | (only == NPH * L):
            if BARRIER:  # the last layer's down rows
                _grid_barrier(cnt_ptr, P, SPIN_LIMIT, ONE_POLLER, THREADS, tr + (NPH * L) * 4, TRACE)
            if pid == 0:
                _norm_rows(res_ptr, fnorm_ptr, h_ptr, DIM, M, DIM, eps, BLOCK_M, BD)

    return _stack_kernel


def _pow2_at_most(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _block_k(k: int, bn: int, tile: int = 8192) -> int:
    """The K step: a power of two dividing K, ~``tile`` weight elements per step, in [16, 512]."""
    bk = min(512, max(16, _pow2_at_most(tile // bn)))
    while k % bk:
        bk //= 2
    return bk


@dataclass
class StackWeights:
    """One decoder stack's weights stacked over layers (the engine's per-layer tensors are views):
    qkv [L, (H + 2 HKV) HD, DIM], o [L, DIM, H HD], gate_up [L, 2 I, DIM], down [L, DIM, I],
    norms [L, 2, DIM] (input, post-attention), final [DIM]."""

    qkv: Tensor
    o: Tensor
    gate_up: Tensor
    down: Tensor
    norms: Tensor
    final: Tensor
    n_heads: int
    n_kv_heads: int
    eps: float
    scratch: dict = field(default_factory=dict)  # per (programs, splits): the kernel's ``_Scratch``
    # the CUDA stack's L2 hints for these weights (decode_stack_cuda's ``keep``; None: its default)
    l2_keep: int | None = None
    # its L2 prefetches past a full ring (decode_stack_cuda's ``ahead``; None: its default)
    l2_ahead: int | None = None
    # its copies in flight while the consumers are close behind (decode_stack_cuda's ``burst``; None: its default)
    burst: int | None = None
    # ns its polls sleep after a word not yet written (decode_stack_cuda's ``backoff``; None: its default)
    backoff: int | None = None

    @property
    def head_dim(self) -> int:
        return self.qkv.shape[1] // (self.n_heads + 2 * self.n_kv_heads)

    @property
    def layer_bytes(self) -> int:
        """Bytes of the layers' projection weights: what one step streams (norms aside)."""
        return sum(t.numel() * t.element_size() for t in (self.qkv, self.o, self.gate_up, self.down))


class _Scratch:
    """Per (device, programs): the kernel's scratch buffers and the barrier counter."""

    def __init__(self, w: StackWeights, m: int, ns: int, programs: int) -> None:
        dim = w.qkv.shape[2]
        hd = w.head_dim
        inter = w.down.shape[2]
        dev, dt = w.qkv.device, w.qkv.dtype
        self.res = torch.empty((m, dim), device=dev, dtype=dt)
        self.qkv = torch.empty((m, w.qkv.shape[1]), device=dev, dtype=dt)
        self.attn = torch.empty((m, w.n_heads * hd), device=dev, dtype=dt)
        self.part = torch.empty((m, w.n_heads, ns, hd), device=dev, dtype=torch.float32)
        self.ml = torch.empty((m, w.n_heads, ns, 2), device=dev, dtype=torch.float32)
        self.act = torch.empty((m, inter), device=dev, dtype=dt)
        self.priv = torch.empty((programs, m, dim), device=dev, dtype=dt)
        self.counter = torch.zeros(2 + m * w.n_kv_heads, device=dev, dtype=torch.int64)


def takes_shapes(dim: int, inter: int, n_heads: int, head_dim: int) -> bool:
    """Whether the kernel takes a stack of these widths (tl.dot tiles of 16; RoPE halves >= 16)."""
    return dim % 16 == 0 and inter % 16 == 0 and (n_heads * head_dim) % 16 == 0 and head_dim % 2 == 0 and head_dim >= 32


def default_programs(device: torch.device) -> int:
    """One program per SM on CUDA; 3 under the interpreter (uneven row splits get exercised)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 3


def decode_stack(w: StackWeights, x: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor,
                 cos: Tensor, sin: Tensor, programs: int | None = None, prefetch: bool = False,
                 phases: list[int] | None = None, tune: dict | None = None, trace: Tensor | None = None) -> Tensor:
    """x [M, DIM] (M <= MAX_M), pos/slots [M] int64, caches [L, S, HKV, TMAX, HD], cos/sin [P, HD]
    -> the final-norm output [M, DIM]; writes each row's K/V at (slot, pos) of every layer.

    For probes (bench/stack_probe.py): ``phases`` launches just those phases, one a launch, with no
    grid barrier (also on the GPU; all of them, in order, compute the step); ``tune`` overrides
    launch_meta's switches and tiles (the keys of ``_TUNABLE``; WARPS sets the program's warps);
    ``trace`` (int64
    [P, PHASES L + 1, 4], one-launch form on the GPU only) receives each program's arrival and
    release times at every barrier: SM cycles in [..., 0:2], global ns in [..., 2:4]; [:, 0, 1] and
    [:, 0, 3] are the kernel's start (``trace_summary`` reads it)."""
    check(use_triton("decode_stack", x, w.qkv, k_cache), "decode_stack needs CUDA or the interpreter")
    m, dim = x.shape
    nl, _, wdim = w.qkv.shape
    h, hkv, hd = w.n_heads, w.n_kv_heads, w.head_dim
    inter = w.down.shape[2]
    check(1 <= m <= MAX_M and wdim == dim and x.is_contiguous(), f"x must be [1..{MAX_M}, {wdim}], got {tuple(x.shape)}")
    check(k_cache.shape[0] == nl and k_cache.shape[2] == hkv and k_cache.shape[4] == hd and k_cache.stride() == v_cache.stride()
          and k_cache.shape == v_cache.shape and k_cache.stride(4) == 1, "caches must be [L, S, HKV, TMAX, HD], one layout")
    check(pos.shape == (m,) and slots.shape == (m,) and pos.dtype == slots.dtype == torch.long, "pos, slots: int64 [M]")
    check(takes_shapes(dim, inter, h, hd), "the stack kernel needs dims that are multiples of 16 and an even head dim >= 32")
    kernel = _kernels()
    p = programs or default_programs(x.device)
    gpu = x.is_cuda and not interpret_mode()
    tune = dict(tune or {})
    warps = tune.pop("WARPS", _WARPS)
    check(warps in (4, _WARPS), f"WARPS must be 4 or {_WARPS}, got {warps}")
    meta = launch_meta(m, dim, h, hkv, hd, inter, nl, k_cache.shape[3], p, x.element_size(), gpu and prefetch,
                       x.dtype == torch.float32 or not x.is_cuda, warps)
    if tune:
        check(set(tune) <= _TUNABLE, f"tune takes {sorted(_TUNABLE)}")
        ks = {"BK_QKV": dim, "BK_O": h * hd, "BK_GU": dim, "BK_D": inter}
        for key, bk in tune.items():
            check(key not in ks or (bk >= 16 and bk & (bk - 1) == 0 and ks[key] % bk == 0),
                  f"{key}={bk}: a power of two >= 16 dividing {ks.get(key)}")
        check(0 <= tune.get("FMA", 0) <= 15, "FMA is a mask of phases: 1 q|k|v, 2 o, 4 gate|up, 8 down")
        check(0 <= tune.get("PREFETCH", 0) <= 15, "PREFETCH is a mask of phases: 1 q|k|v, 2 o, 4 gate|up, 8 down")
        meta.update(tune)
    # (applied to launch_meta's defaults as well as to ``tune``)
    if x.element_size() != 2 or k_cache.element_size() != 2 or not gpu:  # bulk prefetches: 2-byte, GPU only
        meta["ATT_PREFETCH"] = meta["ATT_EARLY"] = meta["PREFETCH"] = 0
    if m != 1:  # the elementwise GEMV phases take one row
        meta["FMA"] = 0
    if meta["ITEMS"] != 1:  # the hoisted attention item: one a program
        meta["ATT_REGS"] = 0
    ns = meta["NS"]
    sc = w.scratch.get((p, ns))
    if sc is None:  # (allocated once, before a CUDA-graph capture: the capture warm-up runs the step)
        sc = w.scratch[(p, ns)] = _Scratch(w, MAX_M, ns, p)
    out = torch.empty_like(x)
    if trace is not None:
        check(gpu and phases is None and trace.dtype == torch.int64 and trace.shape == (p, PHASES * nl + 1, 4)
              and trace.is_contiguous(), f"trace: int64 [{p}, {PHASES * nl + 1}, 4] on the GPU, one-launch form")
    args = (x, out, sc.res, sc.qkv, sc.attn, sc.part, sc.ml, sc.act, sc.priv, sc.counter,
            trace if trace is not None else sc.counter, w.qkv, w.o, w.gate_up, w.down,
            w.norms, w.final, k_cache, v_cache, cos, sin, pos, slots, float(w.eps), (1.0 / math.sqrt(hd)) * math.log2(math.e),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3), cos.stride(0))
    if gpu and phases is None:
        use_pdl = pdl(x)
        meta["TRACE"] = trace is not None
        fit = _resident_programs(kernel, args, p, warps, use_pdl, meta, x.device)
        check(p <= fit, f"{p} programs of {warps} warps cannot all be resident on this GPU ({fit} at most)")
        kernel[(p,)](*args, -1, BARRIER=True, PDL=use_pdl, num_warps=warps, num_stages=1, launch_pdl=use_pdl, **meta)
    else:
        for ph in range(PHASES * nl + 1) if phases is None else phases:  # the launch boundary is the barrier
            kernel[(p,)](*args, ph, BARRIER=False, PDL=False, num_warps=warps, num_stages=1, **meta)
    return out


_resident: dict[tuple, int] = {}


def _resident_programs(kernel, args: tuple, p: int, warps: int, use_pdl: bool, meta: dict,  # noqa: ANN001
                       device: torch.device) -> int:
    """How many programs of this compiled configuration fit on the GPU at once (the grid barrier
    needs every program resident): SMs x programs an SM by registers (allocated per warp in units
    of 256), shared memory (1 KB reserved a block) and threads; compiled once, then cached."""
    key = (tuple(sorted(meta.items())), warps, use_pdl, str(device))
    if key not in _resident:
        c = kernel.warmup(*args, -1, grid=(p,), BARRIER=True, PDL=use_pdl, num_warps=warps, num_stages=1,
                          launch_pdl=use_pdl, **meta)
        c._init_handles()
        props = torch.cuda.get_device_properties(device)
        regs_warp = -(-max(1, c.n_regs) * 32 // 256) * 256
        # (Hopper's figures where this torch does not report them)
        by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_warp * warps)
        by_smem = getattr(props, "shared_memory_per_multiprocessor", 233472) // (c.metadata.shared + 1024)
        by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
        _resident[key] = props.multi_processor_count * max(0, min(by_regs, by_smem, by_threads))
    return _resident[key]


def launch_meta(m: int, dim: int, h: int, hkv: int, hd: int, inter: int, n_layers: int, tmax: int, p: int,
                elem: int, prefetch: bool, dot_f32: bool, warps: int = _WARPS) -> dict:
    """The kernel's constexprs for M rows of a stack with these shapes on P programs of ``warps`` warps."""
    _kernels()  # (binds ``triton``)

    def rows(n: int) -> tuple[int, int]:  # rows per program, and the tile that holds them
        r = triton.cdiv(n, p)
        return r, max(16, triton.next_power_of_2(r))

    r_qkv, bn_qkv = rows((h + 2 * hkv) * hd)
    r_o, bn_o = rows(dim)
    r_gu, bn_gu = rows(inter)
    r_d, bn_d = rows(dim)
    # attention splits: ~one (row, kv head, split) item per program over the whole cache
    # (at most _MAX_SPLITS: the merge loads a row's splits at once)
    chunk = max(_BLOCK_N, triton.next_power_of_2(triton.cdiv(tmax * m * hkv, p)),
                triton.next_power_of_2(triton.cdiv(tmax, _MAX_SPLITS)))
    ns = triton.cdiv(tmax, chunk)
    busy = m * hkv * ns  # attention items: (row, kv head, split)
    bd = min(4096, _pow2_at_most(dim))
    while dim % bd:
        bd //= 2
    return dict(
        M=m, DIM=dim, H=h, HKV=hkv, HD=hd, I=inter, L=n_layers, TMAX=tmax, CHUNK=chunk, NS=ns, NS_B=triton.next_power_of_2(ns), P=p,
        R_QKV=r_qkv, BN_QKV=bn_qkv, BK_QKV=_block_k(dim, bn_qkv),
        R_O=r_o, BN_O=bn_o, BK_O=_block_k(h * hd, bn_o),
        R_GU=r_gu, BN_GU=bn_gu, BK_GU=_block_k(dim, bn_gu, 4096),
        R_D=r_d, BN_D=bn_d, BK_D=_block_k(inter, bn_d),
        STAGES=4, BD=bd, BLOCK_M=triton.next_power_of_2(m), BLOCK_G=max(16, triton.next_power_of_2(h // hkv)),
        HALF_B=triton.next_power_of_2(hd // 2), HD_B=triton.next_power_of_2(hd),
        ITEMS=triton.cdiv(busy, p),
        THREADS=32 * warps, BLOCK_KV=_BLOCK_N, NPH=PHASES, SPIN_LIMIT=_SPIN_LIMIT,
        PREFETCH=15 if prefetch and elem == 2 else 0, DOT_F32=dot_f32, GU_ONE_LOOP=True, ONE_POLLER=True, EARLY=0,
        # At one row, measured fastest on an H100 (2026-12-06, bench/stack_probe.py --quick): 1,124 ->
        # 964 us a Llama-3.2-1B step. ATT_REGS needs one attention item a program; ATT_PREFETCH
        # (GPU, 2-byte weights: decode_stack) needs as many idle programs as busy ones, or its
        # unrolled loop over the busy programs' slices spills hundreds of bytes. Other row counts
        # have not been timed with them: the plain form.
        FMA=15 if m == 1 else 0, ATT_EARLY=0, TRACE=False,
        ATT_PREFETCH=4 if m == 1 and elem == 2 and 2 * busy <= p else 0,
        ATT_REGS=1 if m == 1 and busy <= p else 0,
    )


def trace_summary(trace: Tensor) -> tuple[float, list[dict]]:
    """(SM clock in Hz, per barrier site j of a traced step (``decode_stack(..., trace=)``) the phase
    before it as the programs saw it): work = arrival_j - release_(j-1) on each program's own SM
    clock, in µs: mean, min and max over programs; wait = release_j - arrival_j, mean; the spread
    of the arrivals on the global timer (last - first, µs). Slot 0 holds the start only. The clock
    rate is the median over programs of (cycles / global ns) from the start to the last release."""
    t = trace.detach().to("cpu", torch.float64)
    clock_hz = float(((t[:, -1, 1] - t[:, 0, 1]) / (t[:, -1, 3] - t[:, 0, 3]).clamp(min=1)).median()) * 1e9
    out = []
    for j in range(1, t.shape[1]):
        work = (t[:, j, 0] - t[:, j - 1, 1]) / clock_hz * 1e6
        wait = (t[:, j, 1] - t[:, j, 0]) / clock_hz * 1e6
        arr = t[:, j, 2]
        out.append(dict(site=j, phase=(j - 1) % PHASES, work_mean_us=float(work.mean()),
                        work_min_us=float(work.min()), work_max_us=float(work.max()), wait_mean_us=float(wait.mean()),
                        arrival_spread_us=float(arr.max() - arr.min()) / 1e3))
    return clock_hz, out


def errors(w: StackWeights) -> int:
    """How many of this stack's launches hit the barrier's poll limit (a bug: then results are
    wrong); reads the device flag (a sync)."""
    return sum(int(sc.counter[1]) for sc in w.scratch.values() if isinstance(sc, _Scratch))


def stack_weights(transformer) -> StackWeights:  # noqa: ANN001
    """Stack a fused ``engines.transformer.Transformer``'s layer weights (layer by layer, so the
    peak is one layer more than the model) and re-point the layers' tensors at the stacked copy."""
    from realtime.engines.transformer import point_params_at

    layers = transformer.layers
    cfg = transformer.cfg

    def stack(get, params, buffer: str | None = None) -> Tensor:  # noqa: ANN001
        # out[i] = get(layer i); the layer's params (and its fused buffer, if any) then point into it
        t0 = get(layers[0])
        out = torch.empty((len(layers), *t0.shape), device=t0.device, dtype=t0.dtype)
        for i, layer in enumerate(layers):
            with torch.no_grad():
                out[i].copy_(get(layer))
            owner, names = params(layer)
            if buffer is not None:
                setattr(owner, buffer, out[i])
            point_params_at([getattr(owner, n).weight for n in names], out[i])
        return out

    qkv = stack(lambda la: la.self_attn.qkv_weight, lambda la: (la.self_attn, ("q_proj", "k_proj", "v_proj")), "qkv_weight")
    o = stack(lambda la: la.self_attn.o_proj.weight.data, lambda la: (la.self_attn, ("o_proj",)))
    gu = stack(lambda la: la.mlp.gate_up_weight, lambda la: (la.mlp, ("gate_proj", "up_proj")), "gate_up_weight")
    down = stack(lambda la: la.mlp.down_proj.weight.data, lambda la: (la.mlp, ("down_proj",)))
    norms = stack(lambda la: torch.cat([la.input_layernorm.weight.data, la.post_attention_layernorm.weight.data]),
                  lambda la: (la, ("input_layernorm", "post_attention_layernorm")))
    return StackWeights(qkv, o, gu, down, norms.view(len(layers), 2, cfg.dim), transformer.norm.weight.data, cfg.n_heads,
                        cfg.n_kv_heads, cfg.rms_eps)
