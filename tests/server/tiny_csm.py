"""A random CSM-1B-architecture checkpoint folder at tiny widths, for the server tests and benches."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

SPECIALS = {"<|begin_of_text|>": 290, "<|end_of_text|>": 291, "<|AUDIO|>": 292, "<|audio_eos|>": 293}


def tiny_csm(folder: Path, num_codebooks: int = 4, vocab: int = 16, codebook_size: int = 16, num_filters: int = 4,
             upsampling_ratios: Sequence[int] = (4, 4), max_positions: int = 512) -> None:
    """Write a random CsmForConditionalGeneration (transformers' save_pretrained) and a character
    tokenizer with Llama-3's special ids into ``folder``. Mimi's frame is prod(upsampling_ratios)
    samples (the real 8, 6, 5, 4 gives the real 1920 = 80 ms at 24 kHz); audio ids 0..vocab-1, with
    vocab-1 the codebook pad and 0 the EOS code."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, models

    codec = transformers.MimiConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=32,
        codebook_dim=8, codebook_size=codebook_size, num_filters=num_filters, num_residual_layers=1,
        upsampling_ratios=list(upsampling_ratios), vector_quantization_hidden_dimension=8,
        num_quantizers=num_codebooks, num_semantic_quantizers=1, head_dim=8, upsample_groups=16, sliding_window=8)
    cfg = transformers.CsmConfig(
        num_codebooks=num_codebooks, vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, text_vocab_size=300, max_position_embeddings=max_positions,
        pad_token_id=None, bos_token_id=290, eos_token_id=291, audio_token_id=292, audio_eos_token_id=293,
        codebook_pad_token_id=vocab - 1, codebook_eos_token_id=0,
        depth_decoder_config=dict(num_codebooks=num_codebooks, backbone_hidden_size=32, vocab_size=vocab,
                                  max_position_embeddings=num_codebooks, hidden_size=24, intermediate_size=48,
                                  num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=1),
        codec_config=codec.to_dict())
    torch.manual_seed(0)
    model = transformers.CsmForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # O(1) activations: near-uniform logits would make greedy ties likely
        for name, p in model.named_parameters():
            if name.startswith("codec_model."):
                continue
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif "embed" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 3.0 / math.sqrt(p.shape[-1]))
    model.save_pretrained(folder)
    chars = {chr(c): i for i, c in enumerate(range(32, 127))}
    chars.update(SPECIALS)
    tok = Tokenizer(models.BPE(vocab=chars, merges=[]))
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    tok.save(str(folder / "tokenizer.json"))
