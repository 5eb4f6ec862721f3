"""Fused sampling: temperature, top-k and Gumbel-max in one kernel, one program per row.

Same contract and the same counter-based noise as ``realtime.engines.sampling.sample`` with
top_p = 1 (no top-p here): the uniform noise is the integer hash of (seed, step, vocab index),
bit for bit; temperature uses an IEEE-rounded division and, on the GPU, the Gumbel transform uses
libdevice's accurate logf like PyTorch's CUDA log, so tokens equal the engine's. Two documented
differences, both measure-zero for real logits: ties at the top-k boundary keep the lowest vocab
indices (a stable sort; torch.sort makes no promise), and -0.0 ranks below +0.0.

Top-k without a sort: a radix select finds the k-th largest temperature-scaled logit (4 passes,
8 bits each, over an order-preserving uint32 key), then a final pass adds the noise and takes the
argmax over the kept tokens. Rows with top-k off or greedy rows skip the select.

Small vocabularies (V <= 8192: CSM's 2051 audio codes) take a second kernel that holds the whole
row in registers and finds the same k-th largest key either by bisection over its 32 bits (32
counting reductions, no re-reads of the row; 16 for bf16/fp16 logits, whose own bits order them
as their scaled float32 values) or by radix select 4 bits a pass (8 or 4 histograms of 16 bins);
both return the same tokens. Which of the two, and its warps per row, are measured once per
vocabulary size on the GPU (``_small_config``).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ._triton import check, graph_time, pdl_jit, pdl_launch, use_triton

__all__ = ["sample", "sample_ref", "choices", "gumbel_argmax", "gumbel_argmax_ref", "advance_rows", "advance_rows_ref",
           "advance_work"]

_BLOCK_V = 2048  # vocab entries per inner step
_SMALL_V = 8192  # rows up to this size are held in registers by the small-vocabulary kernel (< 2**16)


def sample_ref(logits: Tensor, temperature: Tensor, top_k: Tensor, seeds: Tensor, steps: Tensor) -> Tensor:
    """PyTorch reference: the engine sampler with top-p off. logits [B, V] -> tokens [B] long."""
    from realtime.engines.sampling import sample as engine_sample

    top_p = torch.ones(logits.shape[0], device=logits.device, dtype=torch.float32)
    return engine_sample(logits, temperature, top_k, top_p, seeds, steps)


@functools.cache
def _kernels():
    # The jit'd functions resolve `tl`, `libdevice` and the helper through module globals.
    global triton, tl, libdevice, _hash32, _row_key, _row_temp, _row_setup, _radix_digit, _gumbel, _chunk_best, _pdl_enter
    import triton
    import triton.language as tl
    _pdl_enter = pdl_jit()
    from triton.language.extra import libdevice

    @triton.jit
    def _hash32(x):
        # lowbias32 xor-shift-multiply on uint32 (wraps mod 2**32), = engines.sampling._hash32.
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        x = x ^ (x >> 16)
        return x

    @triton.jit
    def _row_key(seed_ptr, step_ptr, row):
        # The row key of the noise: the 64-bit seed and step folded in, each fold re-hashed (as the
        # engine does).
        seed = tl.load(seed_ptr + row)
        step = tl.load(step_ptr + row)
        key = _hash32((seed & 0xFFFFFFFF).to(tl.uint32))
        key = _hash32(key ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32) ^ 0x9E3779B9)
        key = _hash32(key ^ (step & 0xFFFFFFFF).to(tl.uint32))
        return _hash32(key ^ ((step >> 32) & 0xFFFFFFFF).to(tl.uint32) ^ 0x85EBCA6B)

    @triton.jit
    def _row_temp(temp_ptr, row):
        # The row's temperature (1 for a greedy row, so scaling leaves its logits as they are).
        temp = tl.load(temp_ptr + row)
        greedy = temp <= 0
        return tl.where(greedy, 1.0, temp), greedy

    @triton.jit
    def _row_setup(row, temp_ptr, topk_ptr, seed_ptr, step_ptr, V):
        # Per-row parameters and the row key of the noise.
        temp, greedy = _row_temp(temp_ptr, row)
        k = tl.load(topk_ptr + row)
        topk_on = (k > 0) & (k < V) & (temp > 0) & (~greedy)
        return temp, greedy, k, topk_on, _row_key(seed_ptr, step_ptr, row)

    @triton.jit
    def _radix_digit(hist, bins, k_rem, thr, shift):
        # One radix-select pass: hist [bins] counts the digit at ``shift`` among the keys that share
        # the bits chosen so far; the digit holding the k_rem-th largest joins thr, and k_rem drops
        # by the keys with a larger digit. -> (k_rem, thr)
        ge = tl.cumsum(hist, 0, reverse=True)  # ge[d] = #group keys with digit >= d
        dsel = tl.max(tl.where(ge >= k_rem, bins, -1), 0)
        above = tl.sum(tl.where(bins == dsel, ge - hist, 0), 0)  # keys with a larger digit
        return k_rem - above, thr | (dsel.to(tl.uint32) << shift)

    @triton.jit
    def _gumbel(key, idx, LIBDEVICE_LOG: tl.constexpr):
        # Uniform noise in (0, 1) from 24 hash bits of (row key, vocab index), exact in float32;
        # then Gumbel(0, 1) (libdevice's accurate log on the GPU, like PyTorch's CUDA log).
        h = _hash32(key ^ _hash32(idx.to(tl.uint32) + 0x27D4EB2F))
        h = _hash32(h ^ 0x165667B1)
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        if LIBDEVICE_LOG:
            return -libdevice.log(-libdevice.log(u))
        return -tl.log(-tl.log(u))

    @triton.jit
    def _chunk_best(logits_ptr, row, stride_l, chunk, V, temp_ptr, seed_ptr, step_ptr, prow,
                    SAMPLED: tl.constexpr, BLOCK_V: tl.constexpr, LIBDEVICE_LOG: tl.constexpr):
        # Chunk `chunk` of logits row `row` -> (its largest score, the first vocab index holding it);
        # the score is the logit, or with SAMPLED the logit / temperature + Gumbel noise of the
        # per-row parameters at index prow (a greedy row: the logit); gumbel_argmax's and
        # advance_rows' chunks
        idx = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
        valid = idx < V
        x = tl.load(logits_ptr + row * stride_l + idx, mask=valid, other=0.0).to(tl.float32)
        if SAMPLED:
            temp, greedy = _row_temp(temp_ptr, prow)  # (no top-k here)
            key = _row_key(seed_ptr, step_ptr, prow)
            x = tl.math.div_rn(x, temp)
            x = tl.where(greedy, x, x + _gumbel(key, idx, LIBDEVICE_LOG))
        val = tl.where(valid, x, float("-inf"))
        return tl.max(val, 0), tl.argmax(val, 0).to(tl.int64) + chunk * BLOCK_V

    @triton.jit
    def _sample_kernel(
        logits_ptr,  # *logits [B, V] (any float dtype), row stride stride_l, unit column stride
        temp_ptr,  # *temperature [B] float32 (<= 0: greedy)
        topk_ptr,  # *top_k [B] int64 (<= 0 or >= V: off)
        seed_ptr,  # *seeds [B] int64
        step_ptr,  # *steps [B] int64
        out_ptr,  # *tokens [B] int64 output
        V,
        stride_l,
        N_BLOCKS: tl.constexpr,
        BLOCK_V: tl.constexpr,
        LIBDEVICE_LOG: tl.constexpr,
        PDL: tl.constexpr = False,  # launched with programmatic dependent launch (see _triton.pdl)
    ):
        _pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride_l
        temp, greedy, k, topk_on, key = _row_setup(row, temp_ptr, topk_ptr, seed_ptr, step_ptr, V)

        # Radix select of the k-th largest scaled logit: `thr` its order key, `k_rem` how many of the
        # entries equal to it are kept (the first ones in vocab order).
        thr = tl.full([], 0, tl.uint32)
        k_rem = k.to(tl.int32)
        if topk_on:
            bins = tl.arange(0, 256)
            for p in tl.static_range(4):
                shift = 24 - 8 * p  # constexpr: p is a static_range index
                hist = tl.zeros([256], tl.int32)
                for i in range(N_BLOCKS):
                    idx = i * BLOCK_V + tl.arange(0, BLOCK_V)
                    valid = idx < V
                    x = tl.math.div_rn(tl.load(base + idx, mask=valid, other=0.0).to(tl.float32), temp)
                    bits = x.to(tl.uint32, bitcast=True)
                    # Order-preserving key: flip all bits of negatives, the sign bit of positives.
                    okey = bits ^ tl.where((bits >> 31) != 0, 0xFFFFFFFF, 0x80000000).to(tl.uint32)
                    if p == 0:
                        grp = valid
                    else:
                        grp = valid & (((okey ^ thr) >> (shift + 8)) == 0)
                    digit = ((okey >> shift) & 0xFF).to(tl.int32)
                    hist += tl.histogram(digit, 256, mask=grp)
                k_rem, thr = _radix_digit(hist, bins, k_rem, thr, shift)

        best = tl.full([], float("-inf"), tl.float32)
        best_idx = tl.full([], 0, tl.int64)
        ties_before = tl.full([], 0, tl.int32)
        for i in range(N_BLOCKS):
            idx = i * BLOCK_V + tl.arange(0, BLOCK_V)
            valid = idx < V
            x = tl.math.div_rn(tl.load(base + idx, mask=valid, other=0.0).to(tl.float32), temp)
            bits = x.to(tl.uint32, bitcast=True)
            okey = bits ^ tl.where((bits >> 31) != 0, 0xFFFFFFFF, 0x80000000).to(tl.uint32)
            eq = valid & (okey == thr)
            eq_i = eq.to(tl.int32)
            tie_rank = ties_before + tl.cumsum(eq_i, 0) - eq_i
            ties_before += tl.sum(eq_i, 0)
            keep = (~topk_on) | (okey > thr) | (eq & (tie_rank < k_rem))
            val = tl.where(greedy, x, tl.where(keep, x + _gumbel(key, idx, LIBDEVICE_LOG), float("-inf")))
            val = tl.where(valid, val, float("-inf"))
            bmax = tl.max(val, 0)
            barg = tl.argmax(val, 0).to(tl.int64) + i * BLOCK_V
            # Strictly greater: on equal values the first index wins, like torch.argmax.
            best_idx = tl.where(bmax > best, barg, best_idx)
            best = tl.maximum(best, bmax)
        tl.store(out_ptr + row, best_idx)

    @triton.jit
    def _sample_small_kernel(
        logits_ptr,  # *logits [B, V] (any float dtype), row stride stride_l, unit column stride
        temp_ptr,  # *temperature [B] float32 (<= 0: greedy)
        topk_ptr,  # *top_k [B] int64 (<= 0 or >= V: off)
        seed_ptr,  # *seeds [B] int64
        step_ptr,  # *steps [B] int64
        out_ptr,  # *tokens [B] int64 output
        V,
        stride_l,
        BLOCK_V: tl.constexpr,  # >= V: the whole row in one block
        LIBDEVICE_LOG: tl.constexpr,
        KEY_BITS: tl.constexpr = 32,  # 16 for bf16/fp16 logits: rank by their own bits
        DIGIT_BITS: tl.constexpr = 1,  # 1: bisection, one count a bit; 4: radix, a 16-bin histogram a digit
        PDL: tl.constexpr = False,  # launched with programmatic dependent launch (see _triton.pdl)
    ):
        _pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        temp, greedy, k, topk_on, key = _row_setup(row, temp_ptr, topk_ptr, seed_ptr, step_ptr, V)

        idx = tl.arange(0, BLOCK_V)
        valid = idx < V
        raw = tl.load(logits_ptr + row * stride_l + idx, mask=valid, other=0.0)
        x = tl.math.div_rn(raw.to(tl.float32), temp)
        if KEY_BITS == 16:
            # 16-bit logits: dividing by a positive temperature keeps their order and distinctness
            # (the float32 quotient of two 8- or 11-bit mantissas cannot round together short of
            # overflow or underflow), so their own bits rank them: half the counting steps.
            bits = raw.to(tl.uint16, bitcast=True).to(tl.uint32)
            okey = bits ^ tl.where((bits >> 15) != 0, 0xFFFF, 0x8000).to(tl.uint32)
        else:
            bits = x.to(tl.uint32, bitcast=True)
            okey = bits ^ tl.where((bits >> 31) != 0, 0xFFFFFFFF, 0x80000000).to(tl.uint32)

        # The k-th largest key = the largest t with #(okey >= t) >= k: set its bits from the top,
        # one counting reduction a bit. (Two bits a step with three int64-packed counts measured
        # slower on the H200: 32.3 vs 26.0 us a row.)
        thr = tl.full([], 0, tl.uint32)
        k_rem = k.to(tl.int32)
        if topk_on:
            if DIGIT_BITS == 1:
                one = tl.full([], 1, tl.uint32)
                for bit in tl.static_range(KEY_BITS):
                    cand = thr | (one << (KEY_BITS - 1 - bit))
                    cnt = tl.sum((valid & (okey >= cand)).to(tl.int32), 0)
                    thr = tl.where(cnt >= k_rem, cand, thr)
                k_rem = k_rem - tl.sum((valid & (okey > thr)).to(tl.int32), 0)
            else:
                # Radix select as in _sample_kernel, DIGIT_BITS a pass, the row in registers: the
                # digit's histogram among the keys that share the bits chosen so far.
                NB: tl.constexpr = 1 << DIGIT_BITS
                bins = tl.arange(0, NB)
                for p in tl.static_range(KEY_BITS // DIGIT_BITS):
                    shift = KEY_BITS - DIGIT_BITS * (p + 1)  # constexpr
                    if p == 0:
                        grp = valid
                    else:
                        grp = valid & (((okey ^ thr) >> (shift + DIGIT_BITS)) == 0)
                    hist = tl.histogram(((okey >> shift) & (NB - 1)).to(tl.int32), NB, mask=grp)
                    k_rem, thr = _radix_digit(hist, bins, k_rem, thr, shift)
        eq = valid & (okey == thr)
        eq_i = eq.to(tl.int32)
        tie_rank = tl.cumsum(eq_i, 0) - eq_i
        keep = (~topk_on) | (okey > thr) | (eq & (tie_rank < k_rem))
        val = tl.where(greedy, x, tl.where(keep, x + _gumbel(key, idx, LIBDEVICE_LOG), float("-inf")))
        val = tl.where(valid, val, float("-inf"))
        tl.store(out_ptr + row, tl.argmax(val, 0).to(tl.int64))

    return _sample_kernel, _sample_small_kernel


def _check_rows(logits: Tensor, **rows: Tensor) -> tuple[int, int]:
    """The launchers' argument checks: float logits [B, V] with a unit stride over V, and [B] per-row
    tensors. -> (B, V)."""
    check(logits.dim() == 2 and logits.is_floating_point(), f"logits must be float [B, V], got {logits.dtype} {tuple(logits.shape)}")
    b, v = logits.shape
    for name, t in rows.items():
        check(t.shape == (b,), f"{name} must be [B={b}], got {tuple(t.shape)}")
    check(logits.stride(-1) == 1, "logits must have a unit stride over V")
    check(0 < v < 2**31 - _BLOCK_V, f"V must be in [1, 2**31), got {v}")
    return b, v


def gumbel_argmax_ref(logits: Tensor, temperature: Tensor, seeds: Tensor, steps: Tensor) -> Tensor:
    """PyTorch reference: the engine sampler with top-k and top-p off. logits [B, V] -> tokens [B] long."""
    from realtime.engines.sampling import sample as engine_sample

    b = logits.shape[0]
    off_k = torch.zeros(b, device=logits.device, dtype=torch.long)
    off_p = torch.ones(b, device=logits.device, dtype=torch.float32)
    return engine_sample(logits, temperature, off_k, off_p, seeds, steps, filtered=False)


@functools.cache
def _chunk_kernel():
    _kernels()  # the shared jit helpers (_chunk_best, _pdl_enter) into the module globals

    @triton.jit
    def _gumbel_chunk_kernel(
        logits_ptr,  # *logits [B, V] (any float dtype), row stride stride_l, unit column stride
        temp_ptr,  # *temperature [B] float32 (<= 0: greedy)
        seed_ptr,  # *seeds [B] int64
        step_ptr,  # *steps [B] int64
        val_ptr,  # *[B, C] float32 output: the chunk's largest (noisy) value
        idx_ptr,  # *[B, C] int64 output: the first vocab index holding it
        V,
        stride_l,
        C,
        BLOCK_V: tl.constexpr,
        LIBDEVICE_LOG: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        _pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        best, first = _chunk_best(logits_ptr, row, stride_l, chunk, V, temp_ptr, seed_ptr, step_ptr, row,
                                  True, BLOCK_V, LIBDEVICE_LOG)
        tl.store(val_ptr + row * C + chunk, best)
        tl.store(idx_ptr + row * C + chunk, first)

    return _gumbel_chunk_kernel


def gumbel_argmax(logits: Tensor, temperature: Tensor, seeds: Tensor, steps: Tensor) -> Tensor:
    """logits [B, V]; temperature [B] (<= 0: greedy); seeds, steps [B] -> tokens [B] long.

    = ``realtime.engines.sampling.sample(..., top_k off, top_p off, filtered=False)``, the text API's
    default sampling (temperature only), for wide rows: the row is cut into chunks of BLOCK_V, one
    program each computes the chunk's noisy values (the same hash noise and Gumbel transform as
    ``sample``) and its largest with the first index; two small torch ops pick the first chunk
    holding the row's largest. ``sample`` gives a row one program, which took 160 µs for one
    128,256-token row on the H200; this spreads the row over ~63 programs.
    """
    if not use_triton("gumbel_argmax", logits, temperature, seeds, steps):
        return gumbel_argmax_ref(logits, temperature, seeds, steps)
    b, v = _check_rows(logits, temperature=temperature, seeds=seeds, steps=steps)
    kernel = _chunk_kernel()
    if b == 0:
        return torch.empty(0, device=logits.device, dtype=torch.long)
    c = triton.cdiv(v, _BLOCK_V)
    vals = torch.empty((b, c), device=logits.device, dtype=torch.float32)
    idxs = torch.empty((b, c), device=logits.device, dtype=torch.long)
    kernel[(b, c)](
        logits, temperature.to(dtype=torch.float32).contiguous(), seeds.to(dtype=torch.long).contiguous(),
        steps.to(dtype=torch.long).contiguous(), vals, idxs, v, logits.stride(0), c,
        BLOCK_V=_BLOCK_V, LIBDEVICE_LOG=logits.is_cuda, num_warps=4, **pdl_launch(logits),
    )
    # The first chunk holding the row's largest value (argmax keeps the first), then its first index.
    return idxs.gather(1, vals.argmax(dim=-1, keepdim=True))[:, 0]


# ---- a decode step's token and its slot's bookkeeping in one launch ------------------------------
#
# A served text step after its logits: each row's token (greedy, or temperature + Gumbel-max),
# then tok[slot] = token, pos[slot] += 1, steps[slot] += 1. As torch ops that is ~12 small launches
# (the float32 copy of the logits, the two-stage argmax, the gathers and index_puts); at batch 1 on
# an H200 they took ~30 µs of a ~780 µs step. Here the chunks' programs of a row fold their
# (value, index) into one int64 with an atomic max, and the row's last program (an atomic count)
# reads it and writes the bookkeeping: one launch.

_INT64_MIN = -(2**63)


def advance_work(rows: int, device: torch.device | str) -> tuple[Tensor, Tensor]:
    """advance_rows' scratch for up to ``rows`` rows: the packed maxima (int64, at their reset value)
    and the programs' counts (int32, 0). Each launch leaves them as it found them."""
    return (torch.full((rows,), _INT64_MIN, dtype=torch.long, device=device),
            torch.zeros(rows, dtype=torch.int32, device=device))


def advance_rows_ref(logits: Tensor, idx: Tensor, tok: Tensor, pos: Tensor, steps: Tensor, out: Tensor,
                     scratch: int, temperature: Tensor | None = None, seeds: Tensor | None = None) -> Tensor:
    """PyTorch reference of ``advance_rows`` (the same tokens and bookkeeping)."""
    from realtime.engines.sampling import greedy

    b = logits.shape[0]
    if temperature is None:
        nxt = greedy(logits)
    else:
        nxt = gumbel_argmax_ref(logits, temperature[idx], seeds[idx], steps[idx])
    out[:b] = nxt
    tok[idx] = nxt
    live = idx != scratch
    pos[idx] = torch.where(live, pos[idx] + 1, 0)
    steps[idx] = torch.where(live, steps[idx] + 1, 0)
    return out[:b]


@functools.cache
def _advance_kernel():
    _kernels()  # the shared jit helpers (_row_temp, _row_key, _gumbel, _pdl_enter) into the module globals

    @triton.jit
    def _advance_rows_kernel(
        logits_ptr,  # *logits [B, V] (any float dtype), row stride stride_l, unit column stride
        idx_ptr,  # *[B] int64: each row's slot
        tok_ptr, pos_ptr, step_ptr,  # *[slots] int64: a slot's next input token, position, sampler step
        temp_ptr,  # *[slots] float32 (<= 0: greedy); read only when SAMPLED
        seed_ptr,  # *[slots] int64; read only when SAMPLED
        out_ptr,  # *[B] int64: the tokens
        acc_ptr,  # *[B] int64 scratch: the packed (value, index) maxima, _INT64_MIN between launches
        cnt_ptr,  # *[B] int32 scratch: programs of the row done, 0 between launches
        V,
        stride_l,
        C,  # programs a row (chunks of BLOCK_V)
        SCRATCH,  # the padding slot: its position and step go back to 0, not on
        SAMPLED: tl.constexpr,
        BLOCK_V: tl.constexpr,
        LIBDEVICE_LOG: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        _pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        slot = tl.load(idx_ptr + row)
        # (as gumbel_argmax's chunks, with the slot's temperature, seed and step)
        best, first = _chunk_best(logits_ptr, row, stride_l, chunk, V, temp_ptr, seed_ptr, step_ptr, slot,
                                  SAMPLED, BLOCK_V, LIBDEVICE_LOG)
        best = tl.where(best == 0.0, 0.0, best)  # -0.0 ties +0.0, as argmax has it
        bits = best.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # float order as signed int32 order
        # larger value first, then the smaller index: the first chunk holding the row's largest
        tl.atomic_max(acc_ptr + row, (ordered.to(tl.int64) << 32) | (4294967295 - first))
        # (acq_rel: every program's reads of the step and its max are done before its count; the
        # row's last program then sees them all)
        done = tl.atomic_add(cnt_ptr + row, 1)
        if done == C - 1:
            packed = tl.atomic_xchg(acc_ptr + row, -9223372036854775807 - 1)
            tl.atomic_xchg(cnt_ptr + row, 0)
            token = 4294967295 - (packed & 4294967295)
            tl.store(out_ptr + row, token)
            tl.store(tok_ptr + slot, token)
            live = slot != SCRATCH
            tl.store(pos_ptr + slot, tl.where(live, tl.load(pos_ptr + slot) + 1, 0))
            tl.store(step_ptr + slot, tl.where(live, tl.load(step_ptr + slot) + 1, 0))

    return _advance_rows_kernel


def advance_rows(logits: Tensor, idx: Tensor, tok: Tensor, pos: Tensor, steps: Tensor, out: Tensor, scratch: int,
                 temperature: Tensor | None = None, seeds: Tensor | None = None,
                 work: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """A decode step's tokens and its slots' bookkeeping in one launch -> out[:B] (the tokens).

    logits [B, V] (bf16 or float32; B rows, row i for slot idx[i]); tok, pos, steps [slots] int64:
    each slot's next input token, position and sampler step. Row i's token is the argmax of its
    logits (``temperature`` None), or ``gumbel_argmax``'s pick with the slot's temperature, seed and
    step (``temperature`` and ``seeds`` [slots]). Then tok[slot] = token and pos, steps of the slot
    + 1, except for ``scratch`` (a graph's padding slot), whose position and step go back to 0.
    Slots other than ``scratch`` appear once in ``idx``. ``work``: ``advance_work`` of at least B
    rows, kept by the caller (a CUDA graph replays with the same one); None allocates one.
    """
    b, v = _check_rows(logits, idx=idx)
    sampled = temperature is not None
    check(not sampled or seeds is not None, "sampled rows need seeds")
    extra = (temperature, seeds) if sampled else ()
    if not use_triton("advance_rows", logits, idx, tok, pos, steps, out, *extra):
        return advance_rows_ref(logits, idx, tok, pos, steps, out, scratch, temperature, seeds)
    if b == 0:
        return out[:0]
    for name, t in (("tok", tok), ("pos", pos), ("steps", steps), ("idx", idx), ("out", out)):
        check(t.dtype == torch.long and t.is_contiguous(), f"{name} must be contiguous int64")
    check(out.shape[0] >= b, f"out must hold {b} rows, has {out.shape[0]}")
    if work is None:
        work = advance_work(b, logits.device)
    acc, cnt = work
    check(acc.shape[0] >= b and cnt.shape[0] >= b, f"work must hold {b} rows")
    if sampled:
        temp = temperature if temperature.dtype == torch.float32 else temperature.float()
        seed = seeds if seeds.dtype == torch.long else seeds.long()
    else:
        temp, seed = tok, tok  # (not read)
    kernel = _advance_kernel()  # (first: it imports triton)
    c = triton.cdiv(v, _BLOCK_V)
    kernel[(b, c)](
        logits, idx, tok, pos, steps, temp, seed, out, acc, cnt, v, logits.stride(0), c, int(scratch),
        SAMPLED=sampled, BLOCK_V=_BLOCK_V, LIBDEVICE_LOG=logits.is_cuda, num_warps=4, **pdl_launch(logits),
    )
    return out[:b]


_WARP_OPTIONS = (4, 8, 16, 32)  # fewer than 4: 64+ keys a thread (slow; one warp takes minutes of ptxas)
_DIGIT_OPTIONS = (1, 4)  # bits a select step: bisection (a count a bit) or radix (a 16-bin histogram a digit)
_UNMEASURED = (1, 8)  # (digit bits, warps): the CPU interpreter, or a first call inside a CUDA-graph capture
_small_choice: dict[tuple, tuple[int, int]] = {}
_small_timings: dict[tuple, dict[tuple[int, int], float]] = {}


def _small_config(v: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int]:
    """(digit bits, warps) a row for the small-vocabulary kernel, measured once per (V, dtype, device).

    The select's 16 or 32 counting reductions (bisection), or its 4 or 8 histograms (radix, 4 bits a
    pass), are block-wide; with fewer warps each is a shuffle within fewer warps and less shared
    memory, but each thread holds more of the row. Which wins depends on V and the GPU, so the first
    call outside a CUDA-graph capture times 64 launches of each option (replayed from a graph,
    median of 5) on a random [1, V] row and keeps the fastest; every option gives the same tokens.
    """
    key = (v, dtype, str(device))
    if key in _small_choice:
        return _small_choice[key]
    if torch.cuda.is_current_stream_capturing():
        return _UNMEASURED  # cannot time now; the warm-up before a capture normally made the choice
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(1, v, device=device, generator=gen).to(dtype) * 3
    temp = torch.ones(1, device=device)
    top_k = torch.full((1,), 50, dtype=torch.long, device=device)
    seeds = torch.zeros(1, dtype=torch.long, device=device)
    steps = torch.zeros(1, dtype=torch.long, device=device)
    times: dict[tuple[int, int], float] = {}
    with torch.cuda.device(device):
        for db in _DIGIT_OPTIONS:
            for w in _WARP_OPTIONS:  # µs a row: 64 launches replayed from one graph, median of 5
                run = functools.partial(sample, logits, temp, top_k, seeds, steps, num_warps=w, digit_bits=db)
                times[(db, w)] = graph_time([run] * 64) * 1e6
    best = min(times, key=times.__getitem__)
    _small_choice[key], _small_timings[key] = best, times
    return best


def choices() -> list[dict]:
    """The small-vocabulary kernel's measured (digit bits, warps) per (V, dtype, device): µs per row
    for each option, keyed "bits/warps"."""
    return [{"V": k[0], "dtype": str(k[1]), "device": k[2], "digit_bits": _small_choice[k][0],
             "warps": _small_choice[k][1], "us": {f"{db}/{w}": round(t, 2) for (db, w), t in _small_timings[k].items()}}
            for k in _small_timings]


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, seeds: Tensor, steps: Tensor,
           num_warps: int | None = None, digit_bits: int | None = None) -> Tensor:
    """logits [B, V]; temperature [B] (<= 0: greedy); top_k [B] (<= 0: off); seeds, steps [B] -> tokens [B] long.

    = ``realtime.engines.sampling.sample(logits, temperature, top_k, ones, seeds, steps)``.
    No host sync: per-row scalars are cast on the device. ``num_warps`` and ``digit_bits`` (1 or 4)
    override the measured choice for small vocabularies (see ``_small_config``; tests run every
    option).
    """
    if not use_triton("sample", logits, temperature, top_k, seeds, steps):
        return sample_ref(logits, temperature, top_k, seeds, steps)
    b, v = _check_rows(logits, temperature=temperature, top_k=top_k, seeds=seeds, steps=steps)
    kernel, small_kernel = _kernels()
    out = torch.empty(b, device=logits.device, dtype=torch.long)
    if b == 0:
        return out
    temp = temperature.to(dtype=torch.float32).contiguous()
    k = top_k.to(dtype=torch.long).contiguous()
    sd = seeds.to(dtype=torch.long).contiguous()
    st = steps.to(dtype=torch.long).contiguous()
    check(digit_bits in (None, *_DIGIT_OPTIONS), f"digit_bits must be one of {_DIGIT_OPTIONS}, got {digit_bits}")
    if v <= _SMALL_V:
        if num_warps is None or digit_bits is None:
            db, warps = _small_config(v, logits.dtype, logits.device) if logits.is_cuda else _UNMEASURED
            num_warps, digit_bits = num_warps or warps, digit_bits or db
        small_kernel[(b,)](
            logits, temp, k, sd, st, out, v, logits.stride(0),
            BLOCK_V=triton.next_power_of_2(v), LIBDEVICE_LOG=logits.is_cuda, num_warps=num_warps,
            KEY_BITS=16 if logits.element_size() == 2 else 32, DIGIT_BITS=digit_bits, **pdl_launch(logits),
        )
        return out
    kernel[(b,)](
        logits, temp, k, sd, st, out, v, logits.stride(0),
        N_BLOCKS=triton.cdiv(v, _BLOCK_V), BLOCK_V=_BLOCK_V, LIBDEVICE_LOG=logits.is_cuda, num_warps=8,
        **pdl_launch(logits),
    )
    return out
