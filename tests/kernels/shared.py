"""Helpers shared by the kernel test files: attention inputs, and a CUDA graph replay for the GPU tests."""

from __future__ import annotations

import torch


def eager_and_replayed(fn):  # noqa: ANN001, ANN201
    """fn() eagerly on a side stream (a warm-up that compiles), then captured in a CUDA graph and
    replayed once -> (eager result, replayed result)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        eager = fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return eager, out


def attention_inputs(b, h, hkv, s, tmax, d, dtype, device="cpu", seed=0):  # noqa: ANN001, ANN201
    """Seeded decode-attention inputs: q [b, h, d], caches [s, hkv, tmax, d], b distinct slots."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, d, generator=g).to(device, dtype)
    kc = torch.randn(s, hkv, tmax, d, generator=g).to(device, dtype)
    vc = torch.randn(s, hkv, tmax, d, generator=g).to(device, dtype)
    slots = torch.randperm(s, generator=g)[:b].to(device)
    return q, kc, vc, slots
