"""decode_attention's early first key block (EARLY_KV) and forced split counts.

With EARLY_KV each split loads its first block of keys and values that earlier steps wrote before
its PDL wait and puts the step's own key and value into it after the wait. It must give the very
same output as the plain kernel: bit for bit on the CPU interpreter (which ignores PDL) and on
the GPU with PDL, in a CUDA graph, after the kernel that writes the own key (RoPE + cache write),
and after a kernel that changes the slots and lengths while the attention already runs.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first kernel build (kernels import triton lazily)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from realtime.kernels import decode_attention as da  # noqa: E402
from realtime.kernels.decode_attention import decode_attention, decode_attention_ref  # noqa: E402

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 3e-2)}  # as test_kernels: interpreter bf16 casts truncate

# B, H, Hkv, S, Tmax, D, lengths. Tmax 200 is 4 blocks of 64 keys: the default is 4 splits of one
# block (rows of 1, 2 or 40 keys leave splits empty); 2 splits have 2 blocks each, 1 split all 4.
# Own keys (length - 1) at 0, 1, 39, 63 (the first block's last row), 64 (the second block's first
# row: split 1's first block, split 0's second), 129, 199 (a later block of one split).
CASES = [
    (1, 4, 2, 2, 200, 32, [130]),
    (7, 6, 2, 8, 200, 16, [1, 2, 40, 64, 65, 130, 200]),
]


from shared import attention_inputs as _inputs  # noqa: E402


def _close(a, b, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_early_kv_matches_plain_and_reference(cpu_kernels, case, dtype):
    b, h, hkv, s, tmax, d, lengths = case
    q, kc, vc, slots = _inputs(b, h, hkv, s, tmax, d, dtype)
    lengths = torch.tensor(lengths)
    want = decode_attention_ref(q.float(), kc.float(), vc.float(), slots, lengths, 0.3)
    for ns in (None, 1, 2):
        early = decode_attention(q, kc, vc, slots, lengths, 0.3, num_splits=ns, early_kv=True)
        plain = decode_attention(q, kc, vc, slots, lengths, 0.3, num_splits=ns, early_kv=False)
        assert torch.equal(early, plain), f"num_splits={ns}"  # the same arithmetic, block for block
        _close(early, want, dtype)


def test_early_kv_never_reads_past_length(cpu_kernels):
    """NaN keys and inf values from the own key's next position on (and in other slots) stay out."""
    q, kc, vc, slots = _inputs(4, 4, 2, 6, 200, 16, torch.float32)
    lengths = torch.tensor([1, 64, 65, 150])
    want = decode_attention_ref(q, kc, vc, slots, lengths, 0.2)
    for i in range(4):
        kc[slots[i], :, lengths[i]:] = float("nan")
        vc[slots[i], :, lengths[i]:] = float("inf")
    kc[[j for j in range(6) if j not in slots.tolist()]] = float("nan")
    for ns in (None, 1, 2):
        out = decode_attention(q, kc, vc, slots, lengths, 0.2, num_splits=ns, early_kv=True)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_forced_splits_match_default(cpu_kernels):
    q, kc, vc, slots = _inputs(3, 4, 2, 4, 264, 16, torch.float32)
    lengths = torch.tensor([264, 100, 3])
    default = decode_attention(q, kc, vc, slots, lengths, 0.25)
    for ns in (1, 2, 5):  # 5 = cdiv(264, 64), the most the kernel takes
        torch.testing.assert_close(decode_attention(q, kc, vc, slots, lengths, 0.25, num_splits=ns), default,
                                   rtol=1e-6, atol=1e-6)
    for bad in (0, -1, 6):
        with pytest.raises(ValueError, match=r"num_splits must be in \[1, 5\]"):
            decode_attention(q, kc, vc, slots, lengths, 0.25, num_splits=bad)


def test_early_kv_switch_reaches_kernel(cpu_kernels, monkeypatch):
    """EARLY_KV is read at each call and early_kv= overrides it (what a benchmark flips)."""
    split, merge = da._kernels()
    seen = []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(kw["EARLY"])
                return split[grid](*args, **kw)
            return launch

    monkeypatch.setattr(da, "_kernels", lambda: (Spy(), merge))
    q, kc, vc, slots = _inputs(1, 2, 1, 1, 64, 16, torch.float32)
    lengths = torch.tensor([5])
    decode_attention(q, kc, vc, slots, lengths)
    monkeypatch.setattr(da, "EARLY_KV", False)
    decode_attention(q, kc, vc, slots, lengths)
    decode_attention(q, kc, vc, slots, lengths, early_kv=True)
    monkeypatch.setattr(da, "EARLY_KV", True)
    decode_attention(q, kc, vc, slots, lengths, early_kv=False)
    assert seen == [True, False, True, False]


# ---------------------------------------------------------------------------------------- GPU


from shared import eager_and_replayed as _graph  # noqa: E402


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_early_kv_after_the_cache_write(dtype):
    """RoPE + cache write of the own key, then the attention (PDL on sm90), eager and in a graph:
    early_kv on and off give the same bits, both equal to the reference."""
    from realtime.kernels import _triton
    from realtime.kernels.rotary import rotary_cache_write

    cases = CASES + [(8, 32, 8, 16, 2048, 64, [1, 5, 64, 65, 264, 700, 2047, 2048]),
                     (1, 32, 8, 2, 2048, 64, [264])]
    for b, h, hkv, s, tmax, d, lengths in cases:
        q0, kc0, vc0, slots = _inputs(b, h, hkv, s, tmax, d, dtype, "cuda")
        g = torch.Generator().manual_seed(1)
        qkv = torch.randn(b, (h + 2 * hkv) * d, generator=g).to("cuda", dtype)
        ang = torch.arange(tmax, dtype=torch.float32)[:, None] * torch.rand(d // 2, generator=g).repeat(2)
        cos, sin = ang.cos().to("cuda", dtype), ang.sin().to("cuda", dtype)
        lengths = torch.tensor(lengths, device="cuda")
        pos = lengths - 1
        for ns in (None, 1, 2):
            outs = {}
            for early in (True, False):
                kc, vc = kc0.clone(), vc0.clone()

                def step(kc=kc, vc=vc, ns=ns, early=early):
                    q = rotary_cache_write(qkv, cos, sin, pos, kc, vc, slots, h, hkv)
                    return decode_attention(q, kc, vc, slots, lengths, 0.125, num_splits=ns, early_kv=early)

                eager, replay = _graph(step)
                assert torch.equal(eager, replay)
                outs[early] = replay
            assert torch.equal(outs[True], outs[False]), (lengths.tolist(), ns)
            q = rotary_cache_write(qkv, cos, sin, pos, kc, vc, slots, h, hkv)
            _close(outs[True], decode_attention_ref(q.float(), kc.float(), vc.float(), slots, lengths, 0.125), dtype)
    print(f"\nPDL: {_triton.pdl(q0)}")


def _late_writer():
    """A kernel that, after its PDL wait (so the next kernel is already launched), spins for
    ``spin_ns`` and then writes each row's slot and length and its own key and value: what the
    attention reads before its wait is then stale."""
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import globaltimer

    from realtime.kernels._triton import pdl_jit

    pdl_enter = pdl_jit()

    @triton.jit
    def late_writer(kc_ptr, vc_ptr, kn_ptr, vn_ptr, slots_ptr, len_ptr, new_slots_ptr, new_len_ptr,
                    HKV, TMAX, spin_ns, D: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        b = tl.program_id(0)
        t0 = globaltimer()
        while globaltimer() - t0 < spin_ns:
            pass
        slot = tl.load(new_slots_ptr + b)
        length = tl.load(new_len_ptr + b)
        d = tl.arange(0, D)
        for hh in range(HKV):
            dst = ((slot * HKV + hh) * TMAX + length - 1) * D + d
            tl.store(kc_ptr + dst, tl.load(kn_ptr + (b * HKV + hh) * D + d))
            tl.store(vc_ptr + dst, tl.load(vn_ptr + (b * HKV + hh) * D + d))
        tl.store(slots_ptr + b, slot)
        tl.store(len_ptr + b, length)

    return late_writer


@pytest.mark.gpu
@pytest.mark.parametrize("move", [False, True])
def test_gpu_early_kv_stale_before_the_wait(move):
    """The kernel before the attention writes the own keys (and, with ``move``, new slots and
    lengths) 2 ms after it starts, long after the attention has been launched (eagerly, tens of us
    later) and has read its first block: early_kv must still read them all."""
    from realtime.kernels._triton import pdl, pdl_launch

    dtype, b, h, hkv, s, tmax, d = torch.bfloat16, 4, 32, 8, 8, 512, 64
    q, kc, vc, slots = _inputs(b, h, hkv, s, tmax, d, dtype, "cuda")
    lengths = torch.tensor([1, 64, 65, 300], device="cuda")
    new_slots, new_lengths = (slots.flip(0), torch.tensor([130, 2, 64, 257], device="cuda")) if move else (slots, lengths)
    kn = torch.randn(b, hkv, d, device="cuda").to(dtype) * 4  # the own keys: stale rows would show
    vn = torch.randn(b, hkv, d, device="cuda").to(dtype) * 4
    writer = _late_writer()
    # what the cache, slots and lengths hold once the writer is done
    kw, vw = kc.clone(), vc.clone()
    kw[new_slots, :, new_lengths - 1] = kn
    vw[new_slots, :, new_lengths - 1] = vn
    want = decode_attention_ref(q.float(), kw.float(), vw.float(), new_slots, new_lengths, 0.125)
    for ns in (None, 1):
        for early in (True, False):
            for spin_ns in (0, 2_000_000):  # the first call compiles the kernels (no race: the writer is long done)
                k1, v1, sl, ln = kc.clone(), vc.clone(), slots.clone(), lengths.clone()
                torch.cuda.synchronize()
                writer[(b,)](k1, v1, kn, vn, sl, ln, new_slots, new_lengths, hkv, tmax, spin_ns, D=d, num_warps=1,
                             **pdl_launch(q))
                out = decode_attention(q, k1, v1, sl, ln, 0.125, num_splits=ns, early_kv=early)
                torch.cuda.synchronize()
                _close(out, want, dtype)
    print(f"\nPDL: {pdl(q)}")
