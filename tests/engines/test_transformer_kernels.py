"""The Triton fast path of the shared transformer (REALTIME_KERNELS) equals the PyTorch path on CUDA."""

from __future__ import annotations

import pytest
import torch

from realtime.engines.transformer import KVCache, Transformer, TransformerConfig, use_kernels

CFG = TransformerConfig(dim=256, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=32, intermediate_size=512,
                        max_seq_len=64, rope_theta=10000.0)


def _run(model: Transformer, x: torch.Tensor, kernels: bool) -> torch.Tensor:
    before = use_kernels()
    use_kernels(kernels)
    try:
        cache = KVCache(CFG, n_slots=4, max_seq_len=64, device=x.device, dtype=x.dtype)
        slots = torch.tensor([2, 0, 3], device=x.device)
        b, t = x.shape[0], 9
        pos = torch.arange(t, device=x.device)[None].expand(b, t)
        outs = [model(x[:, :t], pos, cache, slots)]
        for i in range(t, x.shape[1]):  # one-token decode steps: the decode-attention kernel's path
            outs.append(model(x[:, i:i + 1], torch.full((b, 1), i, device=x.device), cache, slots))
        return torch.cat(outs, dim=1).float()
    finally:
        use_kernels(before)


def test_switch_is_inert_on_the_cpu() -> None:
    torch.manual_seed(0)
    model = Transformer(CFG).eval()
    x = torch.randn(3, 14, CFG.dim)
    with torch.no_grad():
        assert torch.equal(_run(model, x, True), _run(model, x, False))


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["separate-projections", "fused-projections"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_kernels_equal_pytorch_on_cuda(dtype: torch.dtype, tol: float, fused: bool) -> None:
    """Kernels on (RMSNorm + residual, rotary, decode attention), with q|k|v and gate|up fused or not,
    against the plain PyTorch path on the same weights."""
    torch.manual_seed(0)
    model = Transformer(CFG).eval().to("cuda", dtype)
    x = torch.randn(3, 14, CFG.dim, device="cuda", dtype=dtype)
    with torch.no_grad():
        ref = _run(model, x, False)
        if fused:
            model.fuse_projections()
        fast = _run(model, x, True)
    assert (fast - ref).norm() / ref.norm() < tol


def test_kernel_layer_loops_equal_plain_path_on_the_interpreter(monkeypatch) -> None:
    """Both kernel layer loops — the fused-norm prefill loop and the one-token fast path (GEMV with
    fused SwiGLU, RoPE + cache write, decode attention; positions from the RoPE table) — compute
    the same function as the plain loop, fp32, under TRITON_INTERPRET."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CUDA present: the @gpu test covers the fast path")
    import realtime.engines.transformer as tr

    torch.manual_seed(0)
    model = Transformer(CFG).eval()
    x = torch.randn(3, 11, CFG.dim)  # 9 prefill tokens, then 2 decode steps (the interpreter is slow)
    with torch.no_grad():
        ref = _run(model, x, False)
        monkeypatch.setattr(tr, "_GEMV", "1")
        model.fuse_projections()
        for layer in model.layers:  # what fuse() decides on CUDA; off CUDA it never picks the GEMV
            layer.self_attn.gemv_qkv = layer.self_attn.gemv_o = True
            layer.mlp.gemv_gate_up = layer.mlp.gemv_down = True
        assert model._decode_fusable()
        monkeypatch.setattr(tr, "_fused_layer_loop", lambda x: True)
        fast = _run(model, x, True)
        # o and down as split-K partials, summed by the residual add + RMSNorm kernel
        from realtime.kernels import gemv

        for layer in model.layers:
            for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
                monkeypatch.setitem(gemv._best, gemv._key(w, None, False, True), ("fma", 8, 64, 4, 1, 2))
        calls = []
        monkeypatch.setattr(tr, "_add_norm", lambda out, *a, f=tr._add_norm: calls.append(type(out)) or f(out, *a))
        split = _run(model, x, True)
    torch.testing.assert_close(fast, ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(split, ref, rtol=2e-5, atol=2e-5)
    # the prefill's sublayers give tensors; each of the 2 decode steps' 2 x 2 give partials
    assert calls.count(gemv.Partials) == 2 * 2 * CFG.n_layers and calls.count(torch.Tensor) == 2 * CFG.n_layers


@pytest.mark.gpu
def test_programmatic_dependent_launch_changes_no_result(monkeypatch) -> None:
    """The kernels launched with programmatic dependent launch (each may start while the one before
    it finishes, and waits for it first) give bit-identical results to plain launches, eagerly and
    replayed from a CUDA graph, through a whole decode (GEMV incl. split-K partials, norms, rotary +
    cache write, decode attention)."""
    from realtime.kernels import _triton

    torch.manual_seed(0)
    model = Transformer(CFG).eval().to("cuda", torch.bfloat16)
    model.fuse_projections()
    x = torch.randn(3, 14, CFG.dim, device="cuda", dtype=torch.bfloat16)
    outs = {}
    with torch.no_grad():
        for on in (False, True):
            monkeypatch.setattr(_triton, "_PDL", on)
            assert _triton.pdl(x) == on
            outs[on] = _run(model, x, True)
        assert torch.equal(outs[True], outs[False])
        # one decode step captured with PDL launches, replayed against its eager twin
        cache = KVCache(CFG, n_slots=4, max_seq_len=64, device="cuda", dtype=torch.bfloat16)
        slots = torch.tensor([2, 0, 3], device="cuda")
        pos = torch.arange(9, device="cuda")[None].expand(3, 9)
        model(x[:, :9], pos, cache, slots)
        step_pos = torch.full((3, 1), 9, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            eager = model(x[:, 9:10], step_pos, cache, slots).clone()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(x[:, 9:10], step_pos, cache, slots)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, eager)
