"""The shared decoder stack equals transformers' LlamaModel / Qwen3Model, and its KV cache is exact."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from realtime.engines.transformer import KVCache, Transformer, TransformerConfig, rope_frequencies
from realtime.errors import ModelFormatError

transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _hf_model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        attn_implementation="eager",
    )
    if kind == "llama3":
        cfg = transformers.LlamaConfig(**common, rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0})
        model = transformers.LlamaModel(cfg)
    elif kind == "llama_bias":
        cfg = transformers.LlamaConfig(**{**common, "num_key_value_heads": 4}, attention_bias=True, mlp_bias=True)
        model = transformers.LlamaModel(cfg)
    else:
        cfg = transformers.Qwen3Config(**common, head_dim=24)
        model = transformers.Qwen3Model(cfg)
    model.eval()
    # HF initialises norms to ones; randomise them so a wrong norm placement cannot hide.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return cfg, model


def _ours(cfg_hf, model_hf) -> Transformer:
    cfg = TransformerConfig.from_hf(cfg_hf.to_dict())
    ours = Transformer(cfg).eval()
    ours.load_hf_state_dict(model_hf.state_dict(), prefix="")
    return ours


@pytest.mark.parametrize("kind", ["llama3", "llama_bias", "qwen3"])
def test_fused_projections_equal_separate(kind: str) -> None:
    """fuse_projections (one q|k|v GEMM, one gate|up GEMM) gives the same outputs, keeps the state dict's
    keys, and costs no copy: a later in-place reload reaches the fused weights."""
    cfg_hf, model_hf = _hf_model(kind)
    ours = _ours(cfg_hf, model_hf)
    x = torch.randn(2, 7, cfg_hf.hidden_size)
    pos = torch.arange(7)[None].expand(2, 7)
    with torch.no_grad():
        ref = ours(x, pos)
        keys = sorted(ours.state_dict())
        ours.fuse_projections()
        attn = ours.layers[0].self_attn
        assert attn.qkv_weight is not None and attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
        assert sorted(ours.state_dict()) == keys
        torch.testing.assert_close(ours(x, pos), ref, rtol=1e-5, atol=1e-5)
        _, other = _hf_model(kind, seed=1)
        ours.load_hf_state_dict(other.state_dict(), prefix="")  # writes through the views
        ref2 = _ours(cfg_hf, other)(x, pos)
        torch.testing.assert_close(ours(x, pos), ref2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama3", "llama_bias", "qwen3"])
def test_matches_hf_stack(kind: str) -> None:
    cfg_hf, hf = _hf_model(kind)
    ours = _ours(cfg_hf, hf)
    assert ours.cfg.qk_norm == (kind == "qwen3")
    assert torch.equal(rope_frequencies(ours.cfg), hf.rotary_emb.inv_freq)
    torch.manual_seed(1)
    x = torch.randn(2, 40, 64)
    pos = torch.arange(40)[None].expand(2, -1)
    with torch.no_grad():
        ref = hf(inputs_embeds=x, position_ids=pos).last_hidden_state
        got = ours(x, pos)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_llama3_scaling_changes_frequencies() -> None:
    # The test config must actually exercise all three llama3 branches, or the parity above proves little.
    cfg_hf, _ = _hf_model("llama3")
    cfg = TransformerConfig.from_hf(cfg_hf.to_dict())
    plain = TransformerConfig(**{**cfg.__dict__, "rope_scaling": None})
    a, b = rope_frequencies(cfg), rope_frequencies(plain)
    ratio = b / a
    assert (ratio == 1).any() and torch.isclose(ratio, torch.tensor(32.0)).any()
    assert ((ratio > 1.01) & (ratio < 31.9)).any()


@pytest.mark.parametrize("kind", ["llama3", "qwen3"])
def test_cache_chunks_equal_no_cache(kind: str) -> None:
    cfg_hf, hf = _hf_model(kind)
    ours = _ours(cfg_hf, hf)
    torch.manual_seed(2)
    x = torch.randn(1, 30, 64)
    pos = torch.arange(30)[None]
    cache = KVCache(ours.cfg, n_slots=3, max_seq_len=64)
    slot = torch.tensor([1])
    with torch.no_grad():
        ref = ours(x, pos)
        outs = []
        for a, b in [(0, 7), (7, 8), (8, 20), (20, 30)]:  # prefill chunk, 1-token step, chunks
            outs.append(ours(x[:, a:b], pos[:, a:b], cache=cache, slots=slot))
    torch.testing.assert_close(torch.cat(outs, dim=1), ref, rtol=1e-5, atol=1e-5)
    # Other slots untouched.
    assert cache.k[:, [0, 2]].abs().sum() == 0 and cache.k[:, 1].abs().sum() > 0
    cache.reset([1])
    assert cache.k.abs().sum() == 0 and cache.v.abs().sum() == 0


def test_batch_rows_at_different_positions_equal_solo_runs() -> None:
    cfg_hf, hf = _hf_model("llama3")
    ours = _ours(cfg_hf, hf)
    torch.manual_seed(3)
    lengths = [5, 17, 11]
    seqs = [torch.randn(1, n + 1, 64) for n in lengths]
    solo, batched = [], KVCache(ours.cfg, n_slots=4, max_seq_len=32)
    with torch.no_grad():
        for s in seqs:
            n = s.shape[1]
            solo.append(ours(s, torch.arange(n)[None])[:, -1])
        # Prefill each session into its own slot (slots deliberately not 0..2), then one batched step
        # where every row is at a different position.
        slots = torch.tensor([3, 0, 2])
        for i, s in enumerate(seqs):
            n = s.shape[1] - 1
            ours(s[:, :n], torch.arange(n)[None], cache=batched, slots=slots[i : i + 1])
        x = torch.cat([s[:, -1:] for s in seqs], dim=0)  # [3, 1, dim]
        pos = torch.tensor(lengths)[:, None]
        step = ours(x, pos, cache=batched, slots=slots)[:, 0]
    torch.testing.assert_close(step, torch.cat(solo, dim=0), rtol=1e-5, atol=1e-5)


def test_cpu_decode_reads_only_the_used_prefix_of_the_cache() -> None:
    """On the CPU a decode step gathers and attends over keys 0..max(pos) only, not the whole cache:
    stale NaN past the used prefix (a reused slot, or a long cache) cannot reach the output, which
    the full-length masked path let through its values (0 x NaN)."""
    cfg_hf, hf = _hf_model("llama3")
    ours = _ours(cfg_hf, hf)
    torch.manual_seed(4)
    seqs = [torch.randn(1, n + 1, 64) for n in (6, 9)]
    cache = KVCache(ours.cfg, n_slots=2, max_seq_len=64)
    slots = torch.tensor([1, 0])
    with torch.no_grad():
        want = torch.cat([ours(s, torch.arange(s.shape[1])[None])[:, -1] for s in seqs])
        for i, s in enumerate(seqs):
            n = s.shape[1] - 1
            ours(s[:, :n], torch.arange(n)[None], cache=cache, slots=slots[i:i + 1])
        cache.k[:, :, :, 10:] = float("nan")  # past both rows' positions (6 and 9)
        cache.v[:, :, :, 10:] = float("nan")
        step = ours(torch.cat([s[:, -1:] for s in seqs]), torch.tensor([[6], [9]]), cache=cache, slots=slots)[:, 0]
    torch.testing.assert_close(step, want, rtol=1e-5, atol=1e-5)


def test_bf16_cache_runs() -> None:
    cfg_hf, hf = _hf_model("qwen3")
    ours = _ours(cfg_hf, hf).to(torch.bfloat16)
    assert ours.inv_freq.dtype == torch.float32
    cache = KVCache(ours.cfg, 2, 16, dtype=torch.bfloat16)
    x = torch.randn(2, 4, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = ours(x.float().to(torch.bfloat16), torch.arange(4)[None].expand(2, -1))
        got = ours(x, torch.arange(4)[None].expand(2, -1), cache=cache, slots=torch.tensor([0, 1]))
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), ref.float(), rtol=0.05, atol=0.05)


def test_strict_loading_names_bad_keys() -> None:
    cfg_hf, hf = _hf_model("llama3")
    ours = Transformer(TransformerConfig.from_hf(cfg_hf.to_dict()))
    sd = {f"model.{k}": v for k, v in hf.state_dict().items()}
    ours.load_hf_state_dict(sd, "model.")  # embed_tokens under the prefix is not ours: ignored
    broken = dict(sd)
    del broken["model.layers.1.mlp.up_proj.weight"]
    broken["model.layers.7.mlp.up_proj.weight"] = torch.zeros(1)
    with pytest.raises(ModelFormatError, match=r"layers\.1\.mlp\.up_proj.*layers\.7\.mlp\.up_proj"):
        ours.load_hf_state_dict(broken, "model.")
    shaped = dict(sd)
    shaped["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ModelFormatError, match="norm.weight"):
        ours.load_hf_state_dict(shaped, "model.")


@pytest.mark.gpu
def test_cuda_fp32_parity_and_bf16_graph_decode() -> None:
    """On CUDA: fp32 equals HF; a bf16 batched decode step + sampler captured in a CUDA graph replays
    exactly like eager execution (no host syncs, no data-dependent control flow)."""
    from realtime.engines.sampling import sample

    dev = torch.device("cuda")
    cfg_hf, hf = _hf_model("llama3")
    ours = _ours(cfg_hf, hf)
    hf, ours = hf.to(dev), ours.to(dev)
    torch.manual_seed(4)
    x = torch.randn(2, 40, 64, device=dev)
    pos = torch.arange(40, device=dev)[None].expand(2, -1)
    with torch.no_grad():
        ref = hf(inputs_embeds=x, position_ids=pos).last_hidden_state
        got = ours(x, pos)
        cache = KVCache(ours.cfg, 2, 64, device=dev)
        got_c = torch.cat([ours(x[:, a:b], pos[:, a:b], cache, torch.tensor([0, 1], device=dev)) for a, b in [(0, 13), (13, 40)]], 1)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_c, ref, rtol=1e-4, atol=1e-4)

    ours = ours.to(torch.bfloat16)
    emb = torch.randn(50, 64, device=dev, dtype=torch.bfloat16)  # stand-in embedding / head
    caches = [KVCache(ours.cfg, 4, 64, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    slots = torch.tensor([3, 0, 2], device=dev)
    lengths = [5, 17, 11]
    with torch.no_grad():
        for c in caches:
            for i, n in enumerate(lengths):
                ids = torch.arange(n, device=dev) % 50
                ours(emb[ids][None], torch.arange(n, device=dev)[None], c, slots[i : i + 1])
    params = dict(
        temperature=torch.tensor([0.0, 0.9, 1.2], device=dev),
        top_k=torch.tensor([0, 10, 0], device=dev),
        top_p=torch.tensor([1.0, 1.0, 0.8], device=dev),
        seeds=torch.tensor([1, 2, 3], device=dev),
    )
    tok = torch.tensor([1, 2, 3], device=dev)
    pos = torch.tensor(lengths, device=dev)
    step = torch.zeros(3, dtype=torch.long, device=dev)

    def one_step(cache: KVCache, tok: Tensor, pos: Tensor, step: Tensor) -> Tensor:
        h = ours(emb[tok][:, None], pos[:, None], cache, slots)[:, 0]
        return sample(h @ emb.T, params["temperature"], params["top_k"], params["top_p"], params["seeds"], step)

    s_tok, s_pos, s_step = tok.clone(), pos.clone(), step.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        one_step(caches[0], s_tok, s_pos, s_step)  # warm-up writes the same values the first replay will
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        s_out = one_step(caches[0], s_tok, s_pos, s_step)
    eager_tok, graph_toks, eager_toks = tok, [], []
    for i in range(12):
        with torch.no_grad():
            nxt = one_step(caches[1], eager_tok, pos + i, step + i)
        eager_toks.append(nxt)
        graph.replay()
        graph_toks.append(s_out.clone())
        s_tok.copy_(s_out)
        s_pos += 1
        s_step += 1
        eager_tok = nxt
    assert torch.equal(torch.stack(graph_toks), torch.stack(eager_toks))
    assert torch.equal(caches[0].k, caches[1].k)
