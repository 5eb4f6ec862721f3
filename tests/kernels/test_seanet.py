"""SEANet step kernels (kernels/seanet.py) vs their PyTorch references, and Mimi's streaming decoder
with them wired in vs its plain PyTorch step.

On a machine without CUDA the kernels run through Triton's CPU interpreter (TRITON_INTERPRET=1 is
set here, before anything builds a kernel), where float32 -> bf16 casts truncate instead of rounding,
so bf16 results may be 1 ulp off; float32 is compared near-exactly (the interpreter's ELU is
exp(x) - 1 where the GPU's is expm1). Every case checks the state left behind and that nothing
beside the state's view of the flat state buffer was written. The @gpu tests run the same
comparisons compiled on CUDA, and the default Mimi decoder step fused vs unfused in bf16.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # must precede the first kernel build (kernels import triton lazily)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

from realtime.codecs import mimi  # noqa: E402
from realtime.kernels import seanet  # noqa: E402
from realtime.kernels.seanet import (  # noqa: E402
    bias_act,
    bias_act_ref,
    overlap_add,
    overlap_add_ref,
    state_concat,
    state_concat_ref,
)

TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1.6e-2, 1e-2)}
DTYPES = [torch.float32, torch.bfloat16]
LAYOUTS = ["ncw", "cl", "time_major"]



def _close(a, b, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)


def _act(b, c, n, layout, g, dtype, device):
    """An activation [B, C, n] as the step sees it: contiguous ("ncw"), channels-last 4-D ("cl"), or
    a time-major 3-D view ("time_major": ``from_cl`` of a channels-last tensor)."""
    x = torch.randn(b, c, n, generator=g).to(device, dtype)
    if layout == "ncw":
        return x
    x = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    return x if layout == "cl" else x.squeeze(2)


def _state(b, c, n, layout, g, dtype, device):
    """(flat [B, total], state): a view of a flat buffer with other states on both sides, laid out
    like ``mimi._state_views`` (channels-last 4-D for "cl", [B, C, n] otherwise)."""
    shapes = [(3, 2), (c, n), (2, 5)]
    flat = torch.randn(b, sum(ci * ni for ci, ni in shapes), generator=g).to(device, dtype)
    return flat, mimi._state_views(flat, shapes, [layout == "cl"] * 3)[1]


# ------------------------------------------------------------------------------------ state_concat

CONCAT_CASES = [  # B, C, T, P
    (1, 4, 2, 6),  # T < P: the decoder's first conv (2 latents, kernel 7)
    (2, 3, 6, 2),
    (2, 70, 5, 5),  # T == P; two channel blocks
    (1, 130, 40, 3),  # three channel blocks, two time blocks
    (2, 4, 600, 2),  # three time blocks
    (3, 8, 1, 4),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CONCAT_CASES)
def test_state_concat(cpu_kernels, case, layout, dtype):
    b, c, t, p = case
    g = torch.Generator().manual_seed(sum(case))
    x = _act(b, c, t, layout, g, dtype, "cpu")
    for elu in (False, True):
        flat, state = _state(b, c, p, layout, g, dtype, "cpu")
        flat_ref = flat.clone()
        state_ref = mimi._state_views(flat_ref, [(3, 2), (c, p), (2, 5)], [layout == "cl"] * 3)[1]
        buf = state_concat(x, state, elu)
        want = state_concat_ref(x, state_ref, elu)
        assert buf.shape == want.shape and buf.dtype == dtype
        if x.dim() == 4:
            assert buf.is_contiguous(memory_format=torch.channels_last)
        else:
            assert buf.is_contiguous()
        if elu:
            _close(buf, want, dtype)
            _close(flat, flat_ref, dtype)
            # Nothing outside the state's view is written.
            assert torch.equal(flat[:, :6], flat_ref[:, :6]) and torch.equal(flat[:, -10:], flat_ref[:, -10:])
        else:  # pure copies: exact
            assert torch.equal(buf, want) and torch.equal(flat, flat_ref)


def test_state_concat_streams(cpu_kernels):
    """Chained steps, the state carried between them, equal the reference's (as a conv sees them)."""
    g = torch.Generator().manual_seed(0)
    flat, state = _state(2, 5, 3, "cl", g, torch.float32, "cpu")
    ref = state.clone()
    for n in (1, 2, 4, 1, 3):
        x = _act(2, 5, n, "cl", g, torch.float32, "cpu")
        _close(state_concat(x, state, True), state_concat_ref(x, ref, True), torch.float32)
        _close(state, ref, torch.float32)


# ------------------------------------------------------------------------------------ overlap_add

OVERLAP_CASES = [  # B, C, N, V
    (1, 4, 2, 2),  # the upsample conv: stride 2, overlap 2
    (2, 70, 16, 8),
    (2, 5, 600, 4),  # several time blocks
    (1, 3, 8, 0),  # no overlap: the bias alone
    (3, 8, 6, 5),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", OVERLAP_CASES)
def test_overlap_add(cpu_kernels, case, layout, dtype):
    b, c, n, v = case
    g = torch.Generator().manual_seed(sum(case))
    y = _act(b, c, n + v, layout, g, dtype, "cpu")
    for bias in (None, torch.randn(c, generator=g).to(dtype)):
        flat, tail = _state(b, c, v, layout, g, dtype, "cpu")
        flat_ref = flat.clone()
        tail_ref = mimi._state_views(flat_ref, [(3, 2), (c, v), (2, 5)], [layout == "cl"] * 3)[1]
        out = overlap_add(y, tail, bias, n)
        want = overlap_add_ref(y, tail_ref, bias, n)
        assert out.shape == want.shape and out.dtype == dtype
        assert out.is_contiguous(memory_format=torch.channels_last) if y.dim() == 4 else out.is_contiguous()
        if dtype == torch.float32:
            assert torch.equal(out, want)  # the same float32 additions in the same order
        else:  # the interpreter truncates the rounded head sum: up to 1 ulp of |y + tail| < 8 (2**-5)
            torch.testing.assert_close(out.float(), want.float(), rtol=1.6e-2, atol=2**-5 + 1e-2)
        assert torch.equal(flat, flat_ref)  # the new tail is a copy; nothing else is touched


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_step_state_rows_in_place(cpu_kernels, layout):
    """With rows, input row b steps state row rows[b] of a bigger state in place: the same output
    and state as the kernel on the gathered rows, every other row untouched."""
    dtype, b, c, t, p, s_rows = torch.float32, 3, 70, 5, 4, 7
    g = torch.Generator().manual_seed(5)
    rows = torch.tensor([5, 0, 3])
    rest = torch.ones(s_rows, dtype=torch.bool)
    rest[rows] = False
    x = _act(b, c, t, layout, g, dtype, "cpu")
    y = _act(b, c, t + p, layout, g, dtype, "cpu")
    bias = torch.randn(c, generator=g)
    for op, arg in ((state_concat, x), (overlap_add, y)):
        flat, state = _state(s_rows, c, p, layout, g, dtype, "cpu")
        flat0 = flat.clone()
        sub = state[rows].clone()
        if op is state_concat:
            got, want = op(arg, state, True, rows=rows), op(arg, sub, True)
            ref = state_concat_ref(arg, _state_views(flat0.clone(), c, p, layout), True, rows)
        else:
            got, want = op(arg, state, bias, t, rows=rows), op(arg, sub, bias, t)
            ref = overlap_add_ref(arg, _state_views(flat0.clone(), c, p, layout), bias, t, rows)
        assert torch.equal(got, want) and torch.equal(state[rows], sub)
        _close(got, ref, dtype)
        assert torch.equal(flat[rest], flat0[rest])
    with pytest.raises(ValueError, match="pass rows="):
        state_concat(x, state, True)
    with pytest.raises(ValueError, match="rows must be"):
        overlap_add(y, state, None, t, rows=rows.int())


def _state_views(flat, c, p, layout):
    return mimi._state_views(flat, [(3, 2), (c, p), (2, 5)], [layout == "cl"] * 3)[1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("b, c, t", [(1, 4, 2), (2, 70, 600), (3, 130, 5)])
def test_bias_act(cpu_kernels, b, c, t, layout, dtype):
    g = torch.Generator().manual_seed(b + c + t)
    y = _act(b, c, t, layout, g, dtype, "cpu")
    res = _act(b, c, t, "ncw", g, dtype, "cpu")  # a residual in another layout than y
    if y.dim() == 4:
        res = res.unsqueeze(2)
    bias = torch.randn(c, generator=g).to(dtype)
    for r in (None, res):
        for elu in (False, True):
            out = bias_act(y, bias, r, elu)
            assert out.shape == y.shape and out.dtype == dtype
            assert out.is_contiguous(memory_format=torch.channels_last) if y.dim() == 4 else out.is_contiguous()
            _close(out, bias_act_ref(y, bias, r, elu), dtype)
    # the same function as the unfused ops (float32)
    y32, b32, r32 = y.float(), bias.float(), res.float()
    want = F.elu(y32 + b32.view(-1, *[1] * (y.dim() - 2)) + r32)
    torch.testing.assert_close(bias_act(y32, b32, r32, True), want,
                               rtol=1e-5, atol=1e-6)


def test_launchers_check_inputs(cpu_kernels):
    x, state = torch.randn(2, 4, 3), torch.randn(2, 4, 2)
    with pytest.raises(ValueError, match="does not fit"):
        state_concat(x, state[:, :3], True)
    with pytest.raises(ValueError, match="rank"):
        state_concat(x, state.unsqueeze(2), True)
    with pytest.raises(ValueError, match="P >= 1"):
        state_concat(x, state[..., :0], True)
    with pytest.raises(ValueError, match=r"\[B, C, 1, T\]"):
        state_concat(torch.randn(2, 4, 2, 3), torch.randn(2, 4, 2, 2), True)
    with pytest.raises(ValueError, match="n_out"):
        overlap_add(torch.randn(2, 4, 7), state, None, 4)
    with pytest.raises(ValueError, match="bias"):
        overlap_add(torch.randn(2, 4, 6), state, torch.randn(3), 4)
    with pytest.raises(ValueError, match="bias must be"):
        bias_act(x, torch.randn(3))
    with pytest.raises(ValueError, match="residual"):
        bias_act(x, torch.randn(4), torch.randn(2, 4, 2))


# ----------------------------------------------------------------------------- Mimi decoder step

real_select = mimi.KVState.select

TINY = dict(hidden_size=32, num_filters=4, upsampling_ratios=(3, 2, 2), num_residual_layers=2,
            codebook_size=16, codebook_dim=8, num_quantizers=4, upsample_groups=32, num_layers=1,
            intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=5)


def _random_mimi(cfg: mimi.MimiConfig, device="cpu", dtype=torch.float32, seed=0) -> mimi.Mimi:
    """A Mimi with every weight, LayerScale and codebook random (default init leaves codebooks zero)."""
    m = mimi.Mimi(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            if name.endswith("inv_freq"):
                continue
            if "layernorm" in name or name.endswith(".scale"):
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            elif t.dim() > 1:
                t.copy_(torch.randn(t.shape, generator=g) / math.sqrt(t[0].numel()))
            else:
                t.copy_(torch.randn(t.shape, generator=g) * 0.3)
    return m.to(device, dtype).eval().requires_grad_(False)


def _decode(m, codes, channels_last, slots=False, in_place=True):
    """Stream codes [B, K, T] one frame a step -> (audio [B, 1, T * frame_size], final conv state,
    KV ring, ring positions). With ``slots`` the rows are slots B..1 of a B + 2 slot decoder."""
    b = codes.shape[0]
    dec = m.streaming_decoder(b + 2 if slots else b, channels_last)
    dec.in_place = in_place
    idx = torch.arange(b, 0, -1, device=codes.device).repeat_interleave(2)[::2]  # strided, as a packed row can be
    outs = [dec.step(codes[..., i: i + 1], idx if slots else None) for i in range(codes.shape[-1])]
    sel = idx if slots else torch.arange(b)
    return torch.cat(outs, -1), dec.state[sel], dec.kv.kv[:, :, sel], dec.kv.kp[sel]


@pytest.mark.parametrize("channels_last, slots, in_place", [(False, False, True), (True, False, True),
                                                            (True, True, True), (True, True, False), (False, True, True)])
def test_mimi_decoder_step_fused(cpu_kernels, monkeypatch, channels_last, slots, in_place):
    """The decoder step with every SEANet conv's glue, the ring positions and the window attention
    on the kernels (as on CUDA, here through the interpreter) equals the plain step: audio, the
    whole conv state, the KV ring and its positions left behind; for a slot subset also when the
    kernels step the slots' rows in place (no gather, no write-back)."""
    cfg = mimi.MimiConfig(**TINY)
    m = _random_mimi(cfg)
    codes = torch.randint(0, 16, (2, 4, 5), generator=torch.Generator().manual_seed(1))
    want, *want_state = _decode(m, codes, channels_last, slots)
    calls = {"state_concat": 0, "overlap_add": 0, "bias_act": 0}

    def spy(name, real):
        def counted(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return counted

    for name in calls:
        monkeypatch.setattr(seanet, name, spy(name, getattr(seanet, name)))
    monkeypatch.setattr(mimi, "_fused_step", lambda x: True)
    if slots:  # the in-place path must never gather the state
        monkeypatch.setattr(mimi.KVState, "select", lambda *a: pytest.fail("gathered") if in_place else real_select(*a))
    got, *got_state = _decode(m, codes, channels_last, slots, in_place)
    steps, ratios, res = codes.shape[-1], len(cfg.upsampling_ratios), cfg.num_residual_layers
    assert calls["state_concat"] == steps * (2 + ratios * res)  # first and last conv, each ResBlock's k-conv
    assert calls["overlap_add"] == steps * (1 + ratios)  # the upsample and every decoder transposed conv
    assert calls["bias_act"] == steps * 2 * ratios * res  # each ResBlock's two biases
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_state, want_state):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------- compiles for the GPU

# Without TRITON_INTERPRET in a fresh interpreter: Triton lowers the kernels to PTX and runs its
# bundled ptxas for sm_90 without a GPU (the GPU-only libdevice expm1 path included).
_AOT = r"""
from realtime.kernels import seanet
from sm90 import compile_sm90 as comp

concat, overlap, bias_act = seanet._kernels()
for dt in ("bf16", "fp32"):
    comp(concat, dict(x_ptr=f"*{dt}", s_ptr=f"*{dt}", o_ptr=f"*{dt}", rows_ptr="*i64"),
         dict(ELU=True, LIBDEVICE=True, HAS_ROWS=True, BLOCK_C=32, BLOCK_T=32, BLOCK_P=8), barrier=True)
    comp(overlap, dict(y_ptr=f"*{dt}", v_ptr=f"*{dt}", bias_ptr=f"*{dt}", o_ptr=f"*{dt}", rows_ptr="*i64"),
         dict(HAS_BIAS=True, HAS_ROWS=True, BLOCK_C=64, BLOCK_T=16, BLOCK_V=8), barrier=True)
    comp(bias_act, dict(y_ptr=f"*{dt}", bias_ptr=f"*{dt}", r_ptr=f"*{dt}", o_ptr=f"*{dt}"),
         dict(HAS_RES=True, ELU=True, LIBDEVICE=True, BLOCK_C=64, BLOCK_T=16))
print("compiled")
"""


def test_kernels_compile_for_sm90(tmp_path):
    from sm90 import run_script

    run_script(_AOT, tmp_path)


# ---------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_kernels(dtype):
    for layout in LAYOUTS:
        for b, c, t, p in CONCAT_CASES + [(8, 32, 1920, 2), (8, 512, 2, 6)]:
            g = torch.Generator().manual_seed(b * c + t)
            x = _act(b, c, t, layout, g, dtype, "cuda")
            for elu in (False, True):
                flat, state = _state(b, c, p, layout, g, dtype, "cuda")
                flat_ref = flat.clone()
                state_ref = mimi._state_views(flat_ref, [(3, 2), (c, p), (2, 5)], [layout == "cl"] * 3)[1]
                buf = state_concat(x, state, elu)
                want = state_concat_ref(x, state_ref, elu)
                _close(buf, want, dtype)  # ELU: libdevice expm1 as PyTorch's, so equal up to float32 ulps
                _close(flat, flat_ref, dtype)
                if not elu:
                    assert torch.equal(buf, want) and torch.equal(flat, flat_ref)
        for b, c, n, v in OVERLAP_CASES + [(8, 32, 1920, 4), (8, 256, 16, 8)]:
            g = torch.Generator().manual_seed(b * c + n)
            y = _act(b, c, n + v, layout, g, dtype, "cuda")
            bias = torch.randn(c, generator=g).to("cuda", dtype)
            flat, tail = _state(b, c, v, layout, g, dtype, "cuda")
            flat_ref = flat.clone()
            tail_ref = mimi._state_views(flat_ref, [(3, 2), (c, v), (2, 5)], [layout == "cl"] * 3)[1]
            out = overlap_add(y, tail, bias, n)
            # Rounded like the unfused adds (head sum to y's dtype, then + bias): bit-equal.
            assert torch.equal(out, overlap_add_ref(y, tail_ref, bias, n)) and torch.equal(flat, flat_ref)
        for b, c, t in ((8, 32, 1920), (1, 512, 2), (4, 64, 40)):
            g = torch.Generator().manual_seed(b + c + t)
            y, res = _act(b, c, t, layout, g, dtype, "cuda"), _act(b, c, t, layout, g, dtype, "cuda")
            bias = torch.randn(c, generator=g).to("cuda", dtype)
            for r in (None, res):
                for elu in (False, True):
                    _close(bias_act(y, bias, r, elu), bias_act_ref(y, bias, r, elu), dtype)


def _graphed(fn, *inputs):
    from realtime.cuda_graphs import capture

    return capture(lambda: fn(*inputs))


@pytest.mark.gpu
def test_gpu_default_decoder_step_fused_equals_unfused(monkeypatch):
    """The default Mimi's decoder step in bf16, channels-last, on a subset of a decoder's slots (the
    served path): the kernels (SEANet glue, folded RVQ decode, ring positions, window attention; the
    slots' state stepped in place) vs the plain ops (the state gathered and written back), eager and
    in a CUDA graph, with the step times printed. Both are bf16 computations of the same function,
    rounded differently (the kernels round a bias add, an ELU and the RVQ sum once where the ops
    round them twice), so each is compared with the plain step run in float32 on the same weights:
    the kernels must be as close to it as the plain bf16 ops are, and close to the ops themselves."""
    m = _random_mimi(mimi.MimiConfig(), "cuda", torch.bfloat16)
    m32 = _random_mimi(mimi.MimiConfig(), "cuda", torch.bfloat16).float()  # the same bf16 weights, in float32
    slots = torch.tensor([5, 1, 3, 2], device="cuda")
    b, steps = 4, 6
    codes = torch.randint(0, 2048, (b, 32, steps), generator=torch.Generator().manual_seed(3)).cuda()

    def run(fused, model=m):
        monkeypatch.setattr(mimi, "_fused_step", (lambda x: x.is_cuda) if fused else (lambda x: False))
        if model is m32:  # the reference: library products, no TF32
            tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
            torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
            try:
                with monkeypatch.context() as mp:
                    mp.setattr(mimi, "use_gemv", lambda *a, **k: False)
                    dec = model.streaming_decoder(b + 3)
                    return torch.cat([dec.step(codes[..., i: i + 1], slots) for i in range(steps)], -1)
            finally:
                torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
        dec = model.streaming_decoder(b + 3)
        assert dec.channels_last
        audio = torch.cat([dec.step(codes[..., i: i + 1], slots) for i in range(steps)], -1)
        inp = codes[..., :1].clone()
        graph, out = _graphed(lambda c: dec.step(c, slots), inp)
        dec.reset()
        replayed = []
        for i in range(steps):
            inp.copy_(codes[..., i: i + 1])
            graph.replay()
            replayed.append(out.clone())
        graph.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            graph.replay()
        torch.cuda.synchronize()
        print(f"\ndefault Mimi bf16 B={b} of {b + 3} slots, decoder step {'on the kernels' if fused else 'plain'}: "
              f"{(time.perf_counter() - t0) / 50 * 1e3:.3f} ms (graph)")
        return audio.float(), torch.cat(replayed, -1).float()

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    ref = run(False, m32).float()
    want, want_graph = run(False)
    got, got_graph = run(True)
    print(f"kernels vs ops (bf16): eager {rel(got, want):.2e}, graph {rel(got_graph, want_graph):.2e}; "
          f"graph vs eager (kernels) {rel(got_graph, got):.2e}; vs float32: kernels {rel(got, ref):.2e}, "
          f"ops {rel(want, ref):.2e}")
    assert rel(got, ref) < 1.25 * rel(want, ref) + 1e-3  # the kernels are no less accurate than the ops
    assert rel(got, want) < 2e-2 and rel(got_graph, want_graph) < 2e-2  # bf16 roundings apart, not more
    assert rel(got_graph, got) < 1e-3  # the graph replays the same kernels
