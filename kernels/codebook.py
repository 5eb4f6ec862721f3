"""The sum of one row from each of K codebooks, as one kernel: Mimi's RVQ decode in a streaming step.

Mimi decodes a code frame as sum_k codebook_k[code_k] for each of its two quantizers (semantic:
1 codebook, acoustic: 31), each followed by a 1x1 output projection, and adds the two. As PyTorch
ops that is ~17 small kernels a step (index arithmetic, two gathers, two sums, two casts, two
convs, an add). The projection is linear, so the decoder can fold it into the codebooks once
(``MimiStreamingDecoder``: table[k] = codebook_k @ W_q.T in float32, [K, card, C]) and a step is
then one gather-and-sum over K rows of that table:

    out[b, :, t] = sum_k table[k, codes[b, k, t], :]          (float32, then rounded once to out's dtype)

The reference rounds each quantizer's sum to the model dtype before its projection; this rounds
once at the end, so it differs from the reference by the model dtype's rounding (exact in float32
arithmetic up to the summation order).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from ._triton import check, pdl_jit, pdl_launch, use_triton

__all__ = ["codebook_sum", "codebook_sum_ref"]

_BLOCK_C = 128  # output channels per program


def codebook_sum_ref(codes: Tensor, table: Tensor, dtype: torch.dtype) -> Tensor:
    """PyTorch reference: codes [B, K, T] int64, table [K, card, C] float32 -> [B, C, T] in dtype."""
    k, card, c = table.shape
    idx = codes + (torch.arange(k, device=codes.device) * card)[None, :, None]
    return F.embedding(idx, table.reshape(k * card, c)).sum(dim=1).transpose(1, 2).to(dtype)


@functools.cache
def _kernel():
    global triton, tl, _pdl_enter  # the jit'd function resolves these through module globals
    import triton
    import triton.language as tl
    _pdl_enter = pdl_jit()

    @triton.jit
    def _codebook_sum_kernel(
        codes_ptr,  # *codes [B, K, T] int64, strides sc_b, sc_k, sc_t
        table_ptr,  # *table [K, CARD, C] float32, contiguous
        out_ptr,  # *out [B, C, T] contiguous
        T, CARD, C,
        sc_b, sc_k, sc_t,
        K: tl.constexpr,
        BLOCK_C: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        _pdl_enter(PDL)
        bt = tl.program_id(0).to(tl.int64)
        b = bt // T
        t = bt % T
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = c < C
        acc = tl.zeros([BLOCK_C], tl.float32)
        for k in range(K):
            code = tl.load(codes_ptr + b * sc_b + k * sc_k + t * sc_t)
            code = tl.minimum(tl.maximum(code, 0), CARD - 1)  # never a read outside the table
            acc += tl.load(table_ptr + (k * CARD + code) * C + c, mask=cm, other=0.0)
        tl.store(out_ptr + (b * C + c) * T + t, acc.to(out_ptr.dtype.element_ty), mask=cm)

    return _codebook_sum_kernel


def codebook_sum(codes: Tensor, table: Tensor, dtype: torch.dtype) -> Tensor:
    """codes [B, K, T] int64 (each in [0, card); the kernel clamps any other, where the reference's
    lookup fails), table [K, card, C] float32 contiguous -> out [B, C, T] in ``dtype``
    (contiguous): out[b, :, t] = sum_k table[k, codes[b, k, t]]."""
    if not use_triton("codebook_sum", codes, table):
        return codebook_sum_ref(codes, table, dtype)
    check(codes.dim() == 3 and codes.dtype == torch.long, f"codes must be [B, K, T] int64, got {tuple(codes.shape)} {codes.dtype}")
    check(table.dim() == 3 and table.dtype == torch.float32 and table.is_contiguous(),
          f"table must be a contiguous [K, card, C] float32, got {tuple(table.shape)} {table.dtype}")
    b, k, t = codes.shape
    check(table.shape[0] == k, f"codes have {k} codebooks, the table {table.shape[0]}")
    _, card, c = table.shape
    out = torch.empty((b, c, t), device=codes.device, dtype=dtype)
    if b * t == 0:
        return out
    _kernel()[(b * t, triton.cdiv(c, _BLOCK_C))](
        codes, table, out, t, card, c, *codes.stride(), K=k, BLOCK_C=_BLOCK_C, num_warps=4, **pdl_launch(codes),
    )
    return out
