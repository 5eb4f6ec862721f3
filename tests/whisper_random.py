"""A random Whisper checkpoint in Hugging Face's format, saved with save_pretrained (the engine's
parity tests and the served translation tests load it)."""

from __future__ import annotations

from pathlib import Path

import torch


def save_random_whisper(d: Path, multilingual: bool, n_mels: int = 80, vocab: int | None = None):  # noqa: ANN201
    """A tiny random Whisper (2 + 2 layers, width 64) saved in ``d``; returns transformers' model."""
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    vocab = vocab or (51865 if multilingual else 51864)
    eot, sot = (50257, 50258) if multilingual else (50256, 50257)
    no_ts = vocab - 1502  # Whisper's fixed layout: <|notimestamps|>, then 1501 timestamps
    cfg = WhisperConfig(
        vocab_size=vocab, num_mel_bins=n_mels, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_source_positions=1500, max_target_positions=448,
        # Wider init than the default 0.02 so the random logits have clear winners: a
        # near-tie would make greedy parity depend on float rounding, not on correctness.
        init_std=0.2, pad_token_id=eot, bos_token_id=eot, eos_token_id=eot,
        decoder_start_token_id=sot,
    )
    model = WhisperForConditionalGeneration(cfg).eval()
    # Like real openai/whisper-* generation configs: the non-speech list plus the task and
    # start tokens, blank + eot suppressed at the first sampled step.
    gen = GenerationConfig(
        decoder_start_token_id=sot, eos_token_id=eot, pad_token_id=eot, bos_token_id=eot,
        no_timestamps_token_id=no_ts, prev_sot_token_id=no_ts - 2, is_multilingual=multilingual,
        suppress_tokens=[1, 2, 7, 8, 9, 10, 14, 25, 26, 27, 28, 29, 31, 58, 59, 60, 61, 62, 63]
        + [no_ts - 5, no_ts - 4, no_ts - 3, no_ts - 2, no_ts - 1, sot],
        begin_suppress_tokens=[220, eot], max_length=448,
    )
    if multilingual:
        gen.lang_to_id = {"<|en|>": 50259, "<|zh|>": 50260, "<|de|>": 50261, "<|es|>": 50262}
        gen.task_to_id = {"translate": no_ts - 5, "transcribe": no_ts - 4}
    model.generation_config = gen
    model.save_pretrained(d)
    return model
