"""The codebook gather-and-sum kernel (kernels/codebook.py) vs its PyTorch reference, and Mimi's
projection-folded table vs the quantizer's own decode.

Without CUDA the kernel runs through Triton's CPU interpreter (TRITON_INTERPRET=1 set here before
any kernel is built). The @gpu test runs the compiled kernel against the reference on CUDA.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the first kernel build
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from realtime.codecs import mimi  # noqa: E402
from realtime.kernels.codebook import codebook_sum, codebook_sum_ref  # noqa: E402



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b, k, t, card, c", [(1, 32, 1, 64, 512), (3, 5, 2, 17, 130), (2, 1, 4, 8, 3)])
def test_codebook_sum(cpu_kernels, b, k, t, card, c, dtype):
    g = torch.Generator().manual_seed(b * k + c)
    table = torch.randn(k, card, c, generator=g)
    codes = torch.randint(0, card, (b, k, t + 1), generator=g)[..., 1:]  # a strided view, as a step slices
    out = codebook_sum(codes, table, dtype)
    assert out.shape == (b, c, t) and out.dtype == dtype and out.is_contiguous()
    want = codebook_sum_ref(codes, table, torch.float64 if dtype == torch.float32 else dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-5)
    else:  # the interpreter truncates the float32 sum to bf16: 1 ulp
        torch.testing.assert_close(out.float(), want.float(), rtol=1.6e-2, atol=1e-2)
    bad = codes.clone()
    bad[0, 0, 0] = card + 5  # clamped to the last row, never read outside the table
    clamped = codes.clone()
    clamped[0, 0, 0] = card - 1
    assert torch.equal(codebook_sum(bad, table, dtype), codebook_sum(clamped, table, dtype))


def test_codebook_sum_checks(cpu_kernels):
    with pytest.raises(ValueError, match="int64"):
        codebook_sum(torch.zeros(1, 2, 1, dtype=torch.int32), torch.zeros(2, 4, 3), torch.float32)
    with pytest.raises(ValueError, match="codebooks"):
        codebook_sum(torch.zeros(1, 3, 1, dtype=torch.long), torch.zeros(2, 4, 3), torch.float32)
    with pytest.raises(ValueError, match="float32"):
        codebook_sum(torch.zeros(1, 2, 1, dtype=torch.long), torch.zeros(2, 4, 3, dtype=torch.bfloat16), torch.float32)


def test_folded_table_equals_quantizer_decode(cpu_kernels):
    """The projection-folded table's sum equals SplitRVQ.decode (float32: up to summation order),
    and it is remade when a weight changes."""
    cfg = mimi.MimiConfig(hidden_size=32, codebook_size=16, codebook_dim=8, num_quantizers=4, upsample_groups=32)
    m = mimi.Mimi(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for q in (m.quantizer.semantic_residual_vector_quantizer, m.quantizer.acoustic_residual_vector_quantizer):
            q.codebooks.copy_(torch.randn(q.codebooks.shape, generator=g))
            q.output_proj.weight.copy_(torch.randn(q.output_proj.weight.shape, generator=g))
    codes = torch.randint(0, 16, (3, 4, 2), generator=g)
    table = m.quantizer.folded_table()
    assert table.shape == (4, 16, 32) and m.quantizer.folded_table() is table  # cached
    torch.testing.assert_close(codebook_sum(codes, table, torch.float32), m.quantizer.decode(codes, torch.float32),
                               rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        m.quantizer.acoustic_residual_vector_quantizer.output_proj.weight.mul_(2)
    assert m.quantizer.folded_table() is not table
    torch.testing.assert_close(codebook_sum(codes, m.quantizer.folded_table(), torch.float32),
                               m.quantizer.decode(codes, torch.float32), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_codebook_sum(dtype):
    g = torch.Generator().manual_seed(1)
    table = torch.randn(32, 2048, 512, generator=g).cuda()
    codes = torch.randint(0, 2048, (8, 32, 1), generator=g).cuda()
    out = codebook_sum(codes, table, dtype)
    want = codebook_sum_ref(codes.cpu(), table.cpu().double(), torch.float64)
    tol = dict(rtol=1e-6, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(out.cpu().double(), want, **tol)
