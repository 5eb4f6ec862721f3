"""L2 prefetch (kernels/prefetch.py): a hint that must change no value.

On the CPU: the switch's parsing, that nothing is issued off CUDA, and that the kernel compiles
for sm90 with its bulk-prefetch instruction (Triton's bundled ptxas, no GPU needed; the
interpreter cannot run inline PTX). On the GPU: odd sizes and budgets launch and report the bytes
they asked for, and a decode step with prefetches (eager and graphed) equals one without, bit
for bit, with the prefetch kernels really in the step.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from realtime.kernels import prefetch
from realtime.kernels.prefetch import Prefetcher, l2_prefetch, use_l2_prefetch


@pytest.fixture
def budget():
    """Restore the process-wide budget after a test changes it."""
    before, config = use_l2_prefetch(), prefetch._config
    yield use_l2_prefetch
    use_l2_prefetch(before)
    prefetch._config = config


@pytest.mark.parametrize("raw, mb", [("0", 0), ("", 0), ("off", 0), ("1", 32), ("on", 32), ("24", 24)])
def test_switch_parsing(monkeypatch, raw, mb):
    monkeypatch.setenv("REALTIME_L2_PREFETCH", raw)
    assert prefetch._env_mb() == mb


def test_switch_rejects_garbage(monkeypatch, budget):
    monkeypatch.setenv("REALTIME_L2_PREFETCH", "lots")
    with pytest.raises(ValueError, match="REALTIME_L2_PREFETCH"):
        prefetch._env_mb()
    with pytest.raises(ValueError, match=">= 0"):
        budget(-1)


def test_nothing_is_issued_off_cuda(budget):
    budget(8)
    w = torch.randn(64, 64)
    assert not prefetch.supported(w)
    assert l2_prefetch(w) == 0
    assert Prefetcher.for_step(w) is None
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch(w.t())


_AOT = r"""
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from realtime.kernels import prefetch

fn = prefetch._kernel()
sig = {"base_ptr": "*u8", "nbytes": "i64", "sink_ptr": "*i32", "MODE": "constexpr", "CHUNK": "constexpr",
       "BLOCK": "constexpr"}
want = {"bulk": "cp.async.bulk.prefetch.L2.global", "line": "prefetch.global.L2", "load": "ld.global"}
for name, (mode, chunk, block, warps) in prefetch.CONFIGS.items():
    m = ("bulk", "line", "load").index(mode)
    src = ASTSource(fn, sig, constexprs={(3,): m, (4,): chunk, (5,): chunk // 4 if mode == "load" else block})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert k.asm["cubin"], name
    assert want[mode] in k.asm["ptx"], f"{name}: {want[mode]} is missing"
print("compiled")
"""


def test_prefetch_kernel_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a cold cache: really compile
    r = subprocess.run([sys.executable, "-c", _AOT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]


# ---------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("config", sorted(prefetch.CONFIGS))
def test_gpu_prefetch_sizes(config):
    dev = torch.device("cuda")
    cfg = prefetch.CONFIGS[config]
    for nbytes, cap in [(16, None), (17, None), (48, 20), (16384, None), (16400, None), ((3 << 20) + 40, None),
                        (34 << 20, 24 << 20), (15, None)]:
        t = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
        before = t.clone()
        want = min(nbytes, cap if cap is not None else nbytes) // 16 * 16
        assert l2_prefetch(t, cap, cfg) == want
        torch.cuda.synchronize()
        assert torch.equal(t, before)
    w = torch.randn(1000, 37, dtype=torch.bfloat16, device=dev)  # 74,000 bytes: a tail of 16 + 4
    assert l2_prefetch(w, None, cfg) == 74000 // 16 * 16
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("config", sorted(prefetch.CONFIGS))
def test_gpu_decode_with_prefetch_equals_without(budget, config):
    from torch.profiler import ProfilerActivity, profile

    from realtime.cuda_graphs import capture
    from realtime.engines.transformer import KVCache, Transformer, TransformerConfig

    dev = torch.device("cuda")
    torch.manual_seed(0)
    cfg = TransformerConfig(dim=512, n_layers=3, n_heads=8, n_kv_heads=2, head_dim=64, intermediate_size=1536)
    model = Transformer(cfg).to(dev, torch.bfloat16)
    model.prefetch_wrap = True
    model.fuse_projections()
    slots = torch.tensor([2, 0], device=dev)
    x = torch.randn(2, 1, 512, device=dev, dtype=torch.bfloat16)
    pos = torch.tensor([[9], [4]], device=dev)

    def fresh_cache() -> KVCache:
        c = KVCache(cfg, 3, 64, device=dev, dtype=torch.bfloat16)
        g = torch.Generator(device=dev).manual_seed(1)
        c.k.normal_(generator=g)
        c.v.normal_(generator=g)
        return c

    outs = {}
    budget(config=config)
    with torch.no_grad():
        for mb in (0, 1, 64):  # off, a budget that cuts o|gate_up short, more than everything
            budget(mb)
            cache = fresh_cache()
            eager = model(x, pos, cache, slots)
            cache = fresh_cache()
            graph, out = capture(lambda c=cache: model(x, pos, c, slots), warmups=1)
            graph.replay()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                graph.replay()
                torch.cuda.synchronize()
            names = [e.key for e in prof.key_averages()]
            outs[mb] = (eager, out.clone(), cache.k.clone(), sum("_prefetch_kernel" in n for n in names))
    ref = outs[0]
    assert ref[3] == 0  # off: no prefetch kernel in the graph
    for mb in (1, 64):
        eager, graphed, k, n_pf = outs[mb]
        assert n_pf > 0, f"{mb} MB: no prefetch kernel ran in the graphed step"
        assert torch.equal(eager, ref[0]) and torch.equal(graphed, ref[1]) and torch.equal(k, ref[2])
    assert torch.equal(ref[0], ref[1])
