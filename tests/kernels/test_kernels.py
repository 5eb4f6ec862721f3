"""Triton kernels vs their PyTorch references (and the engine code they replace).

On a machine without CUDA the kernels run through Triton's CPU interpreter (TRITON_INTERPRET=1 is
set here, before anything builds a kernel). The interpreter has two known bf16 gaps that the CPU
tolerances absorb: float32 -> bf16 casts truncate instead of rounding to nearest even (so bf16
results may be 1 ulp low), and tl.dot on bf16 multiplies raw bits (so decode attention dots in
float32 there). The @gpu tests run the same comparisons compiled on CUDA with bit-exactness where
the kernel promises it, plus CUDA-graph capture and a timing print.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the first kernel build (kernels import triton lazily)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import time  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402

from realtime.engines.sampling import sample as engine_sample  # noqa: E402
from realtime.engines.sampling import uniform_noise  # noqa: E402
from realtime.engines.transformer import KVCache, TransformerConfig  # noqa: E402
from realtime.kernels import _triton  # noqa: E402
from realtime.kernels import gemv  # noqa: E402
from realtime.kernels import sampling as fused_sampling  # noqa: E402
from realtime.kernels.decode_attention import decode_attention, decode_attention_ref  # noqa: E402
from realtime.kernels.rmsnorm import add_rmsnorm, add_rmsnorm_partials, add_rmsnorm_ref, rmsnorm, rmsnorm_ref  # noqa: E402
from realtime.kernels.rotary import apply_rotary, apply_rotary_ref, rotary_cache_write, rotary_cache_write_ref  # noqa: E402
from realtime.kernels.sampling import sample, sample_ref  # noqa: E402
from realtime.kernels.layernorm import scale_add_layernorm, scale_add_layernorm_ref  # noqa: E402
from realtime.kernels.window_attention import ring_write_ref, window_attention, window_attention_ref  # noqa: E402

# (rtol, atol) per dtype. bf16 has an 8-bit mantissa: 1 ulp is 2**-7 relative; the CPU
# interpreter's truncating casts can add up to ~2 more ulps through a chain of roundings.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 3e-2)}
DTYPES = [torch.float32, torch.bfloat16]



def _close(a, b, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------------------- rmsnorm

RMS_SHAPES = [(1, 64), (3, 5, 300), (2, 2048), (4, 1, 96)]


def _rms_inputs(shape, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(device, dtype)
    r = torch.randn(shape, generator=g).to(device, dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(device, dtype)
    return x, r, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", RMS_SHAPES)
def test_rmsnorm(cpu_kernels, shape, dtype):
    x, r, w = _rms_inputs(shape, dtype)
    y = rmsnorm(x, w, 1e-5)
    assert y.shape == x.shape and y.dtype == dtype
    _close(y, rmsnorm_ref(x, w, 1e-5), dtype)
    y, s = add_rmsnorm(x, r, w, 1e-6)
    y_ref, s_ref = add_rmsnorm_ref(x, r, w, 1e-6)
    assert s.dtype == dtype and y.dtype == dtype
    _close(s, s_ref, dtype)
    _close(y, y_ref, dtype)


def test_rmsnorm_matches_engine_module_and_promotes(cpu_kernels):
    from realtime.engines.transformer import RMSNorm

    m = RMSNorm(300, 1e-5)
    with torch.no_grad():
        m.weight.copy_(torch.randn(300))
    x = torch.randn(2, 3, 300)
    torch.testing.assert_close(rmsnorm(x, m.weight.detach(), 1e-5), m(x), rtol=1e-5, atol=1e-5)
    # fp32 weight on bf16 activations: PyTorch promotes the product to fp32, so does the kernel.
    xb = x.bfloat16()
    y = rmsnorm(xb, m.weight.detach(), 1e-5)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, rmsnorm_ref(xb, m.weight.detach(), 1e-5), rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------------------------------ rotary

ROT_SHAPES = [  # B, H, Hkv, T, D
    (2, 6, 2, 3, 24),  # D/2 = 12: not a power of 2
    (1, 5, 1, 1, 64),  # decode, MQA, odd H
    (3, 4, 4, 7, 16),
]


def _rot_inputs(b, h, hkv, t, d, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    # q as the engine makes it: view(B, T, H, D).transpose(1, 2), a strided [B, H, T, D].
    q = torch.randn(b, t, h, d, generator=g).to(device, dtype).transpose(1, 2)
    k = torch.randn(b, t, hkv, d, generator=g).to(device, dtype).transpose(1, 2)
    pos = torch.randint(0, 4000, (b, t), generator=g).to(device)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=device).float() / d))
    freqs = pos.float()[..., None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, D], the engine's layout
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROT_SHAPES)
def test_rotary(cpu_kernels, shape, dtype):
    q, k, cos, sin = _rot_inputs(*shape, dtype)
    qo, ko = apply_rotary(q, k, cos, sin)
    q_ref, k_ref = apply_rotary_ref(q, k, cos, sin)
    assert qo.shape == q.shape and ko.shape == k.shape and qo.dtype == dtype
    _close(qo, q_ref, dtype)
    _close(ko, k_ref, dtype)
    # [B, T, D] cos/sin give the same result as the engine's [B, 1, T, D].
    qo2, ko2 = apply_rotary(q, k, cos[:, 0], sin[:, 0])
    assert torch.equal(qo, qo2) and torch.equal(ko, ko2)


def test_rotary_ref_is_hf_rotate_half():
    q, k, cos, sin = _rot_inputs(2, 4, 2, 3, 8, torch.float32)
    x1, x2 = q[..., :4], q[..., 4:]
    want = torch.cat((x1 * cos[..., :4] - x2 * sin[..., :4], x2 * cos[..., 4:] + x1 * sin[..., 4:]), dim=-1)
    torch.testing.assert_close(apply_rotary_ref(q, k, cos, sin)[0], want)


def _rot_cache_inputs(b, h, hkv, d, s, tmax, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, (h + 2 * hkv) * d, generator=g).to(device, dtype)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=device).float() / d))
    freqs = torch.arange(tmax, device=device).float()[:, None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    pos = torch.randint(0, tmax, (b,), generator=g).to(device)
    slots = torch.randperm(s, generator=g)[:b].to(device)
    kc = torch.randn(s, hkv, tmax, d, generator=g).to(device, dtype)
    vc = torch.randn(s, hkv, tmax, d, generator=g).to(device, dtype)
    return qkv, emb.cos().to(dtype), emb.sin().to(dtype), pos, kc, vc, slots


ROT_CACHE_SHAPES = [(1, 4, 2, 32, 3, 40), (3, 6, 1, 24, 4, 17), (2, 8, 8, 64, 2, 9)]  # B, H, Hkv, D, S, Tmax


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROT_CACHE_SHAPES)
def test_rotary_cache_write(cpu_kernels, shape, dtype):
    """RoPE + K/V cache write in one kernel = the engine's rotary and two scatters; nothing else
    in the caches changes."""
    b, h, hkv, d, s, tmax = shape
    qkv, cos, sin, pos, kc, vc, slots = _rot_cache_inputs(b, h, hkv, d, s, tmax, dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q = rotary_cache_write(qkv, cos, sin, pos, kc, vc, slots, h, hkv)
    q_ref = rotary_cache_write_ref(qkv, cos, sin, pos, kc_ref, vc_ref, slots, h, hkv)
    assert q.shape == (b, h, d) and q.dtype == dtype
    _close(q, q_ref, dtype)
    _close(kc, kc_ref, dtype)
    assert torch.equal(vc, vc_ref)  # v is copied, not computed
    # The same as apply_rotary on the engine's [B, H, 1, D] layout with the per-step angles.
    qh = qkv.view(b, h + 2 * hkv, d)
    qo, ko = apply_rotary(qh[:, :h, None], qh[:, h:h + hkv, None], cos[pos][:, None, None], sin[pos][:, None, None])
    _close(q, qo[:, :, 0], dtype)
    _close(kc[slots, :, pos], ko[:, :, 0], dtype)


# ---------------------------------------------------------------------------------------- gemv

GEMV_CASES = [(1, 64, 40), (2, 300, 24), (3, 128, 96), (4, 1030, 34), (1, 2048, 8)]  # M, K, N (N, K: not multiples of a block)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GEMV_CASES)
def test_gemv_linear_and_swiglu(cpu_kernels, case, dtype):
    m, k, n = case
    g = torch.Generator().manual_seed(m * 7 + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(2 * n, k, generator=g) / k**0.5).to(dtype)
    bias = torch.randn(2 * n, generator=g).to(dtype)
    for b, cfg in ((None, None), (bias, None), (bias, ("dot", 16, 64, 4, 2)), (None, ("dot", 32, 128, 4, 2)),
                   (bias, ("fma", 8, 256, 4, 1))):
        y = gemv.linear(x, w, b, cfg)
        assert y.shape == (m, 2 * n) and y.dtype == dtype
        # float32 accumulation in another order than the reference: rounding-level differences
        _close(y, gemv.linear_ref(x.double(), w.double(), None if b is None else b.double()), dtype)
        a = gemv.swiglu(x, w, b, cfg)
        assert a.shape == (m, n) and a.dtype == dtype
        _close(a, gemv.swiglu_ref(x.double(), w.double(), None if b is None else b.double()), dtype)
        for approx in ("none", "tanh"):
            gl = gemv.linear_gelu(x, w, b, approx, cfg)
            assert gl.shape == (m, 2 * n) and gl.dtype == dtype
            # GELU of the product as rounded to the output dtype, as F.gelu after a bf16 GEMM sees it
            want = gemv.linear_gelu_ref(y.double(), torch.eye(2 * n, dtype=torch.float64), None, approx)
            _close(gl, want, dtype)
            _close(gl, gemv.linear_gelu_ref(x.double(), w.double(), None if b is None else b.double(), approx), dtype)
    # a strided row view (the engine passes slices) and a weight slice of a bigger tensor
    xs = torch.randn(m, 2 * k, generator=g).to(dtype)[:, :k]
    _close(gemv.linear(xs, w[:n]), gemv.linear_ref(xs.double(), w[:n].double()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, n, cfg", [(1, 1030, 40, ("fma", 8, 256, 4, 1, 4)), (3, 2048, 24, ("dot", 16, 64, 4, 2, 8)),
                                          (2, 512, 130, ("fma", 4, 64, 4, 1, 2)), (1, 300, 16, ("dot", 16, 64, 4, 2, 1))])
def test_gemv_partials_summed_by_add_rmsnorm(cpu_kernels, m, k, n, cfg, dtype):
    """Split-K partial sums (K not a multiple of the split, the last split part-masked) sum to the
    product, and the residual add + RMSNorm that takes them equals add_rmsnorm of the plain product."""
    g = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    res = torch.randn(m, n, generator=g).to(dtype)
    nw = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    out = gemv.linear_partials(x, w, None, cfg)
    if cfg[-1] == 1 and len(cfg) == 6:
        assert isinstance(out, torch.Tensor) and out.dtype == dtype  # one split: the plain product
        _close(out, gemv.linear_ref(x.double(), w.double()), dtype)
        return
    # as many splits as whole K steps allow (1030 columns in 256-steps: 3 of the 4 asked)
    assert isinstance(out, gemv.Partials) and out.sums.shape[0] > 1 and out.sums.shape[1:] == (m, n)
    assert out.sums.dtype == torch.float32
    _close(out.total(), gemv.linear_ref(x.double(), w.double()), dtype)
    y, s = add_rmsnorm_partials(out.sums, res, nw, 1e-5)
    y_ref, s_ref = add_rmsnorm(out.total(), res, nw, 1e-5)
    _close(s, s_ref, dtype)
    _close(y, y_ref, dtype)
    with pytest.raises(ValueError, match="partial"):
        gemv.linear(x, w, None, cfg)  # a consumer that cannot sum partials never gets them
    with pytest.raises(ValueError, match="partials"):
        add_rmsnorm_partials(out.sums.to(dtype) if dtype != torch.float32 else out.sums[:, :, :-1], res, nw, 1e-5)


def test_gemv_checks_and_choice(cpu_kernels):
    x, w = torch.randn(5, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="rows"):
        gemv.linear(x, w)
    with pytest.raises(ValueError, match="columns"):
        gemv.linear(x[:2], w[:, :8])
    with pytest.raises(ValueError, match="gate and up"):
        gemv.swiglu(x[:1], w[:7])
    with pytest.raises(ValueError, match="gelu must be"):
        gemv.linear_gelu(x[:1], w, None, "erf")
    assert gemv.faster_than_library(w) is False  # no CUDA: the library path
    from realtime.engines.transformer import project

    assert torch.equal(project(x, w, None, True), torch.nn.functional.linear(x, w))  # 5 rows: library GEMM


# ---------------------------------------------------------------------------------------- decode attention

ATT_CASES = [  # B, H, Hkv, S, Tmax, D, lengths, num_splits
    (3, 6, 2, 4, 150, 40, [1, 150, 77], None),
    (3, 6, 2, 4, 150, 40, [1, 150, 77], 1),
    (2, 4, 4, 2, 64, 64, [64, 33], 1),  # Tmax of one block: one split at most
    (1, 8, 1, 3, 200, 16, [130], None),
]


from shared import attention_inputs as _att_inputs  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ATT_CASES)
def test_decode_attention(cpu_kernels, case, dtype):
    b, h, hkv, s, tmax, d, lengths, ns = case
    q, kc, vc, slots = _att_inputs(b, h, hkv, s, tmax, d, dtype)
    lengths = torch.tensor(lengths)
    out = decode_attention(q, kc, vc, slots, lengths, 0.3, num_splits=ns)
    assert out.shape == (b, h, d) and out.dtype == dtype
    # Against the float32 reference on the same (bf16-rounded) inputs.
    want = decode_attention_ref(q.float(), kc.float(), vc.float(), slots, lengths, 0.3)
    _close(out, want, dtype)


def test_decode_attention_on_engine_cache_layout(cpu_kernels):
    """A per-layer view of the engine's KVCache feeds the kernel as is; = the engine's masked SDPA."""
    cfg = TransformerConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=128, max_seq_len=96)
    cache = KVCache(cfg, n_slots=3)
    torch.manual_seed(1)
    cache.k.normal_()
    cache.v.normal_()
    pos = torch.tensor([5, 95])  # the decode query's absolute position; keys <= pos are visible
    slots = torch.tensor([2, 0])
    q = torch.randn(2, 4, 16)
    out = decode_attention(q, cache.k[1], cache.v[1], slots, pos + 1)  # default scale 1/sqrt(D)
    k = cache.k[1, slots]
    v = cache.v[1, slots]
    mask = (cache.key_pos[None, None, :] <= pos[:, None, None])[:, None]  # engine: [B, 1, T, S]
    want = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, enable_gqa=True)[:, :, 0]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


# (B, H, Hkv, n queries, ring C, D, window, next positions per row)
WIN_CASES = [
    (2, 4, 2, 2, 7, 16, 5, [0, 40]),  # a fresh row (ring empty but for its own keys), GQA
    (3, 8, 8, 2, 251, 64, 250, [3, 250, 1000]),  # Mimi's shapes: the window spans the ring but 1 slot
    (1, 2, 1, 3, 70, 32, 20, [500]),  # more keys than one block, window well inside the ring
    (2, 4, 4, 2, 6, 8, 5, [1, 9]),  # head dim 8 (the tiny test Mimi): padded to tl.dot's 16
]


def _win_inputs(b, h, hkv, n, c, d, positions, dtype, device="cpu", seed=0):
    """A ring as Mimi's transformer leaves it after writing this step's keys: position p at slot p % C."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, h, d, generator=g).to(device, dtype).transpose(1, 2)  # [B, H, n, D], strided
    k = torch.randn(b, hkv, c, d, generator=g).to(device, dtype)
    v = torch.randn(b, hkv, c, d, generator=g).to(device, dtype)
    qpos = torch.tensor(positions)[:, None] + torch.arange(n)
    kpos = torch.full((b, c), -1, dtype=torch.long)
    for row, p in enumerate(positions):
        for pos in range(max(0, p + n - c), p + n):
            kpos[row, pos % c] = pos
    return q, k, v, qpos.to(device), kpos.to(device)


def _win_new(b, hkv, n, d, qpos, c, dtype, device="cpu", seed=1):
    """The step's own keys and values [B, Hkv, n, D] (strided, as Mimi's q|k|v split leaves them)
    and their ring slots qpos % C."""
    g = torch.Generator().manual_seed(seed)
    k_new = torch.randn(b, n, hkv, d, generator=g).to(device, dtype).transpose(1, 2)
    v_new = torch.randn(b, n, hkv, d, generator=g).to(device, dtype).transpose(1, 2)
    return k_new, v_new, (qpos % c).contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", WIN_CASES)
@pytest.mark.parametrize("write", [False, True], ids=["ring", "write+ring"])
def test_window_attention(cpu_kernels, case, dtype, write):
    b, h, hkv, n, c, d, window, positions = case
    q, k, v, qpos, kpos = _win_inputs(b, h, hkv, n, c, d, positions, dtype)
    new = _win_new(b, hkv, n, d, qpos, c, dtype) if write else None
    k_ref, v_ref = k.clone(), v.clone()
    out = window_attention(q, k, v, qpos, kpos, window, 0.2, new)
    assert out.shape == (b, n, h, d) and out.dtype == dtype
    want = window_attention_ref(q.float(), k_ref.float(), v_ref.float(), qpos, kpos, window, 0.2,
                                None if new is None else tuple(t.float() if t.is_floating_point() else t for t in new))
    _close(out, want, dtype)
    if write:  # the kernel left the same ring as the two scatters
        ring_write_ref(k_ref, v_ref, *new)
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
        assert not torch.equal(k_ref, _win_inputs(b, h, hkv, n, c, d, positions, dtype)[1])  # the write changed it
    # The mask is what decides: a key moved out of the window changes the result.
    kpos2 = kpos.clone()
    kpos2[kpos == qpos[:, :1]] = -1  # hide each row's first query's own key
    assert not torch.allclose(window_attention(q, k, v, qpos, kpos2, window, 0.2).float(), out.float())


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_attention_rows(cpu_kernels, dtype):
    """With rows, query row b attends and writes ring row rows[b] of a bigger ring; other rows are
    untouched; the same as the kernel on the gathered rows."""
    b, h, hkv, n, c, d, window, positions = WIN_CASES[0]
    s_rows = b + 3
    q, k, v, qpos, kpos = _win_inputs(b, h, hkv, n, c, d, positions, dtype)
    _, kb, vb, _, kposb = _win_inputs(s_rows, h, hkv, n, c, d, positions, dtype)
    rows = torch.randperm(s_rows, generator=torch.Generator().manual_seed(2))[:b]
    kb[rows], vb[rows], kposb[rows] = k, v, kpos
    new = _win_new(b, hkv, n, d, qpos, c, dtype)
    k0, v0 = kb.clone(), vb.clone()
    out = window_attention(q, kb, vb, qpos, kposb, window, 0.2, new, rows=rows)
    want = window_attention(q, k, v, qpos, kpos, window, 0.2, new)
    assert torch.equal(out, want)
    assert torch.equal(kb[rows], k) and torch.equal(vb[rows], v)  # the same ring writes, in place
    rest = torch.ones(s_rows, dtype=torch.bool)
    rest[rows] = False
    assert torch.equal(kb[rest], k0[rest]) and torch.equal(vb[rest], v0[rest])
    ref_k, ref_v = k0.clone(), v0.clone()
    _close(window_attention_ref(q.float(), ref_k.float(), ref_v.float(), qpos, kposb, window, 0.2,
                                tuple(t.float() if t.is_floating_point() else t for t in new), rows=rows), out, dtype)
    with pytest.raises(ValueError, match="pass rows="):
        window_attention(q, kb, vb, qpos, kposb, window, 0.2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, rows", [(2, None), (2, [4, 0, 2]), (3, [1]), (1, None)])
def test_ring_positions(cpu_kernels, n, rows, dtype):
    """Positions, ring slots, RoPE angles and the kp update equal the PyTorch bookkeeping, also at
    large positions (long sessions) and on a subset of rows."""
    from realtime.kernels.window_attention import ring_positions, ring_positions_ref

    g = torch.Generator().manual_seed(n)
    s_rows, cw, half = 5, 9, 8
    kp = torch.randint(-1, 50, (s_rows, cw + 1), generator=g)
    kp[:, -1] = torch.tensor([0, 3, 17, 4095, 123457])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 2 * half, 2, dtype=torch.float32) / (2 * half)))
    r = None if rows is None else torch.tensor(rows)
    kp_ref = kp.clone()
    got = ring_positions(kp, inv_freq, n, dtype, r)
    want = ring_positions_ref(kp_ref, inv_freq, n, dtype, r)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(kp, kp_ref)
    b = s_rows if rows is None else len(rows)
    assert got[2].shape == got[3].shape == (b, n, 2 * half) and got[2].dtype == dtype
    # the interpreter's numpy cos/sin vs torch's: float32 ulps (then the same rounding to dtype)
    tol = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=2**-8)
    torch.testing.assert_close(got[2], want[2], **tol)
    torch.testing.assert_close(got[3], want[3], **tol)
    assert (kp_ref[:, -1] != torch.tensor([0, 3, 17, 4095, 123457])).any()  # the reference advanced p


def _ln_inputs(shape, dtype, bias=True, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    d = shape[-1]
    x, h = (torch.randn(shape, generator=g).to(device, dtype) for _ in range(2))
    scale, weight = torch.rand(d, generator=g) + 0.1, torch.rand(d, generator=g) + 0.5
    b = torch.randn(d, generator=g) if bias else None
    return x, h, scale.to(device, dtype), weight.to(device, dtype), None if b is None else b.to(device, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, bias", [((2, 512), True), ((3, 5, 96), False), ((4, 300), True)])
def test_scale_add_layernorm(cpu_kernels, shape, bias, dtype):
    x, h, scale, weight, b = _ln_inputs(shape, dtype, bias)
    y, s = scale_add_layernorm(x, h, scale, weight, b, 1e-5)
    y_ref, s_ref = scale_add_layernorm_ref(x, h, scale, weight, b, 1e-5)
    assert y.shape == s.shape == x.shape and y.dtype == s.dtype == dtype
    _close(s, s_ref, dtype)
    _close(y, y_ref, dtype)


def _tiny_mimi_transformer(layers: int):
    """A small Mimi streaming transformer (width 64, window 8) with seeded random weights."""
    from realtime.codecs import mimi

    cfg = mimi.MimiConfig(hidden_size=64, num_layers=layers, num_heads=4, num_kv_heads=4, head_dim=16,
                          intermediate_size=128, sliding_window=8)
    torch.manual_seed(0)
    tr = mimi.Transformer(cfg).eval()
    with torch.no_grad():
        for prm in tr.parameters():
            prm.copy_(torch.randn_like(prm) * 0.3)
    return tr


def test_mimi_step_with_fused_add_layernorm(cpu_kernels, monkeypatch):
    """The Mimi transformer step wired to the fused kernel (as on CUDA) equals its addcmul + LayerNorm path."""
    from realtime.codecs import mimi

    tr = _tiny_mimi_transformer(3)
    x = torch.randn(2, 2, 64)

    def run():
        st = tr.new_state(2, torch.device("cpu"), torch.float32)
        with torch.no_grad():
            return torch.cat([tr.step(x + i, st) for i in range(5)], 1)

    want = run()
    calls = []

    def fused(x, h, ls, ln):  # noqa: ANN001, ANN202
        if ln is None:
            return ls.add_to(x, h), None
        calls.append(1)
        y, s = scale_add_layernorm(x, h, ls.scale, ln.weight, ln.bias, ln.eps)
        return s, y

    monkeypatch.setattr(mimi, "_add_norm", fused)
    got = run()
    assert len(calls) == 5 * (2 * 3 - 1)  # every add but the last layer's MLP one is fused
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mimi_step_with_gemv(cpu_kernels, monkeypatch):
    """Mimi's step with every product on the decode GEMV (as on CUDA where it was measured faster)
    equals the library products, at up to GEMV_MAX_M rows; more rows keep the library GEMM."""
    from realtime.kernels import gemv

    tr = _tiny_mimi_transformer(2)
    for layer in tr.layers:
        layer.self_attn.fuse()

    def run(b, flag):
        for layer in tr.layers:
            layer.self_attn.gemv_qkv = layer.self_attn.gemv_o = layer.gemv_fc1 = layer.gemv_fc2 = flag
        st = tr.new_state(b, torch.device("cpu"), torch.float32)
        x = torch.randn(b, 2, 64, generator=torch.Generator().manual_seed(b))
        with torch.no_grad():
            return torch.cat([tr.step(x + i, st) for i in range(4)], 1)

    calls = []
    for name in ("linear", "linear_gelu"):
        monkeypatch.setattr(gemv, name, lambda *a, real=getattr(gemv, name), name=name, **k: calls.append(name) or real(*a, **k))
    assert tr.layers[0].gelu == "none"  # the tiny config's exact GELU: fc1's GEMV applies it
    for b in (1, 2, 3):  # 2, 4 and 6 rows a step
        want = run(b, False)
        calls.clear()
        got = run(b, True)
        fits = 2 * b <= gemv.MAX_M
        # 3 plain products and fc1 + GELU, x 2 layers x 4 steps
        assert calls.count("linear") == (3 * 2 * 4 if fits else 0)
        assert calls.count("linear_gelu") == (2 * 4 if fits else 0)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_attention_never_reads_past_length(cpu_kernels):
    """Stale NaN/inf beyond a row's length (or in other slots) cannot reach the output."""
    q, kc, vc, slots = _att_inputs(2, 4, 2, 3, 130, 32, torch.float32)
    lengths = torch.tensor([70, 1])
    want = decode_attention_ref(q, kc, vc, slots, lengths, 0.2)
    for b in range(2):
        kc[slots[b], :, lengths[b]:] = float("nan")
        vc[slots[b], :, lengths[b]:] = float("inf")
    other = [i for i in range(3) if i not in slots.tolist()]
    kc[other] = float("nan")
    out = decode_attention(q, kc, vc, slots, lengths, 0.2, num_splits=2)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------- sampling


def _sampling_rows(b, v, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(b, v, generator=g)).to(device)
    temp = torch.tensor([0.0, 1.0, 0.7, 1.3, -1.0, 0.5, 2.0, 1.0] * (b // 8 + 1))[:b].to(device)
    top_k = torch.tensor([0, 0, 50, 1, 5, 7, v - 1, v, v + 3, 2, 0, 20] * (b // 12 + 1))[:b].to(device)
    seeds = (torch.randint(-(2**62), 2**62, (b,), generator=g)).to(device)
    steps = torch.randint(0, 2**40, (b,), generator=g).to(device)
    return logits, temp, top_k, seeds, steps


# 1000, 3001: the small-vocabulary kernel (row in registers); 9001: the radix-select kernel with
# several blocks, the last one partial.
@pytest.mark.parametrize("v, digit_bits", [(1000, 1), (3001, 1), (1000, 4), (3001, 4), (9001, None)])
def test_sample_equals_engine(cpu_kernels, v, digit_bits):
    """digit_bits: the small-vocabulary kernel's select by bisection (1) or 4-bit radix (4)."""
    logits, temp, top_k, seeds, steps = _sampling_rows(24, v)
    got = sample(logits, temp, top_k, seeds, steps, digit_bits=digit_bits)
    ones = torch.ones(24)
    want = engine_sample(logits, temp, top_k, ones, seeds, steps)
    assert got.dtype == torch.long
    assert torch.equal(got, want), (got, want)
    assert torch.equal(want, sample_ref(logits, temp, top_k, seeds, steps))


@pytest.mark.parametrize("v", [1000, 5000, 128256])
def test_gumbel_argmax_equals_engine(cpu_kernels, v):
    """The chunked sampler (text's default: temperature only) = the engine's unfiltered sample, for
    greedy and sampled rows, float32 and bf16 logits, and rows whose ties span chunks."""
    logits, temp, _, seeds, steps = _sampling_rows(4, v)
    want = engine_sample(logits, temp, torch.zeros(4, dtype=torch.long), torch.ones(4), seeds, steps, filtered=False)
    assert torch.equal(fused_sampling.gumbel_argmax(logits, temp, seeds, steps), want)
    bf = logits.to(torch.bfloat16)
    want = engine_sample(bf, temp, torch.zeros(4, dtype=torch.long), torch.ones(4), seeds, steps, filtered=False)
    assert torch.equal(fused_sampling.gumbel_argmax(bf, temp, seeds, steps), want)
    flat = torch.zeros(2, v)  # greedy over a flat row: index 0 (the first chunk's first); sampled: the noise's argmax
    t = torch.tensor([0.0, 1.0])
    got = fused_sampling.gumbel_argmax(flat, t, seeds[:2], steps[:2])
    assert got[0] == 0 and got[1] == uniform_noise(seeds[1:2], steps[1:2], v).argmax(-1)[0]


def _check_advance_rows(device: str, v: int) -> None:
    """advance_rows = its reference and the samplers it stands for: the tokens (greedy over any row,
    sampled with each slot's temperature, seed and step), tok / pos / step_no of the rows' slots,
    the scratch slot put back to 0, other slots untouched; its scratch buffers left as found."""
    b, slots, scratch = 6, 11, 10
    logits, _, _, _, _ = _sampling_rows(b, v, device, seed=v)
    logits[1, 5] = logits[1].max() + 1
    logits[1, v - 2] = logits[1, 5]  # a tie across chunks: the first index wins
    logits[2] = 0.0
    logits[2, v // 2] = -0.0  # -0.0 ties +0.0
    logits[3, 0] = float("-inf")
    idx = torch.tensor([4, 0, 7, 2, scratch, scratch], device=device)
    g = torch.Generator().manual_seed(v)
    temp = torch.tensor([0.0, 1.0, 0.0, 0.7, 1.3, 0.5, 2.0, 1.0, 0.9, 1.0, 1.0], device=device)
    seeds = torch.randint(-(2**62), 2**62, (slots,), generator=g).to(device)
    base = [torch.randint(0, 1000, (slots,), generator=g).to(device) for _ in range(3)]  # tok, pos, steps
    work = fused_sampling.advance_work(8, device)
    for lg in (logits, logits.to(torch.bfloat16)):
        for kw in ({}, dict(temperature=temp, seeds=seeds)):
            got_t = [t.clone() for t in base]
            want_t = [t.clone() for t in base]
            out_g = torch.zeros(8, dtype=torch.long, device=device)
            out_w = torch.zeros(8, dtype=torch.long, device=device)
            got = fused_sampling.advance_rows(lg, idx, *got_t, out_g, scratch, work=work, **kw)
            want = fused_sampling.advance_rows_ref(lg, idx, *want_t, out_w, scratch, **kw)
            real = slice(0, 4)  # (the two scratch rows may read each other's step: their tokens are not used)
            assert torch.equal(got[real], want[real]), (kw.keys(), got, want)
            for g_t, w_t in zip(got_t, want_t):
                assert torch.equal(g_t[:scratch], w_t[:scratch])
            assert int(got_t[1][scratch]) == int(got_t[2][scratch]) == 0
            if kw:
                eng = engine_sample(lg[real], temp[idx[real]], torch.zeros(4, dtype=torch.long, device=device),
                                    torch.ones(4, device=device), seeds[idx[real]], base[2][idx[real]], filtered=False)
            else:
                eng = lg[real].float().argmax(-1)
            assert torch.equal(got[real], eng)
            assert got[1] == 5 and (kw or got[2] == 0)
            assert torch.equal(work[0], torch.full_like(work[0], -(2**63))) and not work[1].any()


@pytest.mark.parametrize("v", [1000, 128256])
def test_advance_rows_equals_reference(cpu_kernels, v):
    _check_advance_rows("cpu", v)


def test_sample_noise_is_the_engine_hash(cpu_kernels):
    """Flat logits, no top-k: the token is the argmax of the noise, so this checks every hash bit path."""
    b, v = 16, 2500
    seeds = torch.arange(b) * 0x1234567890AB - 7
    steps = torch.arange(b) * 977 + (1 << 33)
    got = sample(torch.zeros(b, v), torch.ones(b), torch.zeros(b, dtype=torch.long), seeds, steps)
    assert torch.equal(got, uniform_noise(seeds, steps, v).argmax(-1))


@pytest.mark.parametrize("digit_bits", [1, 4])
def test_sample_topk_ties_keep_lowest_indices(cpu_kernels, digit_bits):
    """Ties at the k-th value: the kernel keeps the first ones in vocab order (a stable sort)."""
    v = 300
    logits = torch.zeros(4, v)
    logits[:, ::3] = 1.0  # 100 entries tie at the top
    k = torch.tensor([1, 10, 99, 150])
    seeds, steps = torch.arange(4), torch.zeros(4, dtype=torch.long)
    got = sample(logits, torch.ones(4), k, seeds, steps, digit_bits=digit_bits)
    order = logits.sort(dim=-1, descending=True, stable=True).indices
    keep = torch.zeros(4, v, dtype=torch.bool).scatter(1, order, torch.arange(v)[None] < k[:, None])
    noisy = (logits - torch.log(-torch.log(uniform_noise(seeds, steps, v)))).masked_fill(~keep, float("-inf"))
    assert torch.equal(got, noisy.argmax(-1))


def test_sample_bf16_logits(cpu_kernels):
    logits, temp, _, seeds, steps = _sampling_rows(8, 1500)
    logits = logits.bfloat16()
    top_k = torch.zeros(8, dtype=torch.long)  # bf16 ties at a top-k boundary would hit torch.sort's order
    assert torch.equal(sample(logits, temp, top_k, seeds, steps), engine_sample(logits, temp, top_k, torch.ones(8), seeds, steps))


def _distinct_16bit_rows(b, v, dtype, device="cpu"):
    """Rows of distinct finite bf16/fp16 values in random order (no ties anywhere, so top-k is
    well defined for every k): bit patterns around +-1.0, read as the 16-bit float type."""
    g = torch.Generator().manual_seed(v)
    one = 0x3F80 if dtype == torch.bfloat16 else 0x3C00
    pats = torch.cat([torch.arange(one - v // 2, one + v - v // 2)])
    rows = []
    for _ in range(b):
        p = pats[torch.randperm(v, generator=g)]
        neg = torch.rand(v, generator=g) < 0.5  # the sign bit: negatives rank by flipped bits
        rows.append(torch.where(neg, p | 0x8000, p))
    return torch.stack(rows).to(torch.int16).view(dtype).to(device)


@pytest.mark.parametrize("dtype, digit_bits", [(torch.bfloat16, 1), (torch.float16, 1), (torch.bfloat16, 4),
                                               (torch.float16, 4)])
def test_sample_16bit_logits_with_top_k(cpu_kernels, dtype, digit_bits):
    """The small-vocabulary kernel ranks 16-bit logits by their own bits (16 counting steps, or 4
    radix passes): the same tokens as the engine's sort over the float32 scaled values, top-k on,
    greedy and flat rows."""
    logits, temp, top_k, seeds, steps = _sampling_rows(24, 1500)
    logits = _distinct_16bit_rows(24, 1500, dtype)
    got = sample(logits, temp, top_k, seeds, steps, digit_bits=digit_bits)
    assert torch.equal(got, engine_sample(logits, temp, top_k, torch.ones(24), seeds, steps))


# ---------------------------------------------------------------------------------------- launcher contract


def test_fallback_warns_once(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(_triton, "_warned", set())
    x, _, w = _rms_inputs((2, 16), torch.float32)
    with pytest.warns(RuntimeWarning, match="rmsnorm.*PyTorch reference"):
        y = rmsnorm(x, w, 1e-5)
    assert torch.equal(y, rmsnorm_ref(x, w, 1e-5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rmsnorm(x, w, 1e-5)  # warned once per kernel, not per call


def test_launchers_check_inputs(cpu_kernels):
    x, r, w = _rms_inputs((2, 16), torch.float32)
    with pytest.raises(ValueError, match="weight"):
        rmsnorm(x, w[:8], 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        rmsnorm(x.t(), torch.ones(2), 1e-5)
    q, k, cos, sin = _rot_inputs(1, 2, 1, 1, 8, torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        apply_rotary(q, k, cos.double(), sin.double())
    q, kc, vc, slots = _att_inputs(2, 6, 4, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(q, kc, vc, slots, torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="int64"):
        q, kc, vc, slots = _att_inputs(2, 4, 2, 2, 16, 16, torch.float32)
        decode_attention(q, kc, vc, slots.int(), torch.tensor([3, 4]))
    logits, temp, top_k, seeds, steps = _sampling_rows(4, 100)
    with pytest.raises(ValueError, match="top_k"):
        sample(logits, temp, top_k[:3], seeds, steps)


# ---------------------------------------------------------------------------------------- compiles for the GPU

# Run in a fresh interpreter without TRITON_INTERPRET: Triton lowers each kernel to PTX and runs its
# bundled ptxas for sm_90 (H100/H200) without a GPU, so GPU-only compile errors show up on the CPU.
_AOT = r"""
import triton.language as tl
from realtime.kernels import decode_attention, gemv, layernorm, rmsnorm, rotary, sampling, window_attention
from sm90 import compile_sm90 as comp

for dt in ("bf16", "fp32"):
    comp(rmsnorm._kernels(), dict(x_ptr=f"*{dt}", r_ptr=f"*{dt}", w_ptr=f"*{dt}", y_ptr=f"*{dt}", s_ptr=f"*{dt}",
         eps="fp32"), dict(HAS_RESIDUAL=True, BLOCK_D=2048, N_PARTS=0), 8)
    comp(rmsnorm._kernels(), dict(x_ptr="*fp32", r_ptr=f"*{dt}", w_ptr=f"*{dt}", y_ptr=f"*{dt}", s_ptr=f"*{dt}",
         eps="fp32"), dict(HAS_RESIDUAL=True, BLOCK_D=1024, N_PARTS=4), 4)
    rot, rot_cache = rotary._kernels()
    comp(rot, {p: f"*{dt}" for p in ("q_ptr", "k_ptr", "cos_ptr", "sin_ptr", "qo_ptr", "ko_ptr")},
         dict(HALF=32, BLOCK_HALF=32, BLOCK_H=32), 4)
    comp(rot_cache, dict(qkv_ptr=f"*{dt}", cos_ptr=f"*{dt}", sin_ptr=f"*{dt}", pos_ptr="*i64", slots_ptr="*i64",
         qo_ptr=f"*{dt}", k_ptr=f"*{dt}", v_ptr=f"*{dt}"), dict(HALF=32, BLOCK_HALF=32), 1)
    fma, dot = gemv._kernels()
    for swiglu, gelu in ((False, 0), (True, 0), (False, 1), (False, 2)):
        sig = dict(x_ptr=f"*{dt}", w_ptr=f"*{dt}", b_ptr=f"*{dt}", y_ptr=f"*{dt}")
        comp(fma, sig, dict(HAS_BIAS=swiglu, SWIGLU=swiglu, GELU=gelu, BLOCK_M=1, BLOCK_N=16, BLOCK_K=512, K_STEPS=4), 8)
        comp(dot, sig, dict(HAS_BIAS=swiglu, SWIGLU=swiglu, GELU=gelu, BLOCK_N=32, BLOCK_K=128, K_STEPS=8,
                            DOT_F32=dt == "fp32"), 4)
    comp(dot, dict(x_ptr=f"*{dt}", w_ptr=f"*{dt}", b_ptr=f"*{dt}", y_ptr="*fp32"),
         dict(HAS_BIAS=False, SWIGLU=False, GELU=0, BLOCK_N=16, BLOCK_K=128, K_STEPS=8, DOT_F32=dt == "fp32"), 4)
    split, merge = decode_attention._kernels()
    for early in (False, True):
        built = comp(split, dict(q_ptr=f"*{dt}", k_ptr=f"*{dt}", v_ptr=f"*{dt}", slots_ptr="*i64", len_ptr="*i64",
             acc_ptr="*fp32", ml_ptr="*fp32", qk_scale="fp32"),
             dict(H=32, G=4, D=64, CHUNK=128, NUM_SPLITS=16, BLOCK_G=16, BLOCK_D=64, BLOCK_N=64,
                  DOT_DTYPE=tl.bfloat16 if dt == "bf16" else tl.float32, PRECISION="tf32" if dt == "bf16" else "ieee",
                  DIRECT=False, EARLY=early), 4)
        ptx = built.asm["ptx"]  # EARLY: the slot, length and first key block are read before the PDL wait
        assert ("ld.global" in ptx[:ptx.index("griddepcontrol.wait")]) == early, early
    comp(split, dict(q_ptr=f"*{dt}", k_ptr=f"*{dt}", v_ptr=f"*{dt}", slots_ptr="*i64", len_ptr="*i64",
         acc_ptr=f"*{dt}", ml_ptr=f"*{dt}", qk_scale="fp32"),
         dict(H=8, G=4, D=64, CHUNK=64, NUM_SPLITS=1, BLOCK_G=16, BLOCK_D=64, BLOCK_N=64,
              DOT_DTYPE=tl.bfloat16 if dt == "bf16" else tl.float32, PRECISION="tf32" if dt == "bf16" else "ieee",
              DIRECT=True, EARLY=True), 4)
    comp(layernorm._kernel(), dict(x_ptr=f"*{dt}", h_ptr=f"*{dt}", g_ptr=f"*{dt}", w_ptr=f"*{dt}", b_ptr=f"*{dt}",
         y_ptr=f"*{dt}", s_ptr=f"*{dt}", eps="fp32"), dict(HAS_BIAS=True, BLOCK_D=512), 4)
    wa, ring_pos = window_attention._kernel()
    comp(wa, dict(q_ptr=f"*{dt}", k_ptr=f"*{dt}", v_ptr=f"*{dt}", qpos_ptr="*i64",
         kpos_ptr="*i64", o_ptr=f"*{dt}", kn_ptr=f"*{dt}", vn_ptr=f"*{dt}", ring_ptr="*i64", rows_ptr="*i64", qk_scale="fp32"),
         dict(WRITE=True, HAS_ROWS=True, BLOCK_T=2, H=8, G=1, NQ=2, D=64, BLOCK_R=16, BLOCK_D=64, BLOCK_N=64, N_BLOCKS=4,
              DOT_DTYPE=tl.bfloat16 if dt == "bf16" else tl.float32, PRECISION="tf32" if dt == "bf16" else "ieee"), 4)
    comp(ring_pos, dict(kp_ptr="*i64", inv_freq_ptr="*fp32", rows_ptr="*i64", qpos_ptr="*i64", ring_ptr="*i64",
         cos_ptr=f"*{dt}", sin_ptr=f"*{dt}"), dict(NQ=2, HALF=32, BLOCK_T=2, BLOCK_HALF=32, HAS_ROWS=True, LIBDEVICE=True), 1)
    comp(merge, dict(acc_ptr="*fp32", ml_ptr="*fp32", o_ptr=f"*{dt}"), dict(D=64, NUM_SPLITS=16, BLOCK_SPLITS=16, BLOCK_D=64), 4)
    comp(sampling._chunk_kernel(), dict(logits_ptr=f"*{dt}", temp_ptr="*fp32", seed_ptr="*i64", step_ptr="*i64",
         val_ptr="*fp32", idx_ptr="*i64"), dict(BLOCK_V=2048, LIBDEVICE_LOG=True), 4)
    big, small = sampling._kernels()
    sig = dict(logits_ptr=f"*{dt}", temp_ptr="*fp32", topk_ptr="*i64", seed_ptr="*i64", step_ptr="*i64", out_ptr="*i64")
    comp(big, sig, dict(N_BLOCKS=63, BLOCK_V=2048, LIBDEVICE_LOG=True), 8)
    for warps in (4, 32):
        for db in sampling._DIGIT_OPTIONS:
            comp(small, sig, dict(BLOCK_V=4096, LIBDEVICE_LOG=True, KEY_BITS=16 if dt == "bf16" else 32, DIGIT_BITS=db),
                 warps)
print("compiled")
"""


def test_kernels_compile_for_sm90(tmp_path):
    from sm90 import run_script

    run_script(_AOT, tmp_path)


# ---------------------------------------------------------------------------------------- GPU


from shared import eager_and_replayed as _graph  # noqa: E402


def _time_us(fn, n=50):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_rmsnorm(dtype):
    for shape in RMS_SHAPES + [(8, 2048), (5, 4096)]:
        x, r, w = _rms_inputs(shape, dtype, "cuda")
        _close(rmsnorm(x, w, 1e-5), rmsnorm_ref(x, w, 1e-5), dtype)
        y, s = add_rmsnorm(x, r, w, 1e-5)
        y_ref, s_ref = add_rmsnorm_ref(x, r, w, 1e-5)
        assert torch.equal(s, s_ref)  # same rounding of the sum on the GPU
        torch.testing.assert_close(y.float(), y_ref.float(), rtol=1.6e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5 if dtype == torch.float32 else 1e-2)
    eager, replay = _graph(lambda: add_rmsnorm(x, r, w, 1e-5)[0])
    assert torch.equal(eager, replay)
    print(f"\nrmsnorm {dtype} [8, 2048]: kernel {_time_us(lambda: rmsnorm(x, w, 1e-5)):.1f} us, ref {_time_us(lambda: rmsnorm_ref(x, w, 1e-5)):.1f} us")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_rotary(dtype):
    for shape in ROT_SHAPES + [(8, 32, 8, 1, 64), (2, 32, 8, 37, 64)]:
        q, k, cos, sin = _rot_inputs(*shape, dtype, "cuda")
        qo, ko = apply_rotary(q, k, cos, sin)
        q_ref, k_ref = apply_rotary_ref(q, k, cos, sin)
        # Bit-exactness in bf16 did not hold on the H200 (2026-12-02 run: FMA contraction rounds
        # the two products once, the PyTorch expression twice), so both dtypes get ulp tolerances.
        _close(qo, q_ref, dtype)
        _close(ko, k_ref, dtype)
    eager, replay = _graph(lambda: apply_rotary(q, k, cos, sin)[0])
    assert torch.equal(eager, replay)
    print(f"\nrotary {dtype} {shape}: kernel {_time_us(lambda: apply_rotary(q, k, cos, sin)):.1f} us, ref {_time_us(lambda: apply_rotary_ref(q, k, cos, sin)):.1f} us")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_decode_attention(dtype):
    cases = ATT_CASES + [(8, 32, 8, 16, 2048, 64, [1, 5, 64, 65, 700, 2047, 2048, 1500], None)]
    for b, h, hkv, s, tmax, d, lengths, ns in cases:
        q, kc, vc, slots = _att_inputs(b, h, hkv, s, tmax, d, dtype, "cuda")
        lengths = torch.tensor(lengths, device="cuda")
        out = decode_attention(q, kc, vc, slots, lengths, 0.125, num_splits=ns)
        want = decode_attention_ref(q.float(), kc.float(), vc.float(), slots, lengths, 0.125)
        _close(out, want, dtype)
    eager, replay = _graph(lambda: decode_attention(q, kc, vc, slots, lengths, 0.125))
    assert torch.equal(eager, replay)
    print(f"\ndecode_attention {dtype} B=8 H=32 Hkv=8 Tmax=2048: kernel "
          f"{_time_us(lambda: decode_attention(q, kc, vc, slots, lengths, 0.125)):.1f} us, "
          f"ref {_time_us(lambda: decode_attention_ref(q, kc, vc, slots, lengths, 0.125)):.1f} us")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_scale_add_layernorm(dtype):
    for shape, bias in [((2, 512), True), ((3, 5, 96), False), ((4, 300), True), ((16, 512), True)]:
        x, h, scale, weight, b = _ln_inputs(shape, dtype, bias, "cuda")
        y, s = scale_add_layernorm(x, h, scale, weight, b, 1e-5)
        y_ref, s_ref = scale_add_layernorm_ref(x, h, scale, weight, b, 1e-5)
        _close(s, s_ref, dtype)
        _close(y, y_ref, dtype)
    eager, replay = _graph(lambda: scale_add_layernorm(x, h, scale, weight, b, 1e-5)[0])
    assert torch.equal(eager, replay)
    print(f"\nscale_add_layernorm {dtype} [16, 512]: kernel {_time_us(lambda: scale_add_layernorm(x, h, scale, weight, b, 1e-5)):.1f} us, "
          f"ref {_time_us(lambda: scale_add_layernorm_ref(x, h, scale, weight, b, 1e-5)):.1f} us")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_window_attention(dtype):
    for b, h, hkv, n, c, d, window, positions in WIN_CASES + [(8, 8, 8, 2, 251, 64, 250, list(range(0, 4000, 500)))]:
        q, k, v, qpos, kpos = _win_inputs(b, h, hkv, n, c, d, positions, dtype, "cuda")
        out = window_attention(q, k, v, qpos, kpos, window, 0.125)
        _close(out, window_attention_ref(q.float(), k.float(), v.float(), qpos, kpos, window, 0.125), dtype)
        new = _win_new(b, hkv, n, d, qpos, c, dtype, "cuda")
        k_ref, v_ref = k.clone(), v.clone()
        out = window_attention(q, k, v, qpos, kpos, window, 0.125, new)
        ring_write_ref(k_ref, v_ref, *new)
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
        _close(out, window_attention_ref(q.float(), k_ref.float(), v_ref.float(), qpos, kpos, window, 0.125), dtype)
    eager, replay = _graph(lambda: window_attention(q, k, v, qpos, kpos, window, 0.125))
    assert torch.equal(eager, replay)
    print(f"\nwindow_attention {dtype} B=8 H=8 n=2 C=251: kernel "
          f"{_time_us(lambda: window_attention(q, k, v, qpos, kpos, window, 0.125)):.1f} us, "
          f"ref {_time_us(lambda: window_attention_ref(q, k, v, qpos, kpos, window, 0.125)):.1f} us")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_rotary_cache_write(dtype):
    for shape in ROT_CACHE_SHAPES + [(8, 32, 8, 64, 10, 2048), (1, 8, 2, 128, 2, 33)]:
        qkv, cos, sin, pos, kc, vc, slots = _rot_cache_inputs(*shape[:3], shape[3], shape[4], shape[5], dtype, "cuda")
        kc_ref, vc_ref = kc.clone(), vc.clone()
        h, hkv = shape[1], shape[2]
        q = rotary_cache_write(qkv, cos, sin, pos, kc, vc, slots, h, hkv)
        q_ref = rotary_cache_write_ref(qkv, cos, sin, pos, kc_ref, vc_ref, slots, h, hkv)
        _close(q, q_ref, dtype)
        _close(kc, kc_ref, dtype)
        assert torch.equal(vc, vc_ref)
    eager, replay = _graph(lambda: rotary_cache_write(qkv, cos, sin, pos, kc, vc, slots, h, hkv))
    assert torch.equal(eager, replay)
    print(f"\nrotary_cache_write {dtype} {shape}: kernel {_time_us(lambda: rotary_cache_write(qkv, cos, sin, pos, kc, vc, slots, h, hkv)):.1f} us, "
          f"ref {_time_us(lambda: rotary_cache_write_ref(qkv, cos, sin, pos, kc_ref, vc_ref, slots, h, hkv)):.1f} us")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_gemv(dtype):
    """GEMV and fused SwiGLU vs float64 references at the engines' shapes; graph replay; the
    timed choice against cuBLAS is printed (it is what the engines use)."""
    torch.manual_seed(0)
    for m in (1, 2, 4):
        for n, k in ((1536, 1024), (1024, 1024), (2051, 1024), (3072, 2048), (2048, 8192), (128256, 2048)):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
            want = gemv.linear_ref(x.double(), w.double())
            got = gemv.linear(x, w)
            assert torch.isfinite(got).all()
            assert ((got.double() - want).norm() / want.norm()).item() < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    for n, k in ((16384, 1024), (16384, 2048)):
        w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
        b = torch.randn(n, device="cuda").to(dtype)
        x = torch.randn(1, k, device="cuda", dtype=dtype)
        want = gemv.swiglu_ref(x.double(), w.double(), b.double())
        got = gemv.swiglu(x, w, b)
        assert ((got.double() - want).norm() / want.norm()).item() < (1e-2 if dtype == torch.bfloat16 else 1e-5)
        eager, replay = _graph(lambda: gemv.swiglu(x, w, b))
        assert torch.equal(eager, replay)
        for cfg in gemv._candidates(n // 2):  # every configuration the choice may pick computes the same
            got = gemv.swiglu(x, w, b, cfg)
            assert ((got.double() - want).norm() / want.norm()).item() < (1e-2 if dtype == torch.bfloat16 else 1e-5), cfg
        gemv.faster_than_library(w, b, swiglu=True)
    for n, k in ((2048, 512), (8192, 1024)):  # fc1 + GELU (Mimi's shape, and a larger one)
        w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
        b = torch.randn(n, device="cuda").to(dtype)
        for m in (1, 4):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            for approx in ("none", "tanh"):
                want = gemv.linear_gelu_ref(x.double(), w.double(), b.double(), approx)
                # every configuration once (the epilogue is the same code in all; compiles are slow)
                cfgs = [None] + (gemv._candidates(n) if (n, m, approx) == (2048, 1, "none") else [])
                for cfg in cfgs:
                    got = gemv.linear_gelu(x, w, b, approx, cfg)
                    assert ((got.double() - want).norm() / want.norm()).item() < (1e-2 if dtype == torch.bfloat16 else 1e-5), cfg
        eager, replay = _graph(lambda: gemv.linear_gelu(x, w, b))
        assert torch.equal(eager, replay)
        gemv.faster_than_library(w, b, gelu="none")
    for n, k in ((1024, 8192), (2048, 8192), (2048, 2048)):  # split-K for the products feeding add + norm
        w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
        x = torch.randn(1, k, device="cuda", dtype=dtype)
        want = gemv.linear_ref(x.double(), w.double())
        for cfg in gemv._candidates(n, k, partials=True):
            out = gemv.linear_partials(x, w, None, cfg)
            got = out.total() if isinstance(out, gemv.Partials) else out
            assert ((got.double() - want).norm() / want.norm()).item() < (1e-2 if dtype == torch.bfloat16 else 1e-5), cfg
        gemv.faster_than_library(w, partials=True)
        eager, replay = _graph(lambda: gemv.linear_partials(x, w))
        eager, replay = [e.sums if isinstance(e, gemv.Partials) else e for e in (eager, replay)]
        assert torch.equal(eager, replay)
    print("\n" + "\n".join(str(c) for c in gemv.choices()))


@pytest.mark.gpu
def test_gpu_gumbel_argmax_equals_engine():
    for b, v in ((1, 128256), (24, 128256), (3, 49152)):
        logits, temp, _, seeds, steps = _sampling_rows(b, v, "cuda")
        off_k, off_p = torch.zeros(b, dtype=torch.long, device="cuda"), torch.ones(b, device="cuda")
        for lg in (logits, logits.to(torch.bfloat16)):
            want = engine_sample(lg, temp, off_k, off_p, seeds, steps, filtered=False)
            assert torch.equal(fused_sampling.gumbel_argmax(lg, temp, seeds, steps), want)
    eager, replay = _graph(lambda: fused_sampling.gumbel_argmax(logits, temp, seeds, steps))
    assert torch.equal(eager, replay)
    logits, temp, _, seeds, steps = _sampling_rows(2, 128256, "cuda")
    one = [t[1:2].contiguous() for t in (logits.to(torch.bfloat16), temp, seeds, steps)]  # temperature 1
    print(f"\ngumbel_argmax V=128256 B=1 bf16: kernel {_time_us(lambda: fused_sampling.gumbel_argmax(*one)):.1f} us, "
          f"one program a row {_time_us(lambda: sample(one[0], one[1], off_k[:1], one[2], one[3])):.1f} us, "
          f"engine {_time_us(lambda: engine_sample(one[0], one[1], off_k[:1], off_p[:1], one[2], one[3], filtered=False)):.1f} us")


@pytest.mark.gpu
def test_gpu_advance_rows_equals_reference():
    for v in (1000, 49152, 128256):
        _check_advance_rows("cuda", v)
    logits, _, _, _, _ = _sampling_rows(1, 128256, "cuda")
    lg = logits.to(torch.bfloat16)
    idx = torch.zeros(1, dtype=torch.long, device="cuda")
    state = [torch.zeros(2, dtype=torch.long, device="cuda") for _ in range(3)]
    out, work = torch.zeros(1, dtype=torch.long, device="cuda"), fused_sampling.advance_work(1, "cuda")
    eager, replay = _graph(lambda: fused_sampling.advance_rows(lg, idx, *state, out, 1, work=work).clone())
    assert torch.equal(eager, replay) and int(state[1][0]) > 0  # (each run advanced slot 0's position)
    from realtime.engines.sampling import greedy as engine_greedy

    print(f"\nadvance_rows V=128256 B=1 bf16: one launch {_time_us(lambda: fused_sampling.advance_rows(lg, idx, *state, out, 1, work=work)):.1f} us, "
          f"the torch ops {_time_us(lambda: fused_sampling.advance_rows_ref(lg.float(), idx, *state, out, 1)):.1f} us, "
          f"the argmax alone {_time_us(lambda: engine_greedy(lg)):.1f} us")


@pytest.mark.gpu
@pytest.mark.parametrize("v", [2051, 128256])
def test_gpu_sample_equals_engine(v):
    logits, temp, top_k, seeds, steps = _sampling_rows(24, v, "cuda")
    got = sample(logits, temp, top_k, seeds, steps)
    want = engine_sample(logits, temp, top_k, torch.ones(24, device="cuda"), seeds, steps)
    assert torch.equal(got, want), (got, want)
    if v <= fused_sampling._SMALL_V:  # bf16 logits: the 16-bit keys
        bf = _distinct_16bit_rows(24, v, torch.bfloat16, "cuda")
        assert torch.equal(sample(bf, temp, top_k, seeds, steps),
                           engine_sample(bf, temp, top_k, torch.ones(24, device="cuda"), seeds, steps))
    flat = sample(torch.zeros_like(logits), torch.ones_like(temp), torch.zeros_like(top_k), seeds, steps)
    assert torch.equal(flat, uniform_noise(seeds, steps, v).argmax(-1))
    eager, replay = _graph(lambda: sample(logits, temp, top_k, seeds, steps))
    assert torch.equal(eager, replay)
    if v <= fused_sampling._SMALL_V:  # every warp count the load-time choice may pick gives the same tokens
        for db in fused_sampling._DIGIT_OPTIONS:
            for w in fused_sampling._WARP_OPTIONS:
                assert torch.equal(sample(logits, temp, top_k, seeds, steps, num_warps=w, digit_bits=db), want), (db, w)
        print("\n", fused_sampling.choices())
    print(f"\nsample B=24 V={v}: kernel {_time_us(lambda: sample(logits, temp, top_k, seeds, steps)):.1f} us, "
          f"ref {_time_us(lambda: sample_ref(logits, temp, top_k, seeds, steps)):.1f} us")
