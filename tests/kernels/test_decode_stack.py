"""The persistent decode-stack kernel (kernels/decode_stack.py) computes the layer-by-layer step."""

from __future__ import annotations

import os

import pytest
import torch

from realtime.engines.transformer import KVCache, Transformer, TransformerConfig, use_kernels

CFG = TransformerConfig(dim=256, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=32, intermediate_size=512,
                        max_seq_len=160, rope_theta=10000.0)


def _steps(model: Transformer, x: torch.Tensor, prompt: int, stack: bool, programs: int | None = None) -> torch.Tensor:
    """Prefill ``prompt`` positions, then one-token steps over the rest of x [B, T, dim]; the
    outputs [B, T, dim] (float32) and the caches' final K/V."""
    cache = KVCache(model.cfg, n_slots=4, max_seq_len=model.cfg.max_seq_len, device=x.device, dtype=x.dtype)
    b = x.shape[0]
    slots = torch.tensor([2, 0, 3, 1][:b], device=x.device)
    pos = torch.arange(prompt, device=x.device)[None].expand(b, prompt)
    saved = model.stack
    if not stack:
        model.stack = None
    model.stack_programs = programs
    try:
        outs = [model(x[:, :prompt], pos, cache, slots)]
        for i in range(prompt, x.shape[1]):
            outs.append(model(x[:, i:i + 1], torch.full((b, 1), i, device=x.device), cache, slots))
    finally:
        model.stack = saved
    return torch.cat(outs, dim=1).float(), cache.k[:, slots].float(), cache.v[:, slots].float()


def _interpreted(monkeypatch) -> None:  # noqa: ANN001
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CUDA present: the @gpu test covers the stack kernel")
    import realtime.engines.transformer as tr

    monkeypatch.setattr(tr, "_GEMV", "0")
    monkeypatch.setattr(tr, "_fused_layer_loop", lambda x: True)


@pytest.mark.parametrize("rows, programs", [(1, 3), (3, 5), (4, 2)])
def test_stack_equals_layer_by_layer_on_the_interpreter(monkeypatch, rows: int, programs: int) -> None:
    """fp32: the one-kernel step (one phase per launch off the GPU) gives the layer loop's outputs
    and caches, for 1-4 rows at other positions than each other (a prompt past one attention
    chunk), with row splits that leave programs uneven or idle."""
    _interpreted(monkeypatch)
    torch.manual_seed(0)
    model = Transformer(CFG).eval()
    model.fuse_projections()
    assert model.enable_decode_stack()
    x = torch.randn(rows, 70, CFG.dim)
    with torch.no_grad():
        ref, rk, rv = _steps(model, x, 66, stack=False)
        out, k, v = _steps(model, x, 66, stack=True, programs=programs)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(k, rk, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(v, rv, rtol=2e-5, atol=2e-5)
    # the stacked weights are the layers' own (views), so loads and state dicts still reach them
    assert model.layers[1].mlp.down_proj.weight.data_ptr() == model.stack.down[1].data_ptr()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 4])
def test_stack_equals_layer_by_layer_on_cuda(dtype: torch.dtype, tol: float, rows: int) -> None:
    """One launch with grid barriers and L2 prefetches against the layer-by-layer kernels, the same
    weights; no barrier gave up."""
    from realtime.kernels.decode_stack import errors

    torch.manual_seed(0)
    model = Transformer(CFG).eval().to("cuda", dtype)
    model.fuse_projections()
    assert model.enable_decode_stack()
    x = torch.randn(rows, 76, CFG.dim, device="cuda", dtype=dtype)
    with torch.no_grad():
        ref, rk, rv = _steps(model, x, 66, stack=False)
        out, k, v = _steps(model, x, 66, stack=True)
    for a, b in ((out, ref), (k, rk), (v, rv)):
        assert (a - b).norm() / b.norm() < tol
    assert errors(model.stack) == 0


@pytest.mark.gpu
def test_stack_step_replays_from_a_cuda_graph() -> None:
    """The persistent kernel captured in a CUDA graph (its barrier counter keeps growing across
    replays) gives its eager twin's output at each of several replays."""
    from realtime.kernels.decode_stack import errors

    torch.manual_seed(0)
    model = Transformer(CFG).eval().to("cuda", torch.bfloat16)
    model.fuse_projections()
    assert model.enable_decode_stack()
    cache = KVCache(CFG, n_slots=4, max_seq_len=CFG.max_seq_len, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([1, 3], device="cuda")
    x = torch.randn(2, 40, CFG.dim, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        model(x[:, :30], torch.arange(30, device="cuda")[None].expand(2, 30), cache, slots)
        step_x = x[:, 30:31].clone()
        step_pos = torch.full((2, 1), 30, device="cuda")
        eager = model(step_x, step_pos, cache, slots).clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(step_x, step_pos, cache, slots)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(step_x, step_pos, cache, slots)
        for _ in range(5):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager)  # the same position rewritten with the same K/V each time
    assert errors(model.stack) == 0
