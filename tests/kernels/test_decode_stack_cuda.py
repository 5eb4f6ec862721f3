"""The CUDA C++ decode stack (kernels/csrc/decode_stack.cu) computes the layer-by-layer step."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from realtime.engines.transformer import KVCache, Transformer, TransformerConfig
from realtime.kernels import decode_stack_cuda as dsc

# widths the kernel takes (every K one of 1024..8192); 2 layers, 4 query heads a kv head
CFG = TransformerConfig(dim=1024, n_layers=2, n_heads=16, n_kv_heads=4, head_dim=64, intermediate_size=2048,
                        max_seq_len=200, rope_theta=500000.0)
# the CSM depth decoder's head layout (head dim 128, 4 query heads a kv head), at test size
DEPTH = TransformerConfig(dim=1024, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=128, intermediate_size=2048,
                          max_seq_len=48, rope_theta=500000.0)
SRC = Path(dsc.__file__).parent / "csrc" / "decode_stack.cu"


def test_takes_names_the_widths_it_handles() -> None:
    assert dsc.takes(2048, 8192, 32, 8, 64)  # Llama-3.2-1B, the CSM backbone
    assert dsc.takes(1024, 8192, 8, 2, 128)  # the CSM depth decoder
    assert not dsc.takes(576, 1536, 9, 3, 64)  # SmolLM2-135M: K not a multiple of 1024
    assert not dsc.takes(2048, 8192, 32, 8, 256)  # head dim over 128
    assert not dsc.takes(2048, 8192, 32, 2, 64)  # 16 query heads a kv head
    assert dsc.default_splits(8, 2048, 132) == dsc.MAX_SPLITS == 12 and dsc.default_splits(8, 40, 132) == 2
    assert dsc.default_splits(8, 2048, 40) == 5


def test_kernel_builds_for_sm90_without_spills(tmp_path) -> None:
    """nvcc builds the .cu for sm_90 (no GPU needed): no registers spilled, no local stack."""
    nvcc = dsc._nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed here (the device test builds it)")
    res = subprocess.run([nvcc, "-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90", "-shared", "-Xcompiler",
                          "-fPIC", "-Xptxas", "-v", "-o", str(tmp_path / "k.so"), str(SRC)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    info = res.stderr
    # two builds: the step, and the timed one a probe asks for with stats (and the out-of-line poll)
    assert len(re.findall(r"Compiling entry function '\w*stack_kernel", info)) == 2, info
    props = re.findall(r"Function properties for (\w+)\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
                       r"(\d+) bytes spill loads", info)
    kernels = {name: (int(f), int(st), int(ld)) for name, f, st, ld in props if "stack_kernel" in name}
    step = next(v for k, v in kernels.items() if "ILb0E" in k)
    timed = next(v for k, v in kernels.items() if "ILb1E" in k)
    assert step == (0, 0, 0), info
    # the probe's build (clock reads, the trace's stores) may spill a little: its own reads of the
    # clock cost it more (its numbers are a diagnosis, the step's are timed without it)
    assert timed[1] <= 128 and timed[2] <= 128, info
    assert all(v == (0, 0, 0) for k, v in ((n, (int(f), int(st), int(ld))) for n, f, st, ld in props)
               if "stack_kernel" not in k), info
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", info)]
    assert len(regs) == 2 and max(regs) <= 168, f"{regs} registers a thread: 288 threads are three warpgroups of 128 on sm_90, 168 each"


def _text_sizes(cubin: bytes) -> dict[str, int]:
    """Bytes of each code (.text.*) section of an ELF64 cubin, by section name."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = secs[shstrndx][4]

    def name(off: int) -> str:
        return cubin[names + off:cubin.index(b"\0", names + off)].decode()
    return {name(sec[0]): sec[5] for sec in secs if name(sec[0]).startswith(".text.")}


def test_kernel_code_fits_the_instruction_cache(tmp_path) -> None:
    """The step's machine code stays small: every SM runs all of it once a layer, and code that
    does not stay in the SM's instruction cache is fetched again through the L2 behind the weight
    stream. At 181 KB (a3d4d7e) the warps stalled for instructions 6 % of the time; cut to 108 KB
    the 1B step ran 6 % faster on the H100 (BENCHMARKS.md, sixth session)."""
    nvcc = dsc._nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed here (the device test builds it)")

    def step_code(*flags: str) -> int:
        out = tmp_path / "k.cubin"
        res = subprocess.run([nvcc, "-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90", "-cubin", *flags,
                              "-o", str(out), str(SRC)], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-3000:]
        sizes = {k: v for k, v in _text_sizes(out.read_bytes()).items() if "stack_kernel" in k}
        assert len(sizes) == 2, sizes  # the step and its timed build
        return next(v for k, v in sizes.items() if "ILb0E" in k)

    # the layer loop's code, without the token sampler (which runs once a step, on one SM, after
    # the last layer: ~14 KB that no layer fetches), and the whole step with it
    layers, whole = step_code("-DREALTIME_STACK_NO_SAMPLER"), step_code()
    # (117.5 KB before the producer's L2 prefetch path, Params::ahead: +2.8 KB, run by the producer
    # only while its ring is full; Params::burst's test a stage: +0.6 KB, 120.9 KB; the cap at most the
    # ring: 120.8 KB)
    assert layers <= 121 * 1024, f"the step's code without its sampler is {layers / 1024:.0f} KB"
    assert whole - layers <= 16 * 1024, f"the sampler's code is {(whole - layers) / 1024:.0f} KB"


@pytest.mark.parametrize("n", [2, 64, 2048, 3072, 8192])
@pytest.mark.parametrize("programs, items, balance", [(132, 72, -1), (132, 72, 0), (132, 72, 80), (132, 128, 300),
                                                      (7, 3, 120), (132, 200, 50)])
def test_row_split_covers_every_row_once(n: int, programs: int, items: int, balance: int) -> None:
    """The rows of a GEMV split over the SMs (the kernel's slice(), mirrored in Python): each row
    exactly once, in order, every SM's first row even (the rows go out two to an LL word); with a
    balance the SMs that attend get no more rows than the others."""
    starts = [dsc.row_start(n, i, programs, items, balance) for i in range(programs + 1)]
    assert starts[0] == 0 and starts[-1] == n and all(s % 2 == 0 for s in starts)
    counts = [b - a for a, b in zip(starts, starts[1:])]
    assert min(counts) >= 0
    assert max(counts) == dsc.max_rows(programs, items, balance)(n)
    if balance >= 0:
        att, rest = counts[:min(items, programs)], counts[min(items, programs):]
        if rest:
            assert max(att) <= max(rest)
            assert sum(att) / len(att) <= sum(rest) / len(rest) + 2
        if balance == 0:
            assert max(counts) - min(counts) <= 2  # as even as row pairs allow


def test_refuses_what_it_does_not_take() -> None:
    """Clear errors, before any GPU work, for rows, dtypes and widths the kernel does not take."""
    from realtime.kernels.decode_stack import StackWeights

    cfg = TransformerConfig(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=64, intermediate_size=512)
    nq = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    w = StackWeights(torch.zeros(1, nq, 256), torch.zeros(1, 256, 256), torch.zeros(1, 1024, 256),
                     torch.zeros(1, 256, 512), torch.zeros(1, 2, 256), torch.zeros(256), 4, 2, 1e-5)
    x = torch.zeros(2, 256)
    z = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="one contiguous bf16 CUDA row"):
        dsc.decode_stack_cuda(w, x, z, z, z, z, z, z)


@pytest.mark.parametrize("name, value, want", [
    ("INFLIGHT", "", "2"), ("INFLIGHT", "4", "4"), ("INFLIGHT", "0", "0"), ("INFLIGHT", "x", "!must be a count"),
    ("INFLIGHT", "-1", "!must be a count"), ("L2_KEEP", "", "None"), ("L2_KEEP", " Auto", "None"),
    ("L2_KEEP", "8", "8"), ("L2_KEEP", "0", "0"), ("L2_KEEP", "-2", "!must be a count"), ("L2_AHEAD", "", "None"),
    ("L2_AHEAD", "auto", "None"), ("L2_AHEAD", "6", "6"), ("L2_AHEAD", "0", "0"), ("L2_AHEAD", "x", "!must be a count"),
    ("BURST", "", "None"), ("BURST", "auto", "None"), ("BURST", "4", "4"), ("BURST", "0", "0"), ("BURST", "-3", "!must be a count"),
    ("BACKOFF", "", "None"), ("BACKOFF", "200", "200"), ("BACKOFF", "0", "0"), ("BACKOFF", "2e2", "!must be a count")])
def test_stack_counts_from_the_environment(name: str, value: str, want: str) -> None:
    """REALTIME_STACK_INFLIGHT (weight copies in flight an SM), REALTIME_STACK_L2_KEEP (the stages
    L2 keeps; None: auto), REALTIME_STACK_L2_AHEAD (stages prefetched past a full ring; None:
    each stack's own) and REALTIME_STACK_BURST (copies in flight while the consumers are close
    behind; None: each stack's own) and REALTIME_STACK_BACKOFF (ns a poll sleeps; None: each stack's
    own) are read at import; a value that is not a count fails the import with a
    message naming the variable ("!": the message expected)."""
    env = {**os.environ, f"REALTIME_STACK_{name}": value}
    res = subprocess.run([sys.executable, "-c", f"from realtime.kernels import decode_stack_cuda as d; print(d.{name})"],
                         capture_output=True, text=True, env=env, timeout=120)
    fails = want.startswith("!")
    out = res.stdout.strip() if res.returncode == 0 else res.stderr
    assert (want[1:] in out and f"REALTIME_STACK_{name}" in out) if fails else out == want, out[-400:]
    assert (res.returncode != 0) == fails


def test_burst_of_takes_the_call_then_the_environment_then_the_stack(monkeypatch) -> None:
    """A launch's burst (copies in flight while the consumers are close behind): the call's, else
    REALTIME_STACK_BURST's where set, else the stack's own, else BURST_DEFAULT (3, text's measured best)."""
    from types import SimpleNamespace

    monkeypatch.setattr(dsc, "BURST", None)
    assert dsc.burst_of(SimpleNamespace(burst=None)) == dsc.BURST_DEFAULT == 3
    assert dsc.burst_of(SimpleNamespace(burst=0)) == 0  # (CSM's stacks)
    assert dsc.burst_of(SimpleNamespace(burst=0), 5) == 5
    monkeypatch.setattr(dsc, "BURST", 4)
    assert dsc.burst_of(SimpleNamespace(burst=0)) == 4 and dsc.burst_of(SimpleNamespace(burst=0), 0) == 0


def test_backoff_of_takes_the_call_then_the_environment_then_the_stack(monkeypatch) -> None:
    """A launch's poll back-off (ns): the call's, else REALTIME_STACK_BACKOFF's where set, else the
    stack's own (CSM's depth decoder), else BACKOFF_DEFAULT (0: text's measured best)."""
    from types import SimpleNamespace

    monkeypatch.setattr(dsc, "BACKOFF", None)
    assert dsc.backoff_of(SimpleNamespace(backoff=None)) == dsc.BACKOFF_DEFAULT == 0
    assert dsc.backoff_of(SimpleNamespace(backoff=200)) == 200
    assert dsc.backoff_of(SimpleNamespace(backoff=200), 0) == 0
    monkeypatch.setattr(dsc, "BACKOFF", 50)
    assert dsc.backoff_of(SimpleNamespace(backoff=200)) == 50 and dsc.backoff_of(SimpleNamespace(backoff=None), 7) == 7


@pytest.mark.parametrize("layer_bytes, l2, most, want", [
    (222_300_000, 52_428_800, 32_768_000, 12),  # CSM-1B's depth decoder on an H100: 18.5 MB kept
    (222_300_000, 62_914_560, 39_321_600, 10),  # with 60 MiB of L2 (an H200's)
    (222_300_000, 52_428_800, 10_000_000, 26),  # a small set-aside: k from it
    (1_000_000, 52_428_800, 32_768_000, 1),  # all of it fits: every stage kept
])
def test_auto_l2_keep_takes_a_share_of_l2_within_the_set_aside(layer_bytes: int, l2: int, most: int,
                                                               want: int) -> None:
    k = dsc.auto_l2_keep(layer_bytes, l2, most)
    assert k == want
    assert layer_bytes / k <= dsc.L2_KEEP_SHARE * l2 and dsc.keep_set_aside(layer_bytes, k) <= most
    assert k == 1 or layer_bytes / (k - 1) > dsc.L2_KEEP_SHARE * l2 or dsc.keep_set_aside(layer_bytes, k - 1) > most


@pytest.mark.gpu
def test_persisting_l2_is_set_aside_up_to_the_gpus_most() -> None:
    """persist_l2 sets aside what is asked, up to the GPU's most, and 0 gives it back."""
    if not dsc.available():
        pytest.skip("needs an sm_90 GPU and nvcc")
    dev = torch.device("cuda")
    most = dsc.persist_l2(dev, 1 << 40)
    assert 0 < most <= torch.cuda.get_device_properties(dev).L2_cache_size
    # (the runtime rounds up to its granule: an H100 set 9.8 MB for 8.2 MB asked, a tenth of its most)
    assert most // 4 <= dsc.persist_l2(dev, most // 4) <= most // 4 + most // 5
    assert dsc.persist_l2(dev, 0) == 0


def _model(seed: int = 0, with_f32: bool = False, cfg: TransformerConfig = CFG):  # noqa: ANN202
    """The bf16 ``cfg`` model on CUDA with its stack on (and, with_f32, the same weights in float32)."""
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
        for layer in model.layers:  # norms away from 1, so a missed norm weight shows
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
        model.norm.weight.uniform_(0.5, 1.5)
    m32 = copy.deepcopy(model).to("cuda") if with_f32 else None
    model = model.to("cuda", torch.bfloat16)
    model.fuse_projections()
    assert model.enable_decode_stack()
    if m32 is not None:
        m32.fuse_projections()
        return model, m32
    return model


_pairs: dict = {}


def _pair(cfg: TransformerConfig):  # noqa: ANN202
    """``_model(with_f32=True)`` once per config for the parametrized step test (its 27 cases
    only read the weights; each builds its own caches)."""
    key = (cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.max_seq_len)
    if key not in _pairs:
        _pairs[key] = _model(with_f32=True, cfg=cfg)
    return _pairs[key]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _prefilled(model: Transformer, prompt: int, slot: int, x: torch.Tensor | None = None):  # noqa: ANN202
    dt = model.layers[0].mlp.down_proj.weight.dtype
    cfg = model.cfg
    cache = KVCache(cfg, n_slots=3, max_seq_len=cfg.max_seq_len, device="cuda", dtype=dt)
    slots = torch.tensor([slot], device="cuda")
    if x is None:
        x = torch.randn(1, prompt, cfg.dim, device="cuda", dtype=torch.bfloat16)
    if prompt:
        with torch.no_grad():
            model(x.to(dt), torch.arange(prompt, device="cuda")[None], cache, slots)
    return cache, slots


@pytest.mark.gpu
@pytest.mark.parametrize("cfg, prompt", [(CFG, 0), (CFG, 1), (CFG, 31), (CFG, 32), (CFG, 70), (CFG, 190),
                                         (DEPTH, 0), (DEPTH, 5), (DEPTH, 40)])
@pytest.mark.parametrize("splits", [None, 1, 3, 12])
def test_cuda_stack_step_equals_the_layer_path(cfg: TransformerConfig, prompt: int, splits: int | None) -> None:
    """One step at several cache lengths (empty, one key, a 32-key block's edge, several blocks,
    near the end) and split counts (12: more splits than keys in most), for a Llama layout and
    the CSM depth decoder's (head dim 128), against the same step in float32: the output and the step's
    K/V rows are as close to it as the bf16 layer-by-layer kernels' are (other summation orders,
    same roundings), the other cache rows are untouched, and no poll timed out."""
    if not dsc.available():
        pytest.skip("needs an sm_90 GPU and nvcc")
    model, m32 = _pair(cfg)
    torch.manual_seed(prompt)  # the inputs, whichever case built the models
    w = model.stack
    xp = torch.randn(1, prompt, cfg.dim, device="cuda", dtype=torch.bfloat16)
    cache, slots = _prefilled(model, prompt, slot=1, x=xp)
    c32, _ = _prefilled(m32, prompt, slot=1, x=xp)
    x = torch.randn(1, cfg.dim, device="cuda", dtype=torch.bfloat16)
    pos = torch.tensor([prompt], device="cuda")
    cos, sin = model.rope_table(cache.max_seq_len, torch.bfloat16)
    k0, v0 = cache.k.clone(), cache.v.clone()
    saved = model.stack
    model.stack = None
    with torch.no_grad():
        ref = model._decode(x[:, None], pos, cache, slots)[:, 0]
        ref32 = m32._decode(x.float()[:, None], pos, c32, slots)[:, 0]
    model.stack = saved
    rk, rv = cache.k[:, 1, :, prompt].clone(), cache.v[:, 1, :, prompt].clone()
    k32, v32 = c32.k[:, 1, :, prompt], c32.v[:, 1, :, prompt]
    cache.k.copy_(k0)
    cache.v.copy_(v0)
    out = dsc.decode_stack_cuda(w, x, pos, cache.k, cache.v, slots, cos, sin, splits=splits)
    torch.cuda.synchronize()
    assert dsc.errors(w) == 0
    for got, layer, exact in ((out, ref, ref32), (cache.k[:, 1, :, prompt], rk, k32), (cache.v[:, 1, :, prompt], rv, v32)):
        assert _rel(got, exact) <= 1.25 * _rel(layer, exact) + 2e-3, (_rel(got, exact), _rel(layer, exact))
        assert _rel(got, layer) < 3e-2
    mask = torch.ones_like(cache.k, dtype=torch.bool)
    mask[:, 1, :, prompt] = False
    assert torch.equal(cache.k[mask], k0[mask]) and torch.equal(cache.v[mask], v0[mask])


@pytest.mark.gpu
@pytest.mark.parametrize("settings", [
    dict(balance=0, inflight=1), dict(balance=80), dict(balance=300, inflight=0), dict(inflight=1),
    dict(inflight=0), dict(balance=80, inflight=3), dict(backoff=500), dict(backoff=50, balance=40),
    dict(keep=1), dict(keep=3, inflight=4), dict(keep=-1), dict(keep=0),
    dict(ahead=0), dict(ahead=4), dict(ahead=64, inflight=1), dict(ahead=8, keep=3),
    dict(burst=4), dict(burst=0), dict(burst=3, inflight=1), dict(burst=6, ahead=0),
    # a burst past the ring (every stage in flight while the consumers are close), then 2 again: the
    # producer's wait for landed copies must not fall more than the ring behind
    dict(burst=64)], ids=repr)  # (default: keep -1, ahead 12, burst 3)
def test_row_balance_and_copies_in_flight_keep_the_step_bit_for_bit(settings: dict) -> None:
    """Which SM computes a row, how many weight copies fly at once, how long a poll backs off and
    which copies L2 keeps or is asked for ahead change nothing in a row's arithmetic: the step
    equals the default's bit for bit (output and caches)."""
    if not dsc.available():
        pytest.skip("needs an sm_90 GPU and nvcc")
    _same_as_the_default_step(**settings)


def _same_as_the_default_step(**kw) -> Transformer:  # noqa: ANN003
    """The 3-layer model's step at position 70 with the launch's defaults, then again from the same
    caches with ``kw``: the two equal bit for bit (output and caches). Returns the model."""
    model = _model(3)
    cache, slots = _prefilled(model, 70, slot=0)
    x = torch.randn(1, CFG.dim, device="cuda", dtype=torch.bfloat16)
    pos = torch.tensor([70], device="cuda")
    cos, sin = model.rope_table(cache.max_seq_len, torch.bfloat16)
    k0, v0 = cache.k.clone(), cache.v.clone()
    want = dsc.decode_stack_cuda(model.stack, x, pos, cache.k, cache.v, slots, cos, sin)
    wk, wv = cache.k.clone(), cache.v.clone()
    cache.k.copy_(k0)
    cache.v.copy_(v0)
    got = dsc.decode_stack_cuda(model.stack, x, pos, cache.k, cache.v, slots, cos, sin, **kw)
    torch.cuda.synchronize()
    assert dsc.errors(model.stack) == 0
    assert torch.equal(got, want) and torch.equal(cache.k, wk) and torch.equal(cache.v, wv)
    return model


@pytest.mark.gpu
def test_traced_step_is_the_step_and_its_timeline_is_ordered() -> None:
    """A probe's traced step (stats and a timeline, the timed build) gives the step's output and
    caches bit for bit, and its timeline is in order: every copy issued after the producer had room
    for it, in stage order; every stage had after it was asked for; the SM's events inside its start
    and end; the trace's stages an SM as many as the weight schedule walks."""
    if not dsc.available():
        pytest.skip("needs an sm_90 GPU and nvcc")
    p = torch.cuda.get_device_properties(0).multi_processor_count
    nl = CFG.n_layers
    stats = torch.zeros(p, dsc.STATS, dtype=torch.int64, device="cuda")
    trace = torch.zeros(p, dsc.trace_width(nl, 4096), dtype=torch.int64, device="cuda")
    assert _same_as_the_default_step(stats=stats, trace=trace).stack.qkv.shape[0] == nl
    t = trace.cpu()
    ts = 4096
    room, issue, ask, have = t[:, :ts], t[:, ts:2 * ts], t[:, 2 * ts:3 * ts], t[:, 3 * ts:4 * ts]
    cal = t[:, -4:]
    assert bool((cal[:, 2] > cal[:, 0]).all() and (cal[:, 3] > cal[:, 1]).all())
    for s in range(p):
        n = int((issue[s] > 0).sum())
        assert n == int(stats[s, 11])  # every stage the consumers counted was issued and traced
        if n == 0:  # (an SM with no rows of any weight: ceil(N / SMs) rows each leave the last SMs none)
            continue
        assert bool((issue[s, :n] >= room[s, :n]).all()) and bool((issue[s, 1:n] >= issue[s, : n - 1]).all())
        assert bool((have[s, :n] >= ask[s, :n]).all()) and bool((ask[s, 1:n] >= have[s, : n - 1]).all())
        ev = t[s, 4 * ts: -4].reshape(nl, len(dsc.TRACE_EVENTS), 2)[..., 0]
        stamped = ev[ev > 0]
        assert bool((stamped >= cal[s, 0]).all() and (stamped <= cal[s, 2]).all())
        assert int(ev[:, 8].gt(0).sum()) == nl  # every SM with rows puts its residual rows' end every layer
    assert int((t[:, ts:2 * ts] > 0).any(1).sum()) >= p // 2


def test_every_sm_attends_where_the_heads_fit() -> None:
    """Every SM attends to all the heads itself (no hand-over of the heads) for the CSM depth
    decoder's layout at its short caches, not for a Llama layout or a long cache."""
    assert dsc.every_fits(8, 2, 128, 32) and dsc.every_fits(8, 2, 128, 64)  # the depth decoder
    assert not dsc.every_fits(8, 2, 128, 65)  # past two blocks of keys
    assert not dsc.every_fits(32, 8, 64, 32)  # Llama-3.2-1B: 32 query heads
    assert not dsc.every_fits(8, 4, 128, 32)  # 512 v values: two a thread
    assert dsc.every_fits(8, 4, 64, 48) and not dsc.every_fits(8, 8, 64, 48)  # 256 v values, then 512
    # the launcher's default: where it fits and with one split (or the default), unless switched off
    assert dsc.every_default(8, 2, 128, 32) == dsc.EVERY == dsc.every_default(8, 2, 128, 32, splits=1)
    assert not dsc.every_default(8, 2, 128, 32, splits=2) and not dsc.every_default(32, 8, 64, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("prompt", [0, 5, 31, 32, 40])
def test_every_sm_attending_is_the_items_step(prompt: int) -> None:
    """Every SM attending to all the heads gives the step of the attention items with one split
    (the heads handed over) bit for bit: the same sums in the same order, the heads rounded to
    bf16 as the hand-over's words are. Output and caches; with the gather, the head and the
    sampled token too; each twice (a race would show as two runs that differ); empty cache, one
    block, a block's edge and two blocks."""
    if not dsc.available():
        pytest.skip("needs an sm_90 GPU and nvcc")
    w, cache, slots, pos, cos, sin, table, head, (k0, v0) = _gather_case(DEPTH, prompt, 64, 2051, 0.1)
    x = table[3:4].contiguous()
    dev = "cuda"
    rows = (torch.tensor([0.9], device=dev), torch.tensor([50], device=dev), torch.tensor([11], device=dev),
            torch.tensor([prompt], device=dev))
    got = {}
    for run, every in ((0, False), (0, True), (1, True), (1, False)):
        cache.k.copy_(k0)
        cache.v.copy_(v0)
        out = dsc.decode_stack_cuda(w, x, pos, cache.k, cache.v, slots, cos, sin, splits=1, every=every)
        ks, vs = cache.k.clone(), cache.v.clone()
        cache.k.copy_(k0)
        cache.v.copy_(v0)
        _, logits, tok = dsc.decode_stack_cuda(w, table, pos, cache.k, cache.v, slots, cos, sin, splits=1,
                                               every=every, x_index=torch.tensor([3], device=dev), head=head,
                                               sample=(*rows, 0))
        torch.cuda.synchronize()
        assert dsc.errors(w) == 0, (run, every)
        got[run, every] = dict(out=out, k=ks, v=vs, logits=logits, token=int(tok))
    assert not torch.equal(got[0, True]["k"], k0)  # the step wrote its key
    for a, b in (((0, True), (1, True)), ((0, False), (1, False)), ((0, False), (0, True))):
        for name, va in got[a].items():
            vb = got[b][name]
            same = va == vb if name == "token" else torch.equal(va, vb)
            assert same, (a, b, name, va if name == "token" else _rel(va, vb), vb if name == "token" else "")


def test_head_chunks_fit_the_partial_sums() -> None:
    """A head's rows go through the kernel in chunks whose partial sums fit kMaxParts (1024
    floats): the most rows any SM has, over the rows a chunk (whole 16 KB stages)."""
    assert dsc.head_chunks(0, 2048, 132, 72, -1) == 0  # no head
    assert dsc.head_chunks(2051, 1024, 132, 2, -1) == 1  # a CSM codebook head: 16 rows an SM
    assert dsc.head_chunks(128256, 2048, 132, 72, -1) == 2  # Llama-3.2-1B's LM head: 972 rows, 512 a chunk
    assert dsc.head_chunks(140001, 1024, 132, 8, -1) == 2  # 1062 rows, 1024 a chunk
    assert dsc.head_chunks(4096, 8192, 132, 8, 80) == 1  # 8192 wide: 1 row a stage, 128 a chunk


def _engine_model(monkeypatch, seed: int) -> Transformer:  # noqa: ANN001
    """``_model(seed)`` as the engines load it with REALTIME_STACK_KERNEL=cuda: its one-row steps
    take the CUDA stack (skips without an sm_90 GPU and nvcc)."""
    if not dsc.available():
        pytest.skip("needs an sm_90 GPU and nvcc")
    import realtime.engines.transformer as tr

    monkeypatch.setattr(tr, "_STACK_KERNEL", "cuda")
    model = _model(seed)
    assert model.stack_cuda
    return model


def _gather_case(cfg: TransformerConfig, prompt: int, rows: int, vocab: int, scale: float):  # noqa: ANN202
    """A one-row step of ``cfg``'s stack at position ``prompt`` with a table of ``rows`` input rows
    and a head of ``vocab`` rows (weights of ``scale``): (stack, cache, slots, pos, cos, sin,
    table, head, and the caches' contents to restore)."""
    model = _pair(cfg)[0]
    cache, slots = _prefilled(model, prompt, slot=2)
    pos = torch.tensor([prompt], device="cuda")
    cos, sin = model.rope_table(cache.max_seq_len, torch.bfloat16)
    table = torch.randn(rows, cfg.dim, device="cuda", dtype=torch.bfloat16)
    head = (torch.randn(vocab, cfg.dim, device="cuda") * scale).to(torch.bfloat16)
    return model.stack, cache, slots, pos, cos, sin, table, head, (cache.k.clone(), cache.v.clone())


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [CFG, DEPTH], ids=["llama", "depth"])
@pytest.mark.parametrize("vocab", [2051, 140001])
def test_table_row_and_head_in_the_same_kernel(cfg: TransformerConfig, vocab: int) -> None:
    """x_index: the kernel gathers its input row from a table (at the index plus an offset,
    clamped into the table), and the step is the one of that row passed in, bit for bit (output
    and caches). head: the logits of the final-norm output, within the bf16 rounding of a product
    of it (140001 rows: two chunks of rows on every SM, an odd count: the last SM's rows odd)."""
    if not dsc.available():
        pytest.skip("needs an sm_90 GPU and nvcc")
    w, cache, slots, pos, cos, sin, table, head, (k0, v0) = _gather_case(cfg, 21, 300, vocab, 0.05)
    for idx, off, row in ((7, 3, 10), (0, 0, 0), (295, 40, 299), (-50, 0, 0)):
        cache.k.copy_(k0)
        cache.v.copy_(v0)
        want = dsc.decode_stack_cuda(w, table[row:row + 1].contiguous(), pos, cache.k, cache.v, slots, cos, sin)
        wk, wv = cache.k.clone(), cache.v.clone()
        cache.k.copy_(k0)
        cache.v.copy_(v0)
        index = torch.tensor([idx], device="cuda")
        out, logits = dsc.decode_stack_cuda(w, table, pos, cache.k, cache.v, slots, cos, sin, x_index=index,
                                            x_offset=off, head=head)
        torch.cuda.synchronize()
        assert dsc.errors(w) == 0
        assert torch.equal(out, want) and torch.equal(cache.k, wk) and torch.equal(cache.v, wv), (idx, off)
        ref = (out.float() @ head.float().t()).to(torch.bfloat16)
        assert logits.shape == (1, vocab) and logits.dtype == torch.bfloat16
        assert _rel(logits, ref) < 1e-2, _rel(logits, ref)
        assert (logits.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()
    plain = dsc.decode_stack_cuda(w, table[:1].contiguous(), pos, cache.k, cache.v, slots, cos, sin)
    assert isinstance(plain, torch.Tensor)  # no head: the output alone, as before


@pytest.mark.gpu
@pytest.mark.parametrize("temp, top_k", [(0.0, 0), (0.9, 50), (1.0, 0), (0.7, 1), (1.3, 7), (1.1, 2051), (0.5, 2050)])
def test_token_sampled_in_the_kernel_is_the_samplers(temp: float, top_k: int) -> None:
    """The token the last SM samples from the kernel's own logits is the one kernels/sampling.py
    samples from them (greedy; top-k on, off, of one, of all but one; Gumbel noise of the seed and
    the step plus step_add), over several seeds and steps: bf16 logits of a 2051-row head repeat
    values, so ties at the top-k threshold occur."""
    if not dsc.available():
        pytest.skip("needs an sm_90 GPU and nvcc")
    from realtime.kernels.sampling import sample

    w, cache, slots, pos, cos, sin, table, head, (k0, v0) = _gather_case(DEPTH, 9, 64, 2051, 0.1)
    dev = "cuda"
    for i, (seed, step, add) in enumerate(((0, 0, 0), (7, 31, 5), (-3, 2**33 + 1, 30), (123456789012, 4, 1))):
        rows = (torch.tensor([temp], device=dev), torch.tensor([top_k], device=dev), torch.tensor([seed], device=dev),
                torch.tensor([step], device=dev))
        cache.k.copy_(k0)
        cache.v.copy_(v0)
        token = torch.full((1,), -1, dtype=torch.long, device=dev)
        out, logits, tok = dsc.decode_stack_cuda(w, table, pos, cache.k, cache.v, slots, cos, sin,
                                                 x_index=torch.tensor([i], device=dev), head=head,
                                                 sample=(*rows, add), token=token)
        want = sample(logits, rows[0], rows[1], rows[2], rows[3] + add)
        torch.cuda.synchronize()
        assert tok is token and dsc.errors(w) == 0
        assert int(token) == int(want), (seed, step, add, int(token), int(want))
        if i == 0:  # the logits the sampling SM polled and handed back are the head's own
            cache.k.copy_(k0)
            cache.v.copy_(v0)
            _, plain = dsc.decode_stack_cuda(w, table, pos, cache.k, cache.v, slots, cos, sin,
                                             x_index=torch.tensor([i], device=dev), head=head)
            assert torch.equal(logits, plain)


@pytest.mark.gpu
def test_sampled_heads_of_other_sizes_on_one_stack() -> None:
    """The sampling SM polls the head's rows in a buffer of the stack's that it sets back to
    "not written" after each step: heads of different sizes sampled one after another on the same
    stack (larger, smaller, odd, larger again) each give the head's logits and the sampler's token,
    with no poll timing out on rows past a smaller head's end."""
    if not dsc.available():
        pytest.skip("needs an sm_90 GPU and nvcc")
    from realtime.kernels.sampling import sample

    w, cache, slots, pos, cos, sin, table, head, (k0, v0) = _gather_case(DEPTH, 9, 64, 3001, 0.1)
    dev = "cuda"
    rows = (torch.tensor([0.8], device=dev), torch.tensor([20], device=dev), torch.tensor([5], device=dev),
            torch.tensor([2], device=dev))
    for v in (3001, 2051, 1, 2045, dsc.MAX_SAMPLE_V, 3001):
        hd = head[:v] if v <= head.shape[0] else torch.cat([head] * 2)[:v].contiguous()
        for sampled in (True, False):
            cache.k.copy_(k0)
            cache.v.copy_(v0)
            res = dsc.decode_stack_cuda(w, table, pos, cache.k, cache.v, slots, cos, sin,
                                        x_index=torch.tensor([3], device=dev), head=hd,
                                        sample=(*rows, 0) if sampled else None)
            if sampled:
                _, logits, tok = res
            else:
                assert torch.equal(res[1], logits), v
        torch.cuda.synchronize()
        assert dsc.errors(w) == 0, v
        assert int(tok) == int(sample(logits, *rows)), v


@pytest.mark.gpu
def test_decode_row_fused_is_the_engine_step_with_its_gather_and_head(monkeypatch) -> None:
    """Transformer.decode_row_fused (the text engine's and CSM's depth passes' one kernel): the
    final-norm output equals the engine's CUDA-stack step on the gathered row bit for bit, the
    logits are that output's product with the head within bf16 rounding, in a CUDA graph too; it
    declines (None) where the CUDA stack does not take the step."""
    model = _engine_model(monkeypatch, 4)
    cache, slots = _prefilled(model, 33, slot=1)
    table = torch.randn(64, CFG.dim, device="cuda", dtype=torch.bfloat16)
    head = (torch.randn(3001, CFG.dim, device="cuda") * 0.05).to(torch.bfloat16)
    index = torch.tensor([5], device="cuda")
    pos = torch.tensor([33], device="cuda")
    k0, v0 = cache.k.clone(), cache.v.clone()
    with torch.no_grad():
        want = model._decode(table[9:10][:, None], pos, cache, slots)[:, 0]
    cache.k.copy_(k0)
    cache.v.copy_(v0)
    h, logits, none = model.decode_row_fused(table, index, pos, cache, slots, head, offset=4)
    assert none is None
    assert torch.equal(h, want)
    ref = (h.float() @ head.float().t()).to(torch.bfloat16)
    assert _rel(logits, ref) < 1e-2
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gh, glog, _ = model.decode_row_fused(table, index, pos, cache, slots, head, offset=4)
    cache.k.copy_(k0)
    cache.v.copy_(v0)
    index.fill_(2)  # row 6 now
    g.replay()
    torch.cuda.synchronize()
    cache.k.copy_(k0)
    cache.v.copy_(v0)
    with torch.no_grad():
        want6 = model._decode(table[6:7][:, None], pos, cache, slots)[:, 0]
    assert torch.equal(gh, want6) and _rel(glog, (want6.float() @ head.float().t()).to(torch.bfloat16)) < 1e-2
    assert model.decode_row_fused(table.float(), index, pos, cache, slots, head) is None  # not the stack's dtype
    assert model.decode_row_fused(table, index.repeat(2), pos.repeat(2), cache, slots.repeat(2), head) is None
    assert dsc.errors(model.stack) == 0


@pytest.mark.gpu
def test_cuda_stack_decodes_like_the_layer_path_over_steps_and_in_a_graph() -> None:
    """Twenty steps through the engine with the CUDA stack (REALTIME_STACK_KERNEL=cuda's path),
    replayed from a CUDA graph, against the layer path's steps: each step's output within bf16
    rounding, the stage ring at its smallest (2 stages: the producer waits on every stage) gives
    the same step as the default ring, bit for bit."""
    if not dsc.available():
        pytest.skip("needs an sm_90 GPU and nvcc")
    model = _model(1)
    w = model.stack
    n = 20
    xs = torch.randn(n, 1, CFG.dim, device="cuda", dtype=torch.bfloat16)
    cos, sin = model.rope_table(CFG.max_seq_len, torch.bfloat16)
    cache_ref, slots = _prefilled(model, 40, slot=2)
    cache = KVCache(CFG, n_slots=3, max_seq_len=CFG.max_seq_len, device="cuda", dtype=torch.bfloat16)
    cache.k.copy_(cache_ref.k)
    cache.v.copy_(cache_ref.v)
    saved = model.stack
    model.stack = None
    refs = []
    with torch.no_grad():
        for i in range(n):
            refs.append(model._decode(xs[i][:, None], torch.tensor([40 + i], device="cuda"), cache_ref, slots)[:, 0])
    model.stack = saved
    x_in = torch.empty(1, CFG.dim, device="cuda", dtype=torch.bfloat16)
    pos = torch.zeros(1, dtype=torch.long, device="cuda")
    x_in.copy_(xs[0])
    pos.fill_(40)
    first = dsc.decode_stack_cuda(w, x_in, pos, cache.k, cache.v, slots, cos, sin)  # warm-up: builds, allocates
    two = dsc.decode_stack_cuda(w, x_in, pos, cache.k.clone(), cache.v.clone(), slots, cos, sin, stages=2)
    torch.cuda.synchronize()
    assert torch.equal(first, two)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = dsc.decode_stack_cuda(w, x_in, pos, cache.k, cache.v, slots, cos, sin)
    for i in range(n):
        x_in.copy_(xs[i])
        pos.fill_(40 + i)
        g.replay()
        assert _rel(out, refs[i]) < 2e-2, (i, _rel(out, refs[i]))
    torch.cuda.synchronize()
    assert dsc.errors(w) == 0
    assert _rel(cache.k[:, 2, :, 40:40 + n], cache_ref.k[:, 2, :, 40:40 + n]) < 2e-2


@pytest.mark.gpu
def test_engine_takes_the_cuda_stack_when_asked(monkeypatch) -> None:
    """REALTIME_STACK_KERNEL=cuda: ``enable_decode_stack`` turns the CUDA stack on for a bf16 model
    of widths it takes, and the engine's one-row step is then the CUDA kernel's (bit for bit);
    rows beyond one keep the Triton stack."""
    model = _engine_model(monkeypatch, 2)
    cache, slots = _prefilled(model, 50, slot=0)
    x = torch.randn(1, 1, CFG.dim, device="cuda", dtype=torch.bfloat16)
    pos = torch.tensor([50], device="cuda")
    cos, sin = model.rope_table(cache.max_seq_len, torch.bfloat16)
    k0, v0 = cache.k.clone(), cache.v.clone()
    calls: list = []
    monkeypatch.setattr(dsc, "decode_stack_cuda", lambda *a, f=dsc.decode_stack_cuda, **kw: calls.append(1) or f(*a, **kw))
    with torch.no_grad():
        got = model._decode(x, pos, cache, slots)[:, 0]
    assert calls == [1]
    cache.k.copy_(k0)
    cache.v.copy_(v0)
    want = dsc.decode_stack_cuda(model.stack, x[:, 0].contiguous(), pos, cache.k, cache.v, slots, cos, sin)
    assert torch.equal(got, want)
    m32 = Transformer(CFG).eval().to("cuda")
    m32.fuse_projections()
    assert m32.enable_decode_stack() and not m32.stack_cuda  # float32: Triton's stack


def test_unknown_stack_kernel_is_refused_at_import() -> None:
    """REALTIME_STACK_KERNEL takes triton or cuda; anything else stops the import with the reason."""
    import os
    import sys

    env = {**os.environ, "REALTIME_STACK_KERNEL": "cutlass"}
    res = subprocess.run([sys.executable, "-c", "import realtime.engines.transformer"], env=env, capture_output=True,
                         text=True)
    assert res.returncode != 0
    assert "REALTIME_STACK_KERNEL must be triton or cuda, got 'cutlass'" in res.stderr


def test_stack_ab_reads_settings_and_plots_recorded_runs(tmp_path) -> None:
    """bench/stack_ab.py: a setting that is not KEEP:INFLIGHT[:BACKBONE][@AHEAD][+BURST][~BACKOFF] is refused by name; a
    recorded run is plotted (a bar a setting), with no GPU."""
    script = Path(__file__).resolve().parents[2] / "bench" / "stack_ab.py"
    res = subprocess.run([sys.executable, str(script), "csm", "--settings", "12:2", "3:x"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "KEEP:INFLIGHT[:BACKBONE]" in res.stderr and "'3:x'" in res.stderr
    res = subprocess.run([sys.executable, str(script), "text", "--settings", "0:2", "-1:2@x"], capture_output=True,
                         text=True, timeout=120)  # (a negative KEEP is a setting, not an option)
    assert res.returncode == 2 and "AHEAD (after @) is a count" in res.stderr
    res = subprocess.run([sys.executable, str(script), "text", "--settings", "-1:2@4+x"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "BURST (after +) is a count" in res.stderr
    res = subprocess.run([sys.executable, str(script), "csm", "--settings", "auto:2+0/x"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "DEPTH/BACKBONE" in res.stderr
    res = subprocess.run([sys.executable, str(script), "csm", "--settings", "auto:2~200/0", "auto:2~x"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "BACKOFF (after ~) is ns" in res.stderr
    res = subprocess.run([sys.executable, str(script), "text", "--settings", "-1:2~200+3~0"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "one ~BACKOFF at most" in res.stderr
    rows = [{"keep": k, "inflight": 2, "backbone_keep": -1 if k else 0, "frames_per_s": f} for k, f in
            ((0, 192.9), (12, 198.2), (0, 192.4), (12, 198.1), (-1, 196.7))] + [
        {"keep": 12, "inflight": 2, "ahead": 8, "backbone_keep": -1, "frames_per_s": 199.0},
        {"keep": 12, "inflight": 2, "ahead": 4, "burst": 4, "backbone_keep": -1, "frames_per_s": 199.5},
        {"keep": 12, "inflight": 2, "backoff": 200, "backbone_backoff": 0, "backbone_keep": -1, "frames_per_s": 200.5}]
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"part": "csm", "gpu": "a GPU", "rows": rows}))
    png = tmp_path / "ab.png"
    res = subprocess.run([sys.executable, str(script), "--from-json", str(run), "--plot", str(png)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-400:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_stack_ab_best_names_the_variables_of_a_runs_best_setting(tmp_path) -> None:
    """bench/stack_ab.py --best: the variables that put every stack at a recorded run's best setting
    (median of its rows), the first setting the reference; a run whose settings changed a result,
    and a best setting that no variable can express, are refused by name."""
    script = Path(__file__).resolve().parents[2] / "bench" / "stack_ab.py"

    def best(part: str, rows: list[dict]) -> subprocess.CompletedProcess:
        run = tmp_path / f"{part}.json"
        run.write_text(json.dumps({"part": part, "gpu": "a GPU", "rows": rows}))
        return subprocess.run([sys.executable, str(script), "--best", str(run)], capture_output=True, text=True,
                              timeout=120)

    def text(inflight: int, burst: int, tok: float, keep: int = -1, same: bool = True) -> dict:
        return {"keep": keep, "inflight": inflight, "ahead": None, "burst": burst, "backoff": 0, "graph_tok_s": tok,
                "pipelined_tok_s": tok + 20, "same_tokens": True, "same_tokens_pipelined": same}

    # 3 in flight wins on its median (one fast outlier of 2+3 does not), burst as the reference's
    rows = [text(2, 3, 1000), text(3, 3, 1040), text(2, 3, 1100), text(3, 3, 1041), text(2, 3, 1001), text(3, 3, 1039)]
    res = best("text", rows)
    assert res.returncode == 0 and res.stdout.split() == ["REALTIME_STACK_INFLIGHT=3"], res.stderr
    res = best("text", rows + [text(2, 0, 1060), text(2, 0, 1061)])
    assert res.stdout.split() == ["REALTIME_STACK_INFLIGHT=2", "REALTIME_STACK_BURST=0"], res.stderr
    res = best("text", rows + [text(2, 3, 1200, keep=0)])
    assert res.stdout.split() == ["REALTIME_STACK_INFLIGHT=2", "REALTIME_STACK_L2_KEEP=0"], res.stderr
    res = best("text", rows + [text(2, 3, 1200, keep=4)])
    assert res.returncode == 1 and "keep (4) is not one variable's value" in res.stderr
    res = best("text", rows + [text(2, 0, 900, same=False)])
    assert res.returncode == 1 and "changed the results" in res.stderr and not res.stdout

    def csm(burst: tuple, backoff: tuple, fps: float, keep: int = 12) -> dict:
        return {"keep": keep, "inflight": 2, "ahead": None, "burst": burst[0], "backbone_burst": burst[1],
                "backoff": backoff[0], "backbone_backoff": backoff[1], "backbone_keep": -1 if keep else 0,
                "frames_per_s": fps, "same_codes": True}

    ref = [csm((0, 0), (200, 0), 202.0), csm((0, 0), (200, 0), 202.4)]
    res = best("csm", ref + [csm((3, 3), (200, 0), 205.0), csm((0, 0), (200, 0), 202.2, keep=8)])
    assert res.stdout.split() == ["REALTIME_STACK_INFLIGHT=2", "REALTIME_STACK_BURST=3"], res.stderr
    res = best("csm", ref + [csm((0, 0), (200, 0), 203.0, keep=8)])
    assert res.stdout.split() == ["REALTIME_STACK_INFLIGHT=2", "REALTIME_STACK_L2_KEEP=8"], res.stderr
    res = best("csm", ref + [csm((0, 3), (200, 0), 205.0)])  # the backbone's own burst: a pair
    assert res.returncode == 1 and "burst (0) is not one variable's value" in res.stderr
    res = best("csm", ref + [csm((0, 0), (400, 0), 205.0)])  # REALTIME_STACK_BACKOFF=400 would set the backbone's too
    assert res.returncode == 1 and "backoff (400)" in res.stderr
    res = subprocess.run([sys.executable, str(script), "--best", str(tmp_path / "none.json")], capture_output=True,
                         text=True, timeout=120)  # (a scan that wrote nothing)
    assert res.returncode == 2 and "cannot read a recorded run" in res.stderr and "Traceback" not in res.stderr


def _synthetic_trace(off3: int = 50_000) -> torch.Tensor:
    """A made-up timeline of 4 SMs, 2 layers, 8 stages (bench/stack_timeline.py's layout): SMs 0 and 1
    attend (kv head 0, splits 0 and 1), 1 cycle a ns, SM 3's clock ``off3`` cycles ahead of the
    global timer; one stall of the ring, SM 2's stage 3, 500 cycles inside layer 0's attention chain."""
    nl, ts, ne = 2, 8, 11
    t = torch.zeros(4, 4 * ts + 2 * nl * ne + 4, dtype=torch.int64)
    heads_read = {0: 3000, 1: 3200, 2: 3300, 3: 3700}  # o's input polled, after the layer's start
    for s in range(4):
        off = off3 if s == 3 else 0
        row = t[s]
        for g in range(6):
            issue = 1000 + 200 * g + (1400 if s == 2 and g >= 3 else 0)  # (SM 2's stage 3 at 3000)
            row[ts + g] = issue + off
            row[g] = (issue - (500 if s == 2 and g == 3 else 0)) + off  # room
            row[2 * ts + g] = 1100 + 250 * g + off
            row[3 * ts + g] = 1110 + 250 * g + off
        for l in range(nl):
            at = {0: 100, 1: 1000, 3: heads_read[s], 4: 3500, 5: 4000, 6: 7000, 7: 7500, 8: 9500}
            if s < 2:
                at.update({9: 1500, 2: 2000 if s == 0 else 1900})
            if s == 0:
                at[10] = 1800
            for e, v in at.items():
                c = 1000 + l * 10_000 + v
                row[4 * ts + 2 * (l * ne + e)] = c + off
                row[4 * ts + 2 * (l * ne + e) + 1] = c
        row[-4:] = torch.tensor([1000 + off, 1000, 21_000 + off, 21_000])
    return t


def test_stack_timeline_sums_a_known_trace(tmp_path) -> None:
    """bench/stack_timeline.py on a made-up trace: the ring's stall is found and put in the
    attention's chain, the heads' hand-over latency is the readers' after the last writer on the
    global timer (an SM whose clock is offset agrees), and the script reads a saved trace and plots it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import stack_timeline as st

    s = st.summarize(_synthetic_trace(), n_layers=2, stages=8, items=2, splits=2, ring=4)
    assert s["clock_hz"] == pytest.approx(1e9)
    assert s["mean"]["ring_full_us"] == pytest.approx(0.5 / 4)
    by = s["ring_full_us_by_segment"]
    assert by["attention chain, to the heads"] == pytest.approx(0.5 / 4)
    assert sum(by.values()) == pytest.approx(0.5 / 4)
    assert s["worst_ring_full"]["sm"] == 2
    h = s["handovers"]["heads -> o"]
    assert h["readers_median_us"] == pytest.approx(1.2) and h["readers_slowest_us"] == pytest.approx(1.7)
    assert h["writers_spread_us"] == pytest.approx(0.0)
    p = s["handovers"]["partials -> split 0"]  # split 1 done at 1900, split 0 polled them at 1800 + ...
    assert p["readers_median_us"] == pytest.approx(-0.1)
    assert s["segment_us_a_layer"]["gate|up stages"] == pytest.approx(3.0)
    # the same with SM 3's clock not offset: the global timer's view does not change
    again = st.summarize(_synthetic_trace(0), n_layers=2, stages=8, items=2, splits=2, ring=4)["handovers"]
    assert again.keys() == s["handovers"].keys()
    for k, v in again.items():
        assert v == pytest.approx(s["handovers"][k]), k
    f = tmp_path / "run.trace.pt"
    torch.save(dict(trace=_synthetic_trace(), n_layers=2, stages=8, items=2, splits=2, ring=4, device="made up",
                    commit="x"), f)
    script = Path(__file__).resolve().parents[2] / "bench" / "stack_timeline.py"
    res = subprocess.run([sys.executable, str(script), str(f), "--plot", str(tmp_path / "t.png"), "--layers", "0", "1"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "heads -> o" in res.stdout and (tmp_path / "t.png").stat().st_size > 10_000
