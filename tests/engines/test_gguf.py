"""The real SmolLM2-135M-Instruct Q4_1 GGUF: ours equals transformers' own GGUF loading.

Model: same dequantized weights (incl. the q/k un-permutation), same greedy tokens and logits.
Tokenizer: same ids on a few hundred generated strings, same chat template output. Plus the
model answers a simple question. Everything heavy is loaded once per module.
"""

from __future__ import annotations

import random

import pytest
import torch

from pathlib import Path

from realtime.engines.llama import TextModel, default_gguf_path, gguf_model_id
from realtime.engines.tokenizer import StreamDecoder

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers needs it to load GGUF models

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Tell me about the sea in 3 sentences."},
    ],
]


@pytest.fixture(scope="module")
def ours() -> TextModel:
    return TextModel.from_pretrained()


@pytest.fixture(scope="module")
def hf_tok():
    p = default_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


@pytest.fixture(scope="module")
def hf_model():
    p = default_gguf_path()
    m = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    return m.eval()


def test_weights_equal_transformers_gguf_loading(ours: TextModel, hf_model) -> None:
    ref = hf_model.state_dict()
    mine = {f"model.{k}": v for k, v in ours.transformer.state_dict().items()}
    mine["model.embed_tokens.weight"] = ours.embed_tokens.weight
    assert ours.tied and hf_model.config.tie_word_embeddings
    assert set(mine) == {k for k in ref if k != "lm_head.weight"}
    for k, v in mine.items():
        assert torch.equal(v, ref[k]), k


@pytest.fixture(scope="module")
def greedy_runs(ours: TextModel):
    """32 greedy tokens for each prompt, decoded as one continuous batch (rows at different positions).

    Returns (prompts, tokens, logits) with logits [3, 32, V]: prefill's last logits, then each
    decode_step's. Batching the three sessions reads the weights once per step instead of three times.
    """
    tok = ours.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(conv)) for conv in PROMPTS]
    assert len({len(p) for p in prompts}) == 3
    cache = ours.new_cache(4, max(len(p) for p in prompts) + 32)
    slots = torch.tensor([2, 0, 3])
    logits = torch.stack([ours.prefill(cache, int(s), p) for s, p in zip(slots, prompts)])
    pos = torch.tensor([len(p) for p in prompts])
    all_logits, tokens = [], []
    for step in range(32):
        all_logits.append(logits)
        nxt = logits.argmax(-1)
        tokens.append(nxt)
        if step < 31:
            logits = ours.decode_step(cache, slots, nxt, pos + step)
    return prompts, torch.stack(tokens, 1).tolist(), torch.stack(all_logits, 1)


def test_greedy_tokens_and_logits_equal_transformers(greedy_runs, hf_model) -> None:
    prompts, tokens, logits = greedy_runs
    for prompt, got, mine in zip(prompts, tokens, logits):
        seq = torch.tensor([prompt + got])
        with torch.no_grad():
            ref_logits = hf_model(seq).logits[0, len(prompt) - 1 : -1]
        # Teacher-forced check: transformers' argmax at every step is our token, i.e. its greedy
        # generate would produce exactly these 32 tokens (by induction over the steps).
        assert ref_logits.argmax(-1).tolist() == got
        torch.testing.assert_close(mine, ref_logits, rtol=1e-4, atol=2e-4)


def test_batched_equals_solo_generate(ours: TextModel, greedy_runs) -> None:
    prompts, tokens, _ = greedy_runs
    # One session alone (generate: batch of one, its own cache) gives the same tokens as in the batch.
    # (8 tokens: the 16-token solo-vs-batch check runs on a random model in test_llama.py.)
    assert ours.generate(prompts[2], 8, stop_ids=[]) == tokens[2][:8]


def test_answers_capital_of_france(ours: TextModel, greedy_runs) -> None:
    tok = ours.tokenizer
    out = greedy_runs[1][0]
    stop = [i for i, t in enumerate(out) if t in tok.eos_ids]
    assert stop, "the model should end its answer within 32 tokens"
    text = tok.decode(out[: stop[0]])
    assert "Paris" in text, text


def test_model_id_is_the_file_name_without_its_quantisation(ours: TextModel) -> None:
    """/v1/models lists the embedded model as a slug a client can type, not the file's free-text general.name."""
    assert ours.name == "SmolLM2-135M-Instruct"
    for file, want in (("Llama-3.2-1B-Instruct-Q8_0.gguf", "Llama-3.2-1B-Instruct"),
                       ("qwen3-0.6b.BF16.gguf", "qwen3-0.6b"), ("model.IQ4_XS.gguf", "model"),
                       ("tiny.f16.gguf", "tiny"), ("Q4_0.gguf", "Q4_0"), ("plain", "plain")):
        assert gguf_model_id(Path("/m") / file) == want, file


def test_q4_codes_are_the_files_values() -> None:
    """The 4-bit codes and scales cpu_native runs reconstruct every Q4 tensor of the embedded file exactly."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    from realtime.engines.llama import _q4_codes

    n = 0
    for t in gguf.GGUFReader(str(default_gguf_path())).tensors:
        codes = _q4_codes(t)
        if codes is None:
            continue
        q, scale, zero = codes
        w = dequantize(t.data, t.tensor_type).reshape(q.shape)
        assert np.array_equal((q.astype(np.float32) - 8) * np.repeat(scale, 32, 1) + np.repeat(zero, 32, 1), w), t.name
        n += 1
    assert n == 210  # every projection of the 30 layers (the embedding is Q8_0)


def test_cpu_native_answers_like_the_exact_model(ours: TextModel, greedy_runs) -> None:
    """The server's CPU default: same answer, logits within bfloat16 distance of the exact path."""
    native = TextModel.from_pretrained(cpu_native=True)
    tok = native.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
                     add_special=False)
    out = native.generate(ids, 24)
    assert "Paris" in tok.decode(out), tok.decode(out)
    x = torch.tensor([ids])
    a, b = ours.forward(x), native.forward(x)
    assert ((a - b).norm() / a.norm()).item() < 5e-2
    assert (a[0].argmax(-1) == b[0].argmax(-1)).float().mean() > 0.8
    # Every projection is Q4_1 here: [q|k|v] and [gate|up] each run as one 4-bit product.
    h = torch.randn(2, native.config.dim, generator=torch.Generator().manual_seed(3))
    for layer in native.transformer.layers:
        att, mlp = layer.self_attn, layer.mlp
        for fused, lins in ((att.qkv_cpu, (att.q_proj, att.k_proj, att.v_proj)), (mlp.gate_up_cpu, (mlp.gate_proj, mlp.up_proj))):
            assert fused is not None and fused.bf16 is None
            want = torch.nn.functional.linear(h, torch.cat([m.weight for m in lins]))
            assert ((fused(h, None) - want).norm() / want.norm()).item() < 2e-2
    # The LM head (the tied Q8_0 embedding) runs as int8 a row.
    head = native.embed_tokens.weight.cpu_product
    assert head.int8 is not None and head.int8.dtype == torch.int8 and head.int8.shape == native.embed_tokens.weight.shape
    want = torch.nn.functional.linear(h, native.embed_tokens.weight)
    assert ((head(h, None) - want).norm() / want.norm()).item() < 2e-2


def _strings(n: int) -> list[str]:
    rng = random.Random(1234)
    words = ["hello", "world", "The", "don't", "I'LL", "we've", "naïve", "café", "straße", "Ünïcödé", "Привет",
             "мир", "日本語", "中文字符", "한국어", "مرحبا", "שלום", "ελληνικά", "हिन्दी", "ñandú", "x", "A1b2"]
    emoji = ["😀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "❤️", "🦄", "✨"]
    code = ["def f(x):\n    return x**2", "for (int i = 0; i < n; ++i) {", "<div class=\"a\">", "a_b = [1, 2, 3]",
            "SELECT * FROM t WHERE id=42;", "x += 1  # comment", "fn main() -> i32 { 0 }", "\\n\\t", "λx.x"]
    spaces = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\t\t ", "    \n"]
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    out = ["", " ", "   ", "\n", "0", "007", "3.14159", "1,000,000", "2024-01-31", "  leading", "trailing  "]
    while len(out) < n:
        parts = []
        for _ in range(rng.randint(1, 12)):
            r = rng.random()
            if r < 0.35:
                parts.append(rng.choice(words))
            elif r < 0.5:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 9))))
            elif r < 0.6:
                parts.append(rng.choice(emoji))
            elif r < 0.7:
                parts.append(rng.choice(code))
            elif r < 0.75:
                parts.append(rng.choice(specials))
            elif r < 0.85:
                parts.append("".join(rng.choice("!?.,;:'\"()[]{}-_+=*/&%$#@^~`|<>") for _ in range(rng.randint(1, 4))))
            else:
                parts.append(chr(rng.randint(0x20, 0x2FFF)))
            parts.append(rng.choice(spaces) if rng.random() < 0.3 else " ")
        out.append("".join(parts))
    return out


def _space_before_number(s: str) -> bool:
    return any(a.isspace() and b.isnumeric() for a, b in zip(s, s[1:]))


def test_tokenizer_equals_transformers_gguf_tokenizer(ours: TextModel, hf_tok) -> None:
    """Same ids as transformers' GGUF tokenizer, with one documented gap in transformers.

    The GGUF says tokenizer.ggml.pre = "smollm": llama.cpp (and SmolLM's own tokenizer.json) first
    isolates every number character, then applies the GPT-2 byte-level regex. transformers' GGUF
    converter ignores tokenizer.ggml.pre and uses the plain GPT-2 regex, which differs exactly when
    whitespace precedes a number ("a  12": ours "a"," "," ","1","2" vs "a"," "," 1","2" -- no " 1"
    token exists, so the GPT-2 path yields "Ġ" + "1"+... grouped differently). We therefore compare
    (a) strictly against transformers' tokenizer with its pre-tokenizer set to the smollm rule, and
    (b) against the unmodified one on every string without whitespace-before-number, and check that
    the remaining differences are all such strings.
    """
    from tokenizers import Tokenizer, pre_tokenizers

    ref_fixed = Tokenizer.from_str(hf_tok.backend_tokenizer.to_str())
    ref_fixed.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)]
    )
    tok = ours.tokenizer
    assert tok.vocab_size == len(hf_tok)
    assert tok.bos_id == 1 and tok.eos_ids == {2}  # <|im_start|>, <|im_end|> (the GGUF's own ids)
    strings = _strings(300)
    differ = 0
    for s in strings:
        ids = tok.encode(s)
        assert ids == ref_fixed.encode(s, add_special_tokens=False).ids, repr(s)
        plain = hf_tok.encode(s, add_special_tokens=False)
        if ids != plain:
            differ += 1
            assert _space_before_number(s), repr(s)
        else:
            assert tok.encode(s, add_special=True) == hf_tok.encode(s, add_special_tokens=True), repr(s)
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True), repr(s)
        assert tok.decode(ids, skip_special=False) == hf_tok.decode(ids), repr(s)
        # Byte-level BPE round-trips any text.
        assert tok.decode(ids, skip_special=False) == s
    assert sum(not _space_before_number(s) for s in strings) > 100  # (b) covered many strings
    assert tok.encode("x 42") == [tok.token_to_id(t) for t in ("x", "Ġ", "4", "2")]


def test_chat_template_equals_transformers(ours: TextModel, hf_tok) -> None:
    conversations = PROMPTS + [
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Say 'naïve' 😀"},
        ]
    ]
    for conv in conversations:
        for gen in (True, False):
            want = hf_tok.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
            assert ours.tokenizer.apply_chat_template(conv, add_generation_prompt=gen) == want


def test_stream_decoder_never_splits_characters(ours: TextModel) -> None:
    tok = ours.tokenizer
    cases = [("日本語のテキスト 👨‍👩‍👧 and 🇫🇷 flags", 4), ("naïve café — “quotes” …", 4), ("<|im_start|>hi<|im_end|> ok", 2)]
    for s, min_pieces in cases:
        ids = tok.encode(s)
        sd = StreamDecoder(tok)
        pieces = [sd.push(i) for i in ids] + [sd.flush()]
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) == tok.decode(ids)
        assert sum(1 for p in pieces if p) >= min_pieces  # actually incremental


def _write_gguf(path, hf_model, arch: str, qtypes: dict[str, "object"]) -> None:
    """Write a HF model as GGUF the way llama.cpp's converter does (incl. its q/k permutation for llama)."""
    import gguf
    import numpy as np
    from gguf.quants import quantize

    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if arch == "llama":
        w.add_rope_dimension_count(cfg.head_dim)

    def permute(a, n_head):
        return a.reshape(n_head, 2, a.shape[0] // n_head // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)

    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for k, v in hf_model.state_dict().items():
        a = v.float().numpy()
        if k == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif k == "lm_head.weight":
            name = "output.weight"
        elif k == "model.norm.weight":
            name = "output_norm.weight"
        else:
            _, _, i, rest = k.split(".", 3)
            mod, _, kind = rest.rpartition(".")
            name = f"blk.{i}.{names[mod]}.{kind}"
            if arch == "llama" and mod == "self_attn.q_proj":
                a = permute(a, cfg.num_attention_heads)
            elif arch == "llama" and mod == "self_attn.k_proj":
                a = permute(a, cfg.num_key_value_heads)
        q = qtypes.get(name.split(".")[-2], gguf.GGMLQuantizationType.F32) if a.ndim == 2 else gguf.GGMLQuantizationType.F32
        if q == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, np.ascontiguousarray(a))
        elif q == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, quantize(a, q))  # a float16 array: its dtype names the type
        else:
            w.add_tensor(name, quantize(a, q), raw_dtype=q)  # uint8 blocks; the writer derives the shape
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_synthetic_gguf_quant_types_equal_transformers(arch: str, tmp_path) -> None:
    """Random GQA models written as GGUF with several quant types load like transformers loads them."""
    import gguf

    Q = gguf.GGMLQuantizationType
    torch.manual_seed(7)
    common = dict(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  initializer_range=0.1)
    if arch == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
        qtypes = {"attn_q": Q.Q4_0, "attn_k": Q.Q5_1, "attn_v": Q.F16, "attn_output": Q.Q8_0,
                  "ffn_gate": Q.Q4_1, "ffn_up": Q.Q5_0, "ffn_down": Q.BF16, "token_embd": Q.Q8_0, "output": Q.F16}
    else:
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=128))
        qtypes = {"attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1, "attn_output": Q.F16,
                  "ffn_gate": Q.BF16, "ffn_up": Q.Q5_1, "ffn_down": Q.Q5_0, "token_embd": Q.F16, "output": Q.Q8_0}
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, hf, arch, qtypes)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    ours = TextModel.from_pretrained(path)
    assert not ours.tied and ours.config.qk_norm == (arch == "qwen3") and ours.config.n_kv_heads == 1
    ref_sd = ref.state_dict()
    mine = {f"model.{k}": v for k, v in ours.transformer.state_dict().items()}
    mine["model.embed_tokens.weight"] = ours.embed_tokens.weight
    mine["lm_head.weight"] = ours.lm_head.weight
    assert set(mine) == set(ref_sd)
    for k, v in mine.items():
        assert torch.equal(v, ref_sd[k]), k
    # cpu_native: the Q4_0 / Q4_1 projections run from the file's 4-bit codes (q/k rows unpermuted
    # like the weights: a wrong order would be ~100 % off), the rest in bfloat16.
    native = TextModel.from_pretrained(path, cpu_native=True)
    g = torch.Generator().manual_seed(8)
    four_bit = 0
    for layer in native.transformer.layers:
        att, mlp = layer.self_attn, layer.mlp
        for lins, fused in (((att.q_proj, att.k_proj, att.v_proj), att.qkv_cpu), ((mlp.gate_proj, mlp.up_proj), mlp.gate_up_cpu),
                            ((att.o_proj,), None), ((mlp.down_proj,), None)):
            # A group mixing 4-bit and other types gets one product per weight; otherwise one for all.
            prods = [(lins, fused)] if fused is not None else [((m,), m.weight.cpu_product) for m in lins]
            for ms, fast in prods:
                x = torch.randn(3, ms[0].in_features, generator=g)
                want = torch.nn.functional.linear(x, torch.cat([m.weight for m in ms]))
                assert ((fast(x, None) - want).norm() / want.norm()).item() < 2e-2, ms
                four_bit += fast.bf16 is None
    assert four_bit == 2 * 2  # two 4-bit projections a layer, two layers
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(9))
    a, b = ours.forward(ids), native.forward(ids)
    assert ((a - b).norm() / a.norm()).item() < 5e-2
    # And the un-permuted q/k are the original HF ones up to quantization error.
    torch.testing.assert_close(ours.transformer.layers[0].self_attn.k_proj.weight,
                               hf.model.layers[0].self_attn.k_proj.weight, atol=0.05, rtol=0)
    ids = torch.tensor([[3, 14, 15, 9, 26, 5, 35]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids).logits, rtol=1e-4, atol=1e-4)
