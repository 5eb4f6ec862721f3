"""CSM engine equals transformers' CsmForConditionalGeneration (logits, greedy codes, voice-reference
prompts, CsmProcessor prompt layout), its batched path equals solo generation, and bad folders fail
with typed errors."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from realtime.engines.csm import CSM, CSMPrompt
from realtime.errors import ConfigError, ModelFormatError, UnsupportedError

transformers = pytest.importorskip("transformers")

SPECIALS = {"<|begin_of_text|>": 290, "<|end_of_text|>": 291, "<|AUDIO|>": 292, "<|audio_eos|>": 293}

CONFIGS = {
    # K=4 codebooks, GQA in both stacks, llama3-scaled RoPE in the backbone (short original context so
    # the scaling changes the frequencies that matter here).
    "k4_llama3": dict(
        num_codebooks=4, vocab_size=37, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        depth=dict(hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=3,
                   num_key_value_heads=1,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 4}),
    ),
    # K=6 codebooks, more backbone layers, MQA backbone, MHA depth decoder with a wider head, plain RoPE.
    "k6_plain": dict(
        num_codebooks=6, vocab_size=29, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        depth=dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    ),
}


def _tiny_codec() -> dict:
    # The Mimi codec is part of CsmForConditionalGeneration; keep it tiny. Its weights are ignored by us.
    return transformers.MimiConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=32,
        codebook_dim=8, codebook_size=16, num_filters=4, num_residual_layers=1, upsampling_ratios=[2, 2],
        vector_quantization_hidden_dimension=8, num_quantizers=4, num_semantic_quantizers=1, head_dim=8,
        upsample_groups=16,
    ).to_dict()


def _hf_model(name: str, seed: int = 0):
    c = dict(CONFIGS[name])
    depth = c.pop("depth")
    k, v = c["num_codebooks"], c["vocab_size"]
    cfg = transformers.CsmConfig(
        **c, text_vocab_size=300, max_position_embeddings=256, pad_token_id=None,
        bos_token_id=SPECIALS["<|begin_of_text|>"], eos_token_id=SPECIALS["<|end_of_text|>"],
        audio_token_id=SPECIALS["<|AUDIO|>"], audio_eos_token_id=SPECIALS["<|audio_eos|>"],
        codebook_pad_token_id=v - 1, codebook_eos_token_id=0,
        depth_decoder_config=dict(num_codebooks=k, backbone_hidden_size=c["hidden_size"], vocab_size=v,
                                  max_position_embeddings=k, **depth),
        codec_config=_tiny_codec(), attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = transformers.CsmForConditionalGeneration(cfg).eval()
    # HF's init (std 0.02, unit norms) gives near-uniform logits where any rounding could flip an argmax;
    # use O(1) activations and well-separated logits, and random norms so a misplaced norm cannot hide.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.startswith("codec_model."):
                continue
            if "norm" in pname:
                p.normal_(1.0, 0.2)
            elif "embed" in pname:
                p.normal_(0.0, 1.0)
            elif pname.endswith("codebooks_head.weight"):
                p.normal_(0.0, 3.0 / math.sqrt(p.shape[1]))
            elif pname == "lm_head.weight":
                p.normal_(0.0, 3.0 / math.sqrt(p.shape[1]))
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
    return model


def _save_tokenizer(folder: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, models

    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}
    vocab.update(SPECIALS)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per character
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    tok.save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for i, name in enumerate(CONFIGS):
        folder = tmp_path_factory.mktemp(name)
        model = _hf_model(name, seed=i)
        model.save_pretrained(folder)
        _save_tokenizer(folder)
        out[name] = (folder, model, CSM.from_pretrained(folder))
    return out


def _hf_generate(model, input_ids: torch.Tensor, n: int, **kw) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(input_ids, do_sample=False, depth_decoder_do_sample=False, max_new_tokens=n, **kw)
    assert isinstance(out, torch.Tensor) and out.ndim == 3 and out.shape[0] == 1
    return out[0]  # [frames, K]


def _until_eos(codes: torch.Tensor) -> torch.Tensor:
    """HF keeps the stop frame in its output; we return the frames before the first all-zero frame."""
    stop = (codes == 0).all(dim=-1).nonzero()
    return codes[: int(stop[0])] if stop.numel() else codes


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_logits_match_hf(ckpts, name):
    _, hf, ours = ckpts[name]
    k = ours.num_codebooks
    torch.manual_seed(5)
    ids = torch.randint(0, 290, (1, 11))
    with torch.no_grad():
        ref = hf(input_ids=ids)
    logits, hidden = ours.backbone_logits(ids)
    torch.testing.assert_close(logits, ref.logits[0], rtol=1e-4, atol=1e-4)
    # Depth decoder teacher-forced over a batch of 3 frames, from the backbone's last hidden states.
    codes = torch.randint(0, ours.audio_vocab_size, (3, k))
    h = hidden[-3:]
    with torch.no_grad():
        hf_in = torch.nn.functional.pad(codes[:, : k - 1], (1, 0), value=0)  # position 0 = backbone hidden
        ref_d = hf.depth_decoder(input_ids=hf_in, backbone_last_hidden_state=h).logits
    assert ref_d.shape == (3, k - 1, ours.audio_vocab_size)
    torch.testing.assert_close(ours.depth_logits(h, codes), ref_d, rtol=1e-4, atol=1e-4)
    # Logits are far from uniform, so the greedy comparisons below are meaningful.
    assert float(logits.std(dim=-1).min()) > 0.5


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_codes_match_hf_generate(ckpts, name):
    _, hf, ours = ckpts[name]
    n = 20
    for seed, t in ((1, 9), (2, 4)):
        torch.manual_seed(seed)
        ids = torch.randint(0, 290, (1, t))
        ref = _hf_generate(hf, ids, n)
        assert ref.shape == (n, ours.num_codebooks)  # random weights do not emit the stop frame here
        got = ours.generate_codes(ids, max_frames=n)
        assert got.dtype == torch.long
        torch.testing.assert_close(got, _until_eos(ref), rtol=0, atol=0)
        assert len(set(got[:, 0].tolist())) > 1  # not a degenerate constant output


def test_stop_rule(ckpts, tmp_path):
    folder, hf, ours = ckpts["k4_llama3"]
    k = ours.num_codebooks
    # 1. Scripted frames: a frame with some zero codes goes on; the first all-zero frame ends the
    #    utterance and is not returned.
    script = iter([torch.tensor([[3, 0, 0, 0]]), torch.tensor([[0, 0, 0, 5]]), torch.zeros(1, k, dtype=torch.long),
                   torch.tensor([[1, 2, 3, 4]])])
    real_step = ours.step
    calls = []

    def fake_step(state, slots, temperature, top_k, seeds):
        calls.append(1)
        real_step(state, slots, temperature, top_k, seeds)
        return next(script)

    ours.step = fake_step
    try:
        got = ours.generate_codes(torch.tensor([[290, 5, 6]]), max_frames=10)
    finally:
        del ours.step
    assert got.tolist() == [[3, 0, 0, 0], [0, 0, 0, 5]] and len(calls) == 3
    assert ours.is_eos(torch.tensor([[0, 0, 0, 0], [0, 0, 0, 5]])).tolist() == [True, False]
    # 2. A real model whose heads are zero emits the all-zero frame at once: HF stops after that one
    #    frame, we return no frames.
    sd = load_file(folder / "model.safetensors")
    sd["lm_head.weight"] = torch.zeros_like(sd["lm_head.weight"])
    sd["depth_decoder.codebooks_head.weight"] = torch.zeros_like(sd["depth_decoder.codebooks_head.weight"])
    dead = tmp_path / "dead"
    dead.mkdir()
    save_file(sd, dead / "model.safetensors")
    shutil.copy(folder / "config.json", dead / "config.json")
    hf_dead = transformers.CsmForConditionalGeneration.from_pretrained(dead).eval()
    ids = torch.tensor([[290, 7, 8, 9]])
    ref = _hf_generate(hf_dead, ids, 8)
    assert ref.tolist() == [[0] * k]
    got = CSM.from_pretrained(dead).generate_codes(ids, max_frames=8)
    assert got.shape == (0, k)


def _stub_codec(hf, frames: list[torch.Tensor]) -> None:
    """Replace HF's Mimi encoder by a stub that returns the given codes, so HF and we start from the same
    audio codes (the codec itself is tested in the Mimi tests)."""
    queue = list(frames)

    def encode(audio, *a, **kw):
        return SimpleNamespace(audio_codes=queue.pop(0).T[None])  # [1, K, F]

    def get_audio_codes_mask(padding_mask, padding_side="right"):
        n = torch.ceil(padding_mask.sum(-1) / 1920).long()  # CsmProcessor's frame count for 24 kHz Mimi
        return torch.arange(int(n.max()))[None] < n[:, None]

    hf.codec_model.encode = encode
    hf.codec_model.get_audio_codes_mask = get_audio_codes_mask


def test_voice_reference_prompt_matches_hf_and_processor(ckpts):
    folder, hf, ours = ckpts["k4_llama3"]
    k, v = ours.num_codebooks, ours.audio_vocab_size
    torch.manual_seed(11)
    ref_a = torch.randint(1, v, (3, k))
    ref_b = torch.randint(1, v, (2, k))
    prompt = ours.build_prompt("xyz!", speaker=1, context=[(1, "ab", ref_a), (0, "cd", ref_b), (1, "no audio", None)])
    assert isinstance(prompt, CSMPrompt) and ours.tokenizer is not None
    # Prompt layout equals what CsmProcessor builds from the same conversation text + audio.
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    fast.pad_token = "<|end_of_text|>"
    proc = transformers.CsmProcessor(transformers.EncodecFeatureExtractor(feature_size=1, sampling_rate=24000), fast)
    text = ("<|begin_of_text|>[1]ab<|end_of_text|><|AUDIO|><|audio_eos|>"
            "<|begin_of_text|>[0]cd<|end_of_text|><|AUDIO|><|audio_eos|>"
            "<|begin_of_text|>[1]no audio<|end_of_text|>"
            "<|begin_of_text|>[1]xyz!<|end_of_text|>")
    audio = [np.zeros(1920 * 3, dtype=np.float32), np.zeros(1920 * 2, dtype=np.float32)]
    inputs = proc(text, audio=audio)
    assert inputs["input_ids"][0].tolist() == prompt.ids.tolist()
    assert ours.tokenize("xyz!", 1) == [290, *[ord(c) - 32 for c in "[1]xyz!"], 291]
    # Same next codes as HF fed with the same audio codes.
    _stub_codec(hf, [ref_a, ref_b])
    n = 8
    ref = _hf_generate(hf, inputs["input_ids"], n, input_values=inputs["input_values"],
                       input_values_cutoffs=inputs["input_values_cutoffs"])
    del hf.codec_model.encode, hf.codec_model.get_audio_codes_mask
    got = ours.generate_codes(prompt, max_frames=n)
    torch.testing.assert_close(got, _until_eos(ref), rtol=0, atol=0)
    # The audio really steers the output (the prompt is not silently embedded as text).
    text_only = ours.generate_codes(prompt.ids[None], max_frames=n)
    assert not torch.equal(text_only, got)


def test_batched_sessions_equal_solo(ckpts):
    _, _, ours = ckpts["k6_plain"]
    k = ours.num_codebooks
    torch.manual_seed(3)
    prompts = [torch.randint(0, 290, (1, t)) for t in (5, 9, 3, 7)]
    n = 10
    # (slot, join step, temperature, top_k, seed): session 2 samples, proving per-row seeded sampling.
    sessions = [(3, 0, 0.0, 0, 0), (0, 2, 0.0, 0, 0), (2, 5, 0.9, 5, 7)]
    solo = [ours.generate_codes(prompts[0], n), ours.generate_codes(prompts[1], n),
            ours.generate_codes(prompts[2], n, greedy=False, temperature=0.9, top_k=5, seed=7),
            ours.generate_codes(prompts[3], n)]
    assert not torch.equal(solo[2], ours.generate_codes(prompts[2], n))  # sampling differs from greedy
    state = ours.new_batch(n_slots=4, max_seq_len=32)
    out: dict[int, list[torch.Tensor]] = {i: [] for i in range(4)}
    active: dict[int, int] = {}  # session -> slot
    params = {i: s for i, s in enumerate(sessions)}
    params[3] = (3, None, 0.0, 0, 0)  # session 3 reuses session 0's slot once that one is done
    for t in range(40):
        for i, (slot, join, *_rest) in params.items():
            if join == t:
                ours.prefill(state, slot, prompts[i])
                active[i] = slot
        if not active:
            break
        ids = sorted(active)
        slots = torch.tensor([active[i] for i in ids])
        frames = ours.step(state, slots, torch.tensor([params[i][2] for i in ids]),
                           torch.tensor([params[i][3] for i in ids]), torch.tensor([params[i][4] for i in ids]))
        assert frames.shape == (len(ids), k)
        for row, i in enumerate(ids):
            out[i].append(frames[row])
            if len(out[i]) == n:
                del active[i]
                if i == 0:
                    state.reset([params[0][0]])
                    params[3] = (3, t + 1, 0.0, 0, 0)
    for i in range(4):
        assert len(out[i]) == n
        torch.testing.assert_close(torch.stack(out[i]), solo[i], rtol=0, atol=0)


def _mixed_prompts(ours) -> list:
    """Prompts of different lengths, two with audio context turns (audio positions in the batch)."""
    k, v = ours.num_codebooks, ours.audio_vocab_size
    torch.manual_seed(12)
    ref = torch.randint(1, v, (3, k))
    last = torch.randint(1, v, (5, k))
    return [ours.build_prompt("hi", 0), ours.build_prompt("xyz!", 1, [(1, "ab", ref)]),
            ours.build_prompt("a longer line", 0, [(0, "cd", ref), (0, "ef", last)]), ours.build_prompt("q", 1)]


def _assert_same_slots(ours, a, b, slots, prompts, exact: bool) -> None:
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-5}
    for slot, p in zip(slots, prompts):
        t = len(p)
        assert a.lengths[slot] == b.lengths[slot] == t
        assert int(a.pos[slot]) == int(b.pos[slot]) == t and int(a.frames[slot]) == 0
        torch.testing.assert_close(a.hidden[slot], b.hidden[slot], **tol)
        for ca, cb in ((a.backbone_cache.k, b.backbone_cache.k), (a.backbone_cache.v, b.backbone_cache.v)):
            torch.testing.assert_close(ca[:, slot, :, :t], cb[:, slot, :, :t], **tol)
    # Then the same frames, greedy and sampled.
    slots_t = torch.tensor(slots)
    n = len(slots)
    temp, tk, seeds = torch.tensor([0.0, 1.0, 0.0, 0.8][:n]), torch.tensor([0, 5, 0, 3][:n]), torch.arange(n)
    for _ in range(4):
        torch.testing.assert_close(ours.step(a, slots_t, temp, tk, seeds), ours.step(b, slots_t, temp, tk, seeds),
                                   rtol=0, atol=0)


def test_batched_prefill_equals_solo(ckpts):
    """prefill_many (right-padded rows, causal attention over the fresh inputs) leaves each slot as
    its own prefill does, including audio positions and a slot that held an earlier session."""
    _, _, ours = ckpts["k4_llama3"]
    prompts = _mixed_prompts(ours)
    slots = [2, 0, 3, 1]
    solo, batched = ours.new_batch(5, 64), ours.new_batch(5, 64)
    for slot, p in zip(slots, prompts):
        ours.prefill(solo, slot, p)
    ours.prefill_many(batched, [0], [prompts[2]])  # slot 0 used before: prefill_many must reset it
    ours.step(batched, torch.tensor([0]), torch.tensor([0.0]), torch.tensor([0]), torch.tensor([0]))
    ours.prefill_many(batched, slots, prompts)
    _assert_same_slots(ours, solo, batched, slots, prompts, exact=False)
    with pytest.raises(ConfigError, match="duplicate"):
        ours.prefill_many(batched, [1, 1], prompts[:2])
    with pytest.raises(UnsupportedError, match="does not fit"):
        ours.prefill_many(batched, [1, 2], [prompts[0], ours.prompt_from_ids(torch.arange(64)[None])])


def _copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bad_checkpoints(ckpts, tmp_path):
    folder, _, _ = ckpts["k4_llama3"]
    with pytest.raises(ConfigError, match="does not exist"):
        CSM.from_pretrained(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        CSM.from_pretrained(empty)
    # Wrong model type.
    bad = _copy_ckpt(folder, tmp_path / "llama")
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(ConfigError, match="model_type='llama'"):
        CSM.from_pretrained(bad)
    # Config that does not match the weights.
    bad = _copy_ckpt(folder, tmp_path / "k5")
    (bad / "config.json").write_text(json.dumps({**cfg, "num_codebooks": 5, "depth_decoder_config": {
        **cfg["depth_decoder_config"], "num_codebooks": 5}}))
    with pytest.raises(ModelFormatError, match="codebooks_head"):
        CSM.from_pretrained(bad)
    # Inconsistent sub-config.
    bad = _copy_ckpt(folder, tmp_path / "dd")
    (bad / "config.json").write_text(json.dumps({**cfg, "depth_decoder_config": {
        **cfg["depth_decoder_config"], "num_codebooks": 7}}))
    with pytest.raises(ConfigError, match="depth decoder num_codebooks"):
        CSM.from_pretrained(bad)
    # Missing / unexpected tensors.
    sd = load_file(folder / "model.safetensors")
    bad = _copy_ckpt(folder, tmp_path / "missing")
    save_file({n: t for n, t in sd.items() if n not in ("lm_head.weight", "backbone_model.layers.1.mlp.up_proj.weight")},
              bad / "model.safetensors")
    with pytest.raises(ModelFormatError, match="lm_head.weight"):
        CSM.from_pretrained(bad)
    save_file({n: t for n, t in sd.items() if n != "backbone_model.layers.1.mlp.up_proj.weight"}, bad / "model.safetensors")
    with pytest.raises(ModelFormatError, match="backbone_model.layers.1.mlp.up_proj.weight"):
        CSM.from_pretrained(bad)
    save_file({**sd, "extra.weight": torch.zeros(2)}, bad / "model.safetensors")
    with pytest.raises(ModelFormatError, match="unexpected: extra.weight"):
        CSM.from_pretrained(bad)
    (bad / "model.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="no model.safetensors"):
        CSM.from_pretrained(bad)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelFormatError, match="cannot read"):
        CSM.from_pretrained(bad)
    # A folder storing one shared codebook table loads when the config declares them tied.
    one = _copy_ckpt(folder, tmp_path / "one_table")
    shared = sd["backbone_model.embed_tokens.embed_audio_tokens.weight"]
    save_file({**{n: t for n, t in sd.items() if n != "depth_decoder.model.embed_tokens.weight"}},
              one / "model.safetensors")
    m = CSM.from_pretrained(one)
    assert m.depth_embed_audio is m.embed_audio and torch.equal(m.embed_audio.weight, shared)


@pytest.mark.gpu
def test_cuda_matches_cpu_and_runs_bf16(ckpts):
    folder, hf, cpu = ckpts["k4_llama3"]
    torch.manual_seed(4)
    ids = torch.randint(0, 290, (1, 9))
    gpu = CSM.from_pretrained(folder, device="cuda", dtype=torch.float32)
    torch.testing.assert_close(gpu.generate_codes(ids, 16), cpu.generate_codes(ids, 16), rtol=0, atol=0)
    bf = CSM.from_pretrained(folder, device="cuda", dtype=torch.bfloat16)
    logits, _ = bf.backbone_logits(ids)
    ref, _ = cpu.backbone_logits(ids)
    assert logits.dtype == torch.float32 and float((logits.cpu() - ref).abs().max()) < 0.1 * float(ref.abs().max())
    state = bf.new_batch(3, 64)
    for slot in range(3):
        bf.prefill(state, slot, ids[:, : 5 + slot])
    slots = torch.arange(3)
    for _ in range(4):
        codes = bf.step(state, slots, torch.tensor([0.0, 0.8, 1.0]), torch.tensor([0, 10, 0]), torch.tensor([1, 2, 3]))
        assert codes.shape == (3, bf.num_codebooks) and codes.device.type == "cuda"
        assert int(codes.min()) >= 0 and int(codes.max()) < bf.audio_vocab_size


def test_slot_errors(ckpts):
    _, _, ours = ckpts["k4_llama3"]
    state = ours.new_batch(2, 8)
    one = torch.ones(2)
    with pytest.raises(ConfigError, match="not prefilled"):
        ours.step(state, torch.tensor([0]), one[:1], torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    ours.prefill(state, 0, torch.tensor([[290, 3, 4, 5, 6]]))
    ours.prefill(state, 1, torch.tensor([[290, 3]]))
    with pytest.raises(ConfigError, match="duplicate"):
        ours.step(state, torch.tensor([0, 0]), one, torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    with pytest.raises(UnsupportedError, match="does not fit"):
        ours.prefill(state, 1, torch.arange(8)[None])
    for _ in range(3):  # positions 5, 6, 7: the cache is then full
        ours.step(state, torch.tensor([0]), one[:1], torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    with pytest.raises(UnsupportedError, match="full"):
        ours.step(state, torch.tensor([0]), one[:1], torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    ours.prefill(state, 0, torch.tensor([[290, 3]]))  # reuse after a full run
    a = ours.step(state, torch.tensor([0, 1]), -one, torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    assert torch.equal(a[0], a[1])  # same prompt, greedy: the reused slot kept nothing of its last run


def test_sampled_frames_follow_the_documented_rng_steps(ckpts):
    """Sampling in step() equals a cache-free re-derivation: codebook k of frame f draws with
    sample(..., seed, step=f*K+k) from the teacher-forced logits."""
    from realtime.engines.sampling import sample

    _, _, ours = ckpts["k6_plain"]
    k = ours.num_codebooks
    ids = torch.tensor([[290, 40, 41, 42, 43]])
    temp, tk, seed = torch.tensor([1.3]), torch.tensor([7]), torch.tensor([123])
    got = ours.generate_codes(ids, 3, greedy=False, temperature=1.3, top_k=7, seed=123)
    prompt = ours.prompt_from_ids(ids)
    for f in range(3):
        logits0, hidden = ours.backbone_logits(prompt)
        codes = torch.zeros(1, k, dtype=torch.long)
        codes[0, 0] = sample(logits0[-1:], temp, tk, torch.ones(1), seed, torch.tensor([f * k]))[0]
        for cb in range(1, k):
            lg = ours.depth_logits(hidden[-1:], codes)[:, cb - 1]
            codes[0, cb] = sample(lg, temp, tk, torch.ones(1), seed, torch.tensor([f * k + cb]))[0]
        assert torch.equal(codes[0], got[f]), f
        prompt = CSMPrompt(torch.cat([prompt.ids, torch.zeros(1, dtype=torch.long)]), torch.cat([prompt.codes, codes]),
                           torch.cat([prompt.is_audio, torch.ones(1, dtype=torch.bool)]))


@pytest.mark.gpu
def test_cuda_graph_step_equals_solo(ckpts):
    folder, _, _ = ckpts["k6_plain"]
    gpu = CSM.from_pretrained(folder, device="cuda", dtype=torch.float32)
    torch.manual_seed(8)
    prompts = [torch.randint(0, 290, (1, t)) for t in (6, 3, 8)]
    n = 12
    solo = [gpu.generate_codes(prompts[0], n), gpu.generate_codes(prompts[1], n, greedy=False, temperature=1.0,
                                                                   top_k=4, seed=9), gpu.generate_codes(prompts[2], n)]
    state = gpu.new_batch(4, 40)
    graphs = gpu.capture_step(state, sizes=(1, 2, 4))
    params = [(0.0, 0, 0), (1.0, 4, 9), (0.0, 0, 0)]
    joins = {0: 0, 1: 3, 2: 4}  # session -> step at which it joins (slot = session + 1)
    out: dict[int, list[torch.Tensor]] = {i: [] for i in range(3)}
    for t in range(30):
        for i, j in joins.items():
            if j == t:
                gpu.prefill(state, i + 1, prompts[i])
        live = [i for i in range(3) if joins[i] <= t and len(out[i]) < n]
        if not live:
            break
        # every other step returns the codes on the host before the feed-back graph has finished
        codes = graphs(torch.tensor([i + 1 for i in live]), torch.tensor([params[i][0] for i in live]),
                       torch.tensor([params[i][1] for i in live]), torch.tensor([params[i][2] for i in live]),
                       to_host=t % 2 == 1)
        assert codes.is_cuda == (t % 2 == 0)
        for row, i in enumerate(live):
            out[i].append(codes[row].cpu())
    for i in range(3):
        torch.testing.assert_close(torch.stack(out[i]), solo[i], rtol=0, atol=0)


@pytest.mark.gpu
def test_cuda_graph_prefill_equals_eager(ckpts):
    folder, _, _ = ckpts["k4_llama3"]
    gpu = CSM.from_pretrained(folder, device="cuda", dtype=torch.float32)
    prompts = _mixed_prompts(gpu)
    slots = [2, 0, 3, 1]
    eager, graphed = gpu.new_batch(5, 64), gpu.new_batch(5, 64)
    graphs = gpu.capture_prefill(graphed, batches=(1, 4), lengths=(16, 64))
    assert [len(p) for p in prompts] == [7, 20, 42, 6]
    assert graphs.lengths == [16, 63]  # a bucket longer than the cache shrinks to its last position
    assert graphs.fits(4, 63) and not graphs.fits(5, 8) and not graphs.fits(1, 64)
    for slot, p in zip(slots, prompts):
        gpu.prefill(eager, slot, p)
    gpu.prefill_many(graphed, slots[:1], prompts[:1], graphs=graphs)  # bucket (1, 16)
    gpu.prefill_many(graphed, slots, prompts, graphs=graphs)  # bucket (4, 64)
    _assert_same_slots(gpu, eager, graphed, slots, prompts, exact=False)


def test_projected_depth_inputs_are_the_depth_inputs(ckpts):
    """``project_depth_inputs`` (the table the CUDA stack's fused depth pass gathers from) holds
    ``_depth_input(code, codebook)`` for every codebook and code, in float32 to rounding."""
    _, _, cpu = ckpts["k6_plain"]
    table = cpu.project_depth_inputs()
    v = cpu.audio_vocab_size
    assert table.shape == (cpu.num_codebooks * v, cpu.config.depth.dim)
    for cb in range(cpu.num_codebooks):
        torch.testing.assert_close(table[cb * v:(cb + 1) * v], cpu._depth_input(torch.arange(v), cb), rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.gpu
def test_fused_depth_passes_give_the_unfused_logits(monkeypatch):
    """With the CUDA stack (REALTIME_STACK=csm, REALTIME_STACK_KERNEL=cuda), a depth pass past the
    first is one kernel: the input row gathered from ``depth_inputs``, the layers, the codebook
    head and its code sampled. With an exact projector (a selection matrix) its inputs are the
    unfused pass's bit for bit, so the greedy codes must be the unfused ones up to the first
    where they part, and that one only at a near tie of the unfused logits (the head's sums run
    in another order)."""
    from realtime.kernels import decode_stack_cuda as dsc

    if not dsc.available():
        pytest.skip("needs an sm_90 GPU and nvcc")
    import realtime.engines.csm as csm_mod
    import realtime.engines.transformer as tr
    from realtime.engines.csm import CSMConfig
    from realtime.engines.transformer import TransformerConfig

    monkeypatch.setattr(tr, "_STACK_KERNEL", "cuda")
    monkeypatch.setattr(tr, "_STACK", "csm")
    monkeypatch.setattr(tr, "_stack_owner", [])
    widths = dict(dim=1024, n_heads=8, n_kv_heads=2, head_dim=128, intermediate_size=2048, max_seq_len=64,
                  rope_theta=500000.0)
    cfg = CSMConfig(backbone=TransformerConfig(n_layers=1, **widths), depth=TransformerConfig(n_layers=2, **widths),
                    num_codebooks=8, text_vocab_size=300)
    torch.manual_seed(0)
    model = CSM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
        model.depth_projector.weight.copy_(torch.eye(1024))
    model = model.to("cuda", torch.bfloat16).eval()
    model.fuse_projections()
    assert model.depth.stack_cuda and model.depth_inputs is not None
    seen: list = []
    monkeypatch.setattr(csm_mod, "_sample", lambda logits, *a, f=csm_mod._sample: seen.append(logits.clone()) or f(logits, *a))

    def frame():  # noqa: ANN202
        seen.clear()
        state = model.new_batch(1, 64)
        model.prefill(state, 0, torch.arange(3, 12)[None])
        one = torch.ones(1, dtype=torch.long)
        codes = model.step(state, one * 0, torch.zeros(1), one * 0, one * 7)[0].cpu()
        return codes, list(seen)

    fused_codes, fused = frame()
    table = model.depth_inputs
    model.depth_inputs = None  # every pass unfused: the gather, the projector, the stack, the head
    plain_codes, plain = frame()
    model.depth_inputs = table
    assert len(fused) == 2 and len(plain) == cfg.num_codebooks  # fused: _sample for codebooks 0 and 1 only
    for i in range(2):
        assert torch.equal(fused[i], plain[i])
    for i in range(cfg.num_codebooks):
        if fused_codes[i] != plain_codes[i]:  # a near tie: the rest follows other codes
            top = plain[i].float().topk(2).values[0]
            assert float(top[0] - top[1]) < 0.05 * float(top[0].abs()), (i, top)
            break
    assert int(fused_codes.min()) >= 0 and int(fused_codes.max()) < cfg.audio_vocab_size
    assert dsc.errors(model.depth.stack) == 0
    # L2 hints (REALTIME_STACK_L2_KEEP: by default auto, as this frame ran; 3; 0, none): they
    # change no result
    assert model.depth.stack.l2_keep > 0 and model.backbone.stack.l2_keep == -1 and model.l2_kept > 0
    try:
        for keep in (3, 0):
            monkeypatch.setattr(dsc, "L2_KEEP", keep)
            model._keep_depth_in_l2()
            assert model.depth.stack.l2_keep == keep and model.backbone.stack.l2_keep == (-1 if keep else 0)
            kept_codes, kept = frame()
            assert torch.equal(kept_codes, fused_codes) and all(torch.equal(a, b) for a, b in zip(kept, fused))
    finally:
        dsc.persist_l2(torch.device("cuda"), 0)


@pytest.mark.parametrize("refused", [False, True], ids=["set-aside", "refused"])
def test_depth_stages_kept_in_l2_ask_for_their_bytes(monkeypatch, caplog, refused: bool) -> None:
    """REALTIME_STACK_L2_KEEP=k: the depth stack keeps 1 in k stages, the backbone streams
    evict_first, and the persisting L2 asked for is 1.125 x the depth layers' bytes / k; unset,
    k comes from the GPU's L2 (auto_l2_keep); 0: no hints, nothing asked. Where the runtime
    refuses the set-aside, the engine loads anyway with a warning (the hints stay)."""
    import logging

    from realtime.engines.csm import CSMConfig
    from realtime.engines.transformer import TransformerConfig
    from realtime.kernels import decode_stack_cuda as dsc
    from realtime.kernels.decode_stack import stack_weights

    widths = dict(dim=64, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=128, max_seq_len=16)
    cfg = CSMConfig(backbone=TransformerConfig(n_layers=1, **widths), depth=TransformerConfig(n_layers=3, **widths),
                    num_codebooks=4, text_vocab_size=50)
    model = CSM(cfg)
    model.backbone.fuse_projections()
    model.depth.fuse_projections()
    model.backbone.stack, model.depth.stack = stack_weights(model.backbone), stack_weights(model.depth)
    w = model.depth.stack
    layers = sum(t.numel() * t.element_size() for t in (w.qkv, w.o, w.gate_up, w.down))
    assert w.l2_keep is None and model.backbone.stack.l2_keep is None  # (the launch's default)
    assert w.l2_ahead is None and model.backbone.stack.l2_ahead is None
    assert w.burst is None and model.backbone.stack.burst is None
    assert w.backoff is None and model.backbone.stack.backoff is None
    asked: list = []

    def persist(device, nbytes):  # noqa: ANN001, ANN202
        asked.append(nbytes)
        if refused:
            raise RuntimeError("operation not supported")
        return nbytes

    def sizes(device):  # noqa: ANN001, ANN202  (an L2 that holds a third of the layers, twice that set aside)
        return int(layers / 3 / dsc.L2_KEEP_SHARE), 2 * layers // 3

    monkeypatch.setattr(dsc, "persist_l2", persist)
    monkeypatch.setattr(dsc, "l2_sizes", sizes)
    for keep, k in ((4, 4), (None, 3)):
        monkeypatch.setattr(dsc, "L2_KEEP", keep)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="realtime.engines.csm"):
            model._keep_depth_in_l2()
        assert w.l2_keep == k and model.backbone.stack.l2_keep == -1
        assert w.l2_ahead == model.backbone.stack.l2_ahead == 4  # (prefetches past a full ring)
        assert w.burst == model.backbone.stack.burst == 0  # (no burst of copies: it lost for CSM)
        assert w.backoff == 200 and model.backbone.stack.backoff is None  # (the depth stack's polls sleep)
        assert asked[-1] == layers // k + layers // k // 8 == dsc.keep_set_aside(layers, k)
        assert model.l2_kept == (0 if refused else asked[-1])
        assert ("no persisting L2 set aside" in caplog.text) == refused
    monkeypatch.setattr(dsc, "L2_KEEP", 0)  # off: nothing asked, no hints on either stack
    model._keep_depth_in_l2()
    assert len(asked) == 2 and w.l2_keep == 0 and model.backbone.stack.l2_keep == 0
