"""CSM-1B (Sesame Conversational Speech Model): dual-autoregressive text-to-speech over Mimi codes.

Two Llama-style stacks (the shared ``engines/transformer.py``):

* the backbone reads one embedding per position -- a text token, or one audio frame as the sum of
  its K codebook embeddings -- and its last hidden state predicts codebook 0 (``lm_head``);
* the depth decoder, run afresh for every frame over positions 0..K-1, reads
  [backbone hidden, embed(c0), ..., embed(c_{K-2})] (projected to its width) and predicts
  codebook k at position k with its own head ``codebooks_head[k-1]``.

The frame's K codes then feed the next backbone step. Generation stops at the frame whose K
codes are all ``codebook_eos_token_id`` (0): the rule of Sesame's reference generator. (HF's
``generate`` stops when codebooks 0..K-2 are 0, ignoring the last one, and keeps that frame in its
output; HF's own audio decoding then cuts at the first frame where all K are 0, as we do.)

Checkpoints are HF folders written by ``CsmForConditionalGeneration.save_pretrained`` (the layout
of the public ``sesame/csm-1b`` repo): ``config.json`` + ``model.safetensors`` (or a sharded index)
[+ ``tokenizer.json``]. The Mimi codec weights stored under ``codec_model.`` are ignored here
(``realtime.codecs.mimi`` owns the codec).

Continuous batching: ``new_batch`` allocates static KV caches for ``n_slots`` sessions;
``prefill`` fills one slot from a prompt; ``step`` produces one frame for any set of slots in one
batched backbone step and K-1 batched depth steps; ``CSMBatchState.reset`` frees slots for reuse.
On CUDA, ``capture_step`` returns ``CSMStepGraphs``, the same step replayed from CUDA graphs (eager
decoding is launch-bound: ~6x faster for CSM-1B on an H200 at batch 1).
Letters: B batch rows, T time (positions), K codebooks, V audio vocab, D backbone width,
Dd depth width.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor, nn

from realtime.cuda_graphs import capture as capture_graph
from realtime.engines.sampling import sample
from realtime.engines.transformer import (KVCache, Transformer, TransformerConfig, project, rope_frequencies,
                                          stack_enabled, use_gemv, use_kernels)
from realtime.errors import ConfigError, ModelFormatError, UnsupportedError

__all__ = ["CSMConfig", "CSMPrompt", "CSMBatchState", "CSM", "CSMStepGraphs", "CSMPrefillGraphs"]

log = logging.getLogger(__name__)

# Llama 3 special-token ids, used only when the checkpoint folder has no tokenizer.json.
_LLAMA3_BEGIN_OF_TEXT = 128000
_LLAMA3_END_OF_TEXT = 128001
_BOS_TEXT = "<|begin_of_text|>"
_EOS_TEXT = "<|end_of_text|>"
# Stages the CUDA stacks prefetch into L2 past a full ring (decode_stack_cuda's ``ahead``): a frame's
# short depth passes gain less from a deep prefetch than a 1B text step (12 there). H100
# (2026-12-07, both stacks, alternating): 197.0 -> 199.4 / 199.6 / 198.9 / 197.7 / 189.9 frames/s
# at 2 / 4 / 6 / 8 / 16 ahead.
_L2_AHEAD = 4
# No burst of copies in flight (decode_stack_cuda's ``burst``; text takes 3): H100 (2026-12-07, both
# stacks, alternating) 201.3 / 200.8 frames/s off, 198.9 / 198.6 at 3, 194.7 / 194.6 at 4; each
# stack alone at 3 (another H100): backbone 201.5 / 201.1, depth 198.3 / 198.8, against 200.6 / 201.2.
_BURST = 0
# The depth decoder's polls sleep this many ns after a word not yet written (decode_stack_cuda's
# ``backoff``; the backbone and text take 0): at the depth shapes every SM polls the same q|k|v
# words, and fewer loads of them in flight let the rows land sooner. H100 (2026-12-07, both runs
# of each, alternating): 199.9 / 200.8 frames/s off, 202.5 / 202.4 at 200 ns, 201.4 / 202.3 at 50,
# 202.3 / 203.1 at 400; 200 on the backbone as well gave nothing more (202.5 / 202.2). Text's step
# lost 0.4-2.3 % at 50-800 ns (stack_probe, same call).
_DEPTH_BACKOFF = 200


@dataclass(frozen=True)
class CSMConfig:
    """Everything the engine needs from a CSM ``config.json``."""

    backbone: TransformerConfig
    depth: TransformerConfig
    num_codebooks: int = 32  # K
    audio_vocab_size: int = 2051  # V, per codebook (2048 Mimi codes + pad/eos slack)
    text_vocab_size: int = 128256
    bos_token_id: int = _LLAMA3_BEGIN_OF_TEXT
    end_of_text_token_id: int = _LLAMA3_END_OF_TEXT
    audio_token_id: int = 128002  # <|AUDIO|>: one per context audio frame
    audio_eos_token_id: int = 128003  # <|audio_eos|>: closes a context audio turn (embedded as the EOS frame)
    codebook_eos_token_id: int = 0
    codebook_pad_token_id: int = 2050
    tie_codebooks_embeddings: bool = True
    frame_rate: float = 12.5  # Mimi frames per second

    def __post_init__(self) -> None:
        if self.num_codebooks < 2:
            raise ConfigError(f"CSM needs at least 2 codebooks, config has num_codebooks={self.num_codebooks}")
        if self.audio_vocab_size <= 0 or self.text_vocab_size <= 0:
            raise ConfigError("CSM vocab sizes must be positive")
        if not 0 <= self.codebook_eos_token_id < self.audio_vocab_size:
            raise ConfigError(f"codebook_eos_token_id={self.codebook_eos_token_id} outside the audio vocab")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "CSMConfig":
        """From a CsmConfig dict (``config.json``); raises ConfigError on anything inconsistent."""
        if hf.get("model_type") != "csm":
            raise ConfigError(f"config.json has model_type={hf.get('model_type')!r}, expected 'csm'")
        dd = hf.get("depth_decoder_config")
        if not isinstance(dd, Mapping):
            raise ConfigError("config.json lacks depth_decoder_config")
        try:
            k = int(hf["num_codebooks"])
            v = int(hf["vocab_size"])
            text_v = int(hf["text_vocab_size"])
            d_model = int(hf["hidden_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"config.json lacks or has a bad {e.args[0]!r}") from None
        backbone = TransformerConfig.from_hf(hf)
        depth = TransformerConfig.from_hf(dd)
        if int(dd.get("num_codebooks", k)) != k:
            raise ConfigError(f"depth decoder num_codebooks={dd.get('num_codebooks')} != backbone {k}")
        if int(dd.get("vocab_size", v)) != v:
            raise ConfigError(f"depth decoder vocab_size={dd.get('vocab_size')} != backbone {v}")
        if int(dd.get("backbone_hidden_size", d_model)) != d_model:
            raise ConfigError(f"depth decoder backbone_hidden_size={dd.get('backbone_hidden_size')} != hidden_size {d_model}")
        eos = hf.get("codebook_eos_token_id", 0)
        if isinstance(eos, list):
            if len(set(eos)) != 1:
                raise UnsupportedError("per-codebook codebook_eos_token_id lists are not supported")
            eos = eos[0]
        end_text = hf.get("eos_token_id")
        if isinstance(end_text, list):
            end_text = end_text[0] if end_text else None

        def _id(name: str, default: int) -> int:
            val = hf.get(name)
            return default if val is None else int(val)

        return cls(
            backbone=backbone,
            depth=depth,
            num_codebooks=k,
            audio_vocab_size=v,
            text_vocab_size=text_v,
            bos_token_id=_id("bos_token_id", _LLAMA3_BEGIN_OF_TEXT),
            end_of_text_token_id=_LLAMA3_END_OF_TEXT if end_text is None else int(end_text),
            audio_token_id=_id("audio_token_id", 128002),
            audio_eos_token_id=_id("audio_eos_token_id", 128003),
            codebook_eos_token_id=int(eos if eos is not None else 0),
            codebook_pad_token_id=_id("codebook_pad_token_id", v - 1),
            tie_codebooks_embeddings=bool(hf.get("tie_codebooks_embeddings", True)),
        )


@dataclass(frozen=True)
class CSMPrompt:
    """One backbone prompt, position by position (T positions).

    ids [T] long: the text token ids exactly as CsmProcessor builds them (``<|AUDIO|>`` once per
        context audio frame, ``<|audio_eos|>`` after it); this is also the HF ``input_ids`` row.
    codes [T, K] long: the audio codes at audio positions (the EOS frame at ``<|audio_eos|>``), 0 elsewhere.
    is_audio [T] bool: positions embedded as the sum of their K code embeddings instead of as text.
    """

    ids: Tensor
    codes: Tensor
    is_audio: Tensor

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def has_audio(self) -> bool:
        return bool(self.is_audio.any())


class CSMBatchState:
    """Per-slot generation state for up to ``n_slots`` concurrent sessions (never on the module).

    backbone_cache: KVCache [L, n_slots, Hkv, max_seq_len, D_head]; depth_cache: the same with K positions
    (rewritten from position 0 for every frame). hidden [n_slots, D]: each slot's last backbone hidden
    state (what the next frame is predicted from). pos [n_slots]: next backbone position (= tokens in the
    cache). frames [n_slots]: frames generated so far (sampling step counter). ``lengths`` mirrors ``pos``
    on the host so capacity checks never sync with the device. All device tensors hold one more row,
    ``scratch`` (= n_slots), where the padding rows of a CUDA-graphed step compute.
    """

    def __init__(self, csm: "CSM", n_slots: int, max_seq_len: int) -> None:
        if n_slots <= 0:
            raise ConfigError(f"n_slots must be positive, got {n_slots}")
        if max_seq_len < 2:
            raise ConfigError(f"max_seq_len must be at least 2, got {max_seq_len}")
        dev, dt = csm.device, csm.dtype
        self.n_slots = n_slots
        self.max_seq_len = max_seq_len
        # One extra, hidden slot: the padding rows of a CUDA-graphed step compute there.
        self.scratch = n_slots
        rows = n_slots + 1
        self.backbone_cache = KVCache(csm.config.backbone, rows, max_seq_len, device=dev, dtype=dt)
        self.depth_cache = KVCache(csm.config.depth, rows, csm.num_codebooks, device=dev, dtype=dt)
        self.hidden = torch.zeros(rows, csm.config.backbone.dim, device=dev, dtype=dt)
        self.pos = torch.zeros(rows, dtype=torch.long, device=dev)
        self.frames = torch.zeros(rows, dtype=torch.long, device=dev)
        self.lengths = [0] * n_slots

    def reset(self, slots: Tensor | Sequence[int]) -> None:
        """Forget the given slots so they can be prefilled again (in place, no reallocation)."""
        idx = torch.as_tensor(slots, dtype=torch.long).reshape(-1)
        for s in idx.tolist():
            if not 0 <= s < self.n_slots:
                raise ConfigError(f"slot {s} outside 0..{self.n_slots - 1}")
            self.lengths[s] = 0
        idx = idx.to(self.pos.device)
        self.backbone_cache.reset(idx)
        self.depth_cache.reset(idx)
        self.hidden[idx] = 0
        self.pos[idx] = 0
        self.frames[idx] = 0


class CSM(nn.Module):
    """The CSM backbone + depth decoder with their embeddings and heads.

    Parameter names are ours; ``from_pretrained`` maps the HF names onto them.
    """

    def __init__(self, config: CSMConfig, tokenizer: Any | None = None) -> None:
        super().__init__()
        self.config = config
        self.tokenizer = tokenizer  # tokenizers.Tokenizer or None
        k, v = config.num_codebooks, config.audio_vocab_size
        d, dd = config.backbone.dim, config.depth.dim
        self.embed_text = nn.Embedding(config.text_vocab_size, d)
        # All K codebooks in one table at offsets k*V: the backbone embeds a frame as the sum over K; the
        # depth decoder has its own table of the same shape (one module shared when the weights are equal).
        self.embed_audio = nn.Embedding(k * v, d)
        self.depth_embed_audio = nn.Embedding(k * v, d)
        self.backbone = Transformer(config.backbone)
        self.lm_head = nn.Linear(d, v, bias=False)  # codebook 0
        self.depth_projector = nn.Linear(d, dd, bias=False)
        self.depth = Transformer(config.depth)
        self.codebooks_head = nn.Parameter(torch.zeros(k - 1, dd, v))  # codebook k uses [k-1]: h @ W
        self.register_buffer("audio_offsets", torch.arange(k) * v, persistent=False)
        # Set by fuse_projections on CUDA: codebook heads as [K-1, V, Dd] (nn.Linear layout, for the
        # GEMV) and which decode-time products take the GEMV.
        self.register_buffer("codebooks_head_t", None, persistent=False)
        # Set by fuse_projections when the depth decoder's one-row step is the CUDA stack: every
        # depth input projected ahead ([K V, Dd]: depth_projector(depth_embed_audio)), so that a
        # depth pass past the first is one kernel (the row gathered, the layers, the codebook head,
        # its code sampled).
        self.register_buffer("depth_inputs", None, persistent=False)
        self.l2_kept = 0  # bytes of L2 set aside for the depth decoder's kept stages (_keep_depth_in_l2)
        self.gemv_lm_head = self.gemv_projector = self.gemv_codebooks = False

    # ------------------------------------------------------------------ properties

    @property
    def num_codebooks(self) -> int:
        return self.config.num_codebooks

    @property
    def audio_vocab_size(self) -> int:
        return self.config.audio_vocab_size

    @property
    def frame_rate(self) -> float:
        return self.config.frame_rate

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> "CSM":
        """Load an HF CSM checkpoint folder (config.json + model.safetensors [+ tokenizer.json])."""
        root = Path(path)
        if not root.is_dir():
            raise ConfigError(f"CSM checkpoint folder {str(root)!r} does not exist")
        cfg_path = root / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"CSM checkpoint folder {str(root)!r} has no config.json")
        try:
            hf_cfg = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read {cfg_path}: {e}") from None
        if not isinstance(hf_cfg, dict):
            raise ConfigError(f"{cfg_path} is not a JSON object")
        config = CSMConfig.from_hf(hf_cfg)
        tokenizer = None
        tok_path = root / "tokenizer.json"
        if tok_path.is_file():
            from tokenizers import Tokenizer

            try:
                tokenizer = Tokenizer.from_file(str(tok_path))
            except Exception as e:  # tokenizers raises a bare Exception on malformed files
                raise ModelFormatError(f"cannot load {tok_path}: {e}") from None
        sd = _read_safetensors(root)
        model = cls._empty(config, tokenizer, torch.device(device), dtype)
        model.load_hf_state_dict(sd)  # copies straight into the device tensors, casting to dtype
        if model.device.type == "cuda" and use_kernels():  # the fast path: fused q|k|v, gate|up GEMMs
            model.fuse_projections()
        return model.eval()

    @classmethod
    def _empty(cls, config: CSMConfig, tokenizer: Any | None, device: torch.device, dtype: torch.dtype) -> "CSM":
        """A CSM with uninitialised weights on ``device`` in ``dtype`` (the strict loader overwrites
        every one). Built on the meta device: random init of CSM-1B takes ~45 s on a small CPU, and this
        way the weights exist once, on the device, at their final precision."""
        try:
            with torch.device("meta"):
                model = cls(config, tokenizer)
            model.to_empty(device=device)
        except (NotImplementedError, RuntimeError):  # a submodule that cannot leave the meta device
            return cls(config, tokenizer).to(device=device, dtype=dtype)
        model.to(dtype=dtype)
        # Non-persistent buffers are not in the checkpoint: recompute what to_empty left undefined
        # (on the CPU, like HF, then moved; inv_freq stays float32).
        model.audio_offsets = (torch.arange(config.num_codebooks) * config.audio_vocab_size).to(device)
        for stack in (model.backbone, model.depth):
            stack.inv_freq = rope_frequencies(stack.cfg).to(device)
        return model

    def load_hf_state_dict(self, sd: Mapping[str, Tensor]) -> None:
        """Take weights from an HF CsmForConditionalGeneration state dict (strict; codec_model.* ignored)."""
        cfg = self.config
        sd = {k: t for k, t in sd.items() if not k.startswith("codec_model.")}
        bb_embed = "backbone_model.embed_tokens.embed_audio_tokens.weight"
        dd_embed = "depth_decoder.model.embed_tokens.weight"
        own: dict[str, str] = {  # HF key -> our parameter name
            "embed_text_tokens.weight": "embed_text.weight",
            "lm_head.weight": "lm_head.weight",
            "depth_decoder.model.inputs_embeds_projector.weight": "depth_projector.weight",
            "depth_decoder.codebooks_head.weight": "codebooks_head",
            bb_embed: "embed_audio.weight",
            dd_embed: "depth_embed_audio.weight",
        }
        # transformers 5.x does not tie the two codebook tables at run time (CsmConfig forces
        # tie_word_embeddings=False), so when a folder stores both we use each where HF uses it. A
        # folder storing only one copy is accepted when config.json declares them tied.
        missing = [key for key in own if key not in sd]
        one_table = None
        if cfg.tie_codebooks_embeddings and missing in ([bb_embed], [dd_embed]):
            one_table = bb_embed if bb_embed in sd else dd_embed
            missing = []
        stacks = ("backbone_model.layers.", "backbone_model.norm.", "depth_decoder.model.layers.", "depth_decoder.model.norm.")
        unexpected = [key for key in sd if key not in own and not key.startswith(stacks)]
        if missing or unexpected:
            parts = []
            if missing:
                parts.append("missing: " + ", ".join(missing))
            if unexpected:
                parts.append("unexpected: " + ", ".join(sorted(unexpected)[:20]))
            raise ModelFormatError("CSM checkpoint does not match the CSM layout (" + " | ".join(parts) + ")")
        if one_table is not None:
            own[bb_embed] = own[dd_embed] = "embed_audio.weight"
            sd = {**sd, bb_embed: sd[one_table], dd_embed: sd[one_table]}
        params = dict(self.named_parameters(remove_duplicate=False))
        bad = [
            f"{key}: {tuple(sd[key].shape)} vs expected {tuple(params[name].shape)}"
            for key, name in own.items()
            if tuple(sd[key].shape) != tuple(params[name].shape)
        ]
        if bad:
            raise ModelFormatError("CSM checkpoint tensors do not match config.json (" + "; ".join(bad) + ")")
        # Equal tables (the public checkpoint) share one module: saves K*V*D weights of device memory.
        if one_table is not None or torch.equal(sd[bb_embed], sd[dd_embed]):
            self.depth_embed_audio = self.embed_audio
            own[dd_embed] = "embed_audio.weight"
        elif self.depth_embed_audio is self.embed_audio:
            w = self.embed_audio.weight
            self.depth_embed_audio = nn.Embedding(*w.shape, device=w.device, dtype=w.dtype)
        params = dict(self.named_parameters(remove_duplicate=False))
        self.backbone.load_hf_state_dict(sd, "backbone_model.")
        self.depth.load_hf_state_dict(sd, "depth_decoder.model.")
        with torch.no_grad():
            for hf_key, name in own.items():
                params[name].copy_(sd[hf_key])

    # ------------------------------------------------------------------ prompts

    def _special_id(self, text: str, default: int) -> int:
        if self.tokenizer is not None:
            tid = self.tokenizer.token_to_id(text)
            if tid is not None:
                return int(tid)
        return default

    def tokenize(self, text: str, speaker: int = 0) -> list[int]:
        """``<|begin_of_text|>[speaker]text<|end_of_text|>`` as token ids (needs tokenizer.json)."""
        if self.tokenizer is None:
            raise ConfigError("this CSM checkpoint has no tokenizer.json; pass token ids instead of text")
        if speaker < 0:
            raise UnsupportedError(f"speaker must be >= 0, got {speaker}")
        body = self.tokenizer.encode(f"[{int(speaker)}]{text}", add_special_tokens=False).ids
        bos = self._special_id(_BOS_TEXT, self.config.bos_token_id)
        eos = self._special_id(_EOS_TEXT, self.config.end_of_text_token_id)
        return [bos, *body, eos]

    def prompt_from_ids(self, input_ids: Tensor) -> CSMPrompt:
        """A text-only prompt from raw ids [T] or [1, T] (every position embedded as text, like HF
        ``generate(input_ids)`` without ``input_values``)."""
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1).cpu()
        if ids.numel() == 0:
            raise UnsupportedError("empty prompt")
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.text_vocab_size:
            raise UnsupportedError(f"token ids must lie in 0..{self.config.text_vocab_size - 1}")
        t = ids.numel()
        return CSMPrompt(ids, torch.zeros(t, self.num_codebooks, dtype=torch.long), torch.zeros(t, dtype=torch.bool))

    def build_prompt(
        self,
        text: str | Sequence[int],
        speaker: int = 0,
        context: Sequence[tuple[int, str | Sequence[int], Tensor | None]] = (),
    ) -> CSMPrompt:
        """Prompt for one utterance after optional context turns, as CsmProcessor lays it out.

        Each turn is ``<|begin_of_text|>[speaker]text<|end_of_text|>``; a context turn with audio codes
        [F, K] adds ``<|AUDIO|>`` x F + ``<|audio_eos|>`` (the voice reference / conversation history).
        ``text`` may be a string (needs tokenizer.json) or the already tokenised ids of that whole turn.
        """
        k = self.num_codebooks
        ids: list[int] = []
        codes: list[Tensor] = []
        audio: list[bool] = []

        def _text(seg: str | Sequence[int], spk: int) -> None:
            tok = self.tokenize(seg, spk) if isinstance(seg, str) else [int(i) for i in seg]
            ids.extend(tok)
            codes.append(torch.zeros(len(tok), k, dtype=torch.long))
            audio.extend([False] * len(tok))

        for turn in context:
            if len(turn) != 3:
                raise UnsupportedError("context turns are (speaker, text, codes[F, K] or None)")
            spk, seg, frames = turn
            _text(seg, spk)
            if frames is None:
                continue
            frames = torch.as_tensor(frames, dtype=torch.long).cpu()
            if frames.ndim != 2 or frames.shape[1] != k or frames.shape[0] == 0:
                raise UnsupportedError(f"context audio codes must be [frames, {k}], got {tuple(frames.shape)}")
            if int(frames.min()) < 0 or int(frames.max()) >= self.audio_vocab_size:
                raise UnsupportedError(f"context audio codes must lie in 0..{self.audio_vocab_size - 1}")
            f = frames.shape[0]
            ids.extend([self.config.audio_token_id] * f + [self.config.audio_eos_token_id])
            codes.append(frames)
            codes.append(torch.full((1, k), self.config.codebook_eos_token_id, dtype=torch.long))
            audio.extend([True] * (f + 1))
        _text(text, speaker)
        ids_t = torch.tensor(ids, dtype=torch.long)
        if int(ids_t.min()) < 0 or int(ids_t.max()) >= self.config.text_vocab_size:
            raise UnsupportedError(f"token ids must lie in 0..{self.config.text_vocab_size - 1}")
        return CSMPrompt(ids_t, torch.cat(codes), torch.tensor(audio, dtype=torch.bool))

    # ------------------------------------------------------------------ building blocks

    def embed_frames(self, codes: Tensor) -> Tensor:
        """codes [..., K] -> backbone input embeddings [..., D] (sum of the K codebook embeddings)."""
        return self.embed_audio(codes + self.audio_offsets).sum(dim=-2)

    def embed_prompt(self, prompt: CSMPrompt) -> Tensor:
        """prompt (T positions) -> backbone input embeddings [T, D]."""
        dev = self.device
        x = self.embed_text(prompt.ids.to(dev))
        if prompt.has_audio:
            a = self.embed_frames(prompt.codes.to(dev))
            x = torch.where(prompt.is_audio.to(dev)[:, None], a, x)
        return x

    def _depth_input(self, codes: Tensor, codebook: int) -> Tensor:
        """codes [B] of codebook ``codebook`` -> depth decoder input [B, Dd]."""
        e = self.depth_embed_audio(codes + codebook * self.audio_vocab_size)
        return project(e, self.depth_projector.weight, None, self.gemv_projector)

    def _codebook_logits(self, h: Tensor, codebook: int) -> Tensor:
        """Depth hidden states h [B, Dd] -> logits [B, V] of codebook ``codebook`` (1..K-1), in h's dtype."""
        if self.codebooks_head_t is not None:
            return project(h, self.codebooks_head_t[codebook - 1], None, self.gemv_codebooks)
        return h @ self.codebooks_head[codebook - 1]

    @torch.no_grad()
    def backbone_logits(self, prompt: CSMPrompt | Tensor) -> tuple[Tensor, Tensor]:
        """Cache-free forward over a whole prompt: (codebook-0 logits [T, V] float32, hidden [T, D])."""
        if not isinstance(prompt, CSMPrompt):
            prompt = self.prompt_from_ids(prompt)
        x = self.embed_prompt(prompt)[None]
        pos = torch.arange(x.shape[1], device=self.device)[None]
        h = self.backbone(x, pos)[0]
        return self.lm_head(h).float(), h

    @torch.no_grad()
    def depth_logits(self, hidden: Tensor, codes: Tensor) -> Tensor:
        """Teacher-forced, cache-free depth pass: hidden [B, D], codes [B, K] -> logits [B, K-1, V]
        (row k-1 predicts codebook k from hidden and codes 0..k-1)."""
        k = self.num_codebooks
        b = hidden.shape[0]
        x = [self.depth_projector(hidden.to(self.dtype))]
        x += [self._depth_input(codes[:, i], i) for i in range(k - 1)]
        pos = torch.arange(k, device=self.device)[None].expand(b, k)
        h = self.depth(torch.stack(x, dim=1), pos)  # [B, K, Dd]
        return torch.einsum("bkd,kdv->bkv", h[:, 1:], self.codebooks_head).float()

    # ------------------------------------------------------------------ batched generation

    def new_batch(self, n_slots: int, max_seq_len: int | None = None) -> CSMBatchState:
        """Static caches for ``n_slots`` sessions of up to ``max_seq_len`` backbone positions
        (prompt + generated frames; default the config's max_position_embeddings)."""
        return CSMBatchState(self, n_slots, int(max_seq_len or self.config.backbone.max_seq_len))

    @torch.no_grad()
    def prefill(self, state: CSMBatchState, slot: int, prompt: CSMPrompt | Tensor) -> None:
        """Run the prompt through the backbone into ``slot`` (reset first; it starts over at position 0)."""
        self.prefill_many(state, [slot], [prompt])

    @torch.no_grad()
    def prefill_many(self, state: CSMBatchState, slots: Sequence[int], prompts: Sequence[CSMPrompt | Tensor],
                     graphs: "CSMPrefillGraphs | None" = None) -> None:
        """Prefill several slots in one batched backbone pass (each slot reset first, starting at 0).

        The prompts are right-padded to the longest; causal attention keeps a real position from
        seeing the padding after it, so each slot ends exactly as its own ``prefill`` would leave
        it. ``graphs`` (from ``capture_prefill``) replays the pass from a CUDA graph when one of its
        buckets holds the batch.
        """
        prompts = [p if isinstance(p, CSMPrompt) else self.prompt_from_ids(p) for p in prompts]
        if len(slots) != len(prompts) or not prompts:
            raise ConfigError(f"prefill_many needs one prompt per slot, got {len(slots)} slots and {len(prompts)} prompts")
        if len(set(slots)) != len(slots):
            raise ConfigError(f"prefill_many got duplicate slots {list(slots)}")
        for slot, prompt in zip(slots, prompts, strict=True):
            if not 0 <= slot < state.n_slots:
                raise ConfigError(f"slot {slot} outside 0..{state.n_slots - 1}")
            if not 0 < len(prompt) < state.max_seq_len:
                raise UnsupportedError(f"prompt of {len(prompt)} positions does not fit the {state.max_seq_len}-position cache")
        # Zero the slots first: masked-out stale keys cannot matter, but a NaN left in a stale value row
        # would survive its zero attention weight (0 * NaN).
        state.reset(list(slots))
        lengths = [len(p) for p in prompts]
        if graphs is not None and graphs.fits(len(prompts), max(lengths)):
            graphs(slots, prompts)
        else:
            rows = _pad_prompts(prompts, max(lengths), len(prompts), self.num_codebooks)
            dev = self.device
            self._prefill_rows(state, torch.tensor(list(slots), dtype=torch.long, device=dev),
                               *(t.to(dev) for t in rows), torch.tensor(lengths, device=dev))
        for slot, t in zip(slots, lengths, strict=True):
            state.lengths[slot] = t

    def _prefill_rows(self, state: CSMBatchState, slots: Tensor, ids: Tensor, codes: Tensor, is_audio: Tensor,
                      lengths: Tensor) -> None:
        """The device part of ``prefill_many``: slots [B], ids [B, T], codes [B, T, K], is_audio [B, T],
        lengths [B] (>= 1) -> the slots' cache, hidden state and position. No host syncs: capturable.
        Rows past a prompt's length are padding; padding rows may use the scratch slot."""
        b, t = ids.shape
        x = torch.where(is_audio[..., None], self.embed_frames(codes), self.embed_text(ids))  # [B, T, D]
        pos = torch.arange(t, device=ids.device)[None].expand(b, t)
        h = self.backbone(x, pos, state.backbone_cache, slots, fresh=True)
        state.hidden[slots] = h[torch.arange(b, device=ids.device), lengths - 1]
        state.pos[slots] = lengths
        state.frames.index_fill_(0, slots, 0)  # (a Python 0 assigned by index would copy from the host)
        state.pos[state.scratch:].zero_()  # a padding row in the scratch slot: keep it at 0

    def capture_prefill(self, state: CSMBatchState, batches: Sequence[int] = (1, 4, 16),
                        lengths: Sequence[int] = (32, 64, 128, 256, 512)) -> "CSMPrefillGraphs":
        """CUDA graphs of ``prefill_many`` for each (batch, padded length) bucket (see CSMPrefillGraphs)."""
        return CSMPrefillGraphs(self, state, batches, lengths)

    @torch.no_grad()
    def step(
        self,
        state: CSMBatchState,
        slots: Tensor,
        temperature: Tensor,
        top_k: Tensor,
        seeds: Tensor,
    ) -> Tensor:
        """One audio frame for each of the B given (prefilled) slots -> codes [B, K] long.

        slots [B] long (distinct); temperature [B] (<= 0: greedy); top_k [B] long (0: off); seeds [B]
        long. The sampling counter of codebook k in frame f is f*K + k, so a slot's output depends only
        on its own prompt, seed and parameters, not on its batch mates. One backbone step (codebook 0
        from each slot's stored hidden state), K-1 depth steps (codebooks 1..K-1), then one backbone
        step that consumes the new frame and stores the hidden state for the next call. A row whose K
        codes are all ``codebook_eos_token_id`` is finished; the caller stops it (see ``is_eos``).
        """
        _check_rows(state, slots)
        dev = self.device
        return self._step_rows(
            state,
            torch.as_tensor(slots, dtype=torch.long).to(dev, non_blocking=True),
            torch.as_tensor(temperature).to(dev, torch.float32, non_blocking=True),
            torch.as_tensor(top_k).to(dev, torch.long, non_blocking=True),
            torch.as_tensor(seeds).to(dev, torch.long, non_blocking=True),
        )

    def _step_rows(self, state: CSMBatchState, slots: Tensor, temperature: Tensor, top_k: Tensor, seeds: Tensor) -> Tensor:
        """The device part of ``step`` (all inputs already on the device): no host syncs, no
        data-dependent Python control flow, so it can be captured in a CUDA graph."""
        codes = self._codes_rows(state, slots, temperature, top_k, seeds)
        self._feed_rows(state, slots, codes)
        return codes

    def _codes_rows(self, state: CSMBatchState, slots: Tensor, temperature: Tensor, top_k: Tensor, seeds: Tensor) -> Tensor:
        """The first part of a step: the frame's K codes [B, K] from each slot's stored hidden state
        (codebook 0 from the backbone head, 1..K-1 from the depth decoder). Changes no slot state
        but the depth cache, so the frame can leave before ``_feed_rows`` runs."""
        k, dev = self.num_codebooks, self.device
        b = slots.shape[0]
        fused = b == 1 and self.depth_inputs is not None and self.depth.stack_cuda
        if fused:  # the in-kernel sampler's per-row tensors, once a frame; its codes land in `codes`
            codes = torch.empty(1, k, dtype=torch.long, device=dev)
            rows = (temperature.to(dev, torch.float32).reshape(1), top_k.to(dev, torch.long).reshape(1),
                    seeds.to(dev, torch.long).reshape(1))
        top_p = torch.ones(b, device=dev)
        step0 = state.frames[slots] * k

        # Codebook 0 from the backbone hidden state of the previous position.
        hidden = state.hidden[slots]  # [B, D]
        # Logits stay in the model dtype: both samplers compute in float32 from them.
        c = _sample(project(hidden, self.lm_head.weight, None, self.gemv_lm_head), temperature, top_k, top_p, seeds, step0)
        out = [c]
        # Depth decoder: positions 0 and 1 in one pass, then one position per codebook.
        proj = project(hidden, self.depth_projector.weight, None, self.gemv_projector)
        x = torch.stack([proj, self._depth_input(c, 0)], dim=1)  # [B, 2, Dd]
        positions = torch.arange(k, device=dev)[None].expand(b, k)  # views of it: no kernel per pass
        pos = positions[:, :2]
        for cb in range(1, k):
            if fused and cb > 1:
                # one kernel: codebook cb-1's input row gathered, the layers, codebook cb's head and
                # its code sampled (as _sample samples it: the same steps and noise)
                r = self.depth.decode_row_fused(
                    self.depth_inputs, c, positions[0, cb:cb + 1], state.depth_cache, slots,
                    self.codebooks_head_t[cb - 1], (cb - 1) * self.audio_vocab_size,
                    sample=(*rows, step0.reshape(1), cb), token=codes[0, cb:cb + 1])
                if r is not None:
                    c = r[2]
                    out.append(c)
                    continue
            if cb > 1:
                x = self._depth_input(c, cb - 1)[:, None]
                pos = positions[:, cb:cb + 1]
            h = self.depth(x, pos, state.depth_cache, slots)[:, -1]  # [B, Dd]
            c = _sample(self._codebook_logits(h, cb), temperature, top_k, top_p, seeds, step0 + cb)
            out.append(c)
        return torch.stack(out, dim=1)  # [B, K]

    def _feed_rows(self, state: CSMBatchState, slots: Tensor, codes: Tensor) -> None:
        """The second part of a step: feed the frame back through one backbone step; its hidden
        state predicts the next frame. Then the slots' positions and frame counters advance."""
        p = state.pos[slots]
        h = self.backbone(self.embed_frames(codes)[:, None], p[:, None], state.backbone_cache, slots)
        state.hidden[slots] = h[:, 0]
        state.pos[slots] = p + 1
        state.frames[slots] += 1
        # Padding rows of a graphed step run in the scratch slot: pin it at position 0 so it never
        # walks off the cache however many steps it takes part in.
        state.pos[state.scratch :].zero_()
        state.frames[state.scratch :].zero_()

    def fuse_projections(self) -> None:
        """The CUDA fast path's weight layout, after loading: q|k|v and gate|up fused in both stacks
        (see Transformer.fuse_projections), the codebook heads transposed for the GEMV, and for each
        decode-time product the faster of the GEMV and cuBLAS (measured once per shape)."""
        self.backbone.fuse_projections()
        self.depth.fuse_projections()
        if stack_enabled("csm"):  # both stacks' one-token steps as one persistent kernel each
            self.backbone.enable_decode_stack()
            self.depth.enable_decode_stack()
        with torch.no_grad():
            self.codebooks_head_t = self.codebooks_head.detach().transpose(1, 2).contiguous()
        self.gemv_lm_head = use_gemv(self.lm_head.weight)
        self.gemv_projector = use_gemv(self.depth_projector.weight)
        self.gemv_codebooks = use_gemv(self.codebooks_head_t[0])
        if self.depth.stack_cuda:  # (bf16 on an sm_90 GPU: see decode_row_fused)
            self.depth_inputs = self.project_depth_inputs()
            self._keep_depth_in_l2()

    def _keep_depth_in_l2(self) -> None:
        """Every k-th stage of the depth decoder's layers stays in L2 across a frame's 31 passes
        (evict_last, the persisting L2 set aside for about that many bytes), and the backbone
        streams evict_first, so that its step does not push them out. k: REALTIME_STACK_L2_KEEP,
        or ``auto_l2_keep`` for this GPU where unset; 0: no L2 hints (nothing set aside). Both
        stacks also prefetch ``_L2_AHEAD`` stages past a full ring (REALTIME_STACK_L2_AHEAD
        overrides it at the launch), and take no burst of copies in flight (``_BURST``;
        REALTIME_STACK_BURST overrides it). The depth stack's polls back off ``_DEPTH_BACKOFF`` ns
        (REALTIME_STACK_BACKOFF overrides it)."""
        from realtime.kernels import decode_stack_cuda as dsc

        w = self.depth.stack
        for st in (w, self.backbone.stack):
            if st is not None:
                st.l2_ahead = _L2_AHEAD
                st.burst = _BURST
        if w is not None:
            w.backoff = _DEPTH_BACKOFF
        k = dsc.L2_KEEP
        if k == 0:
            w.l2_keep = 0
            if self.backbone.stack is not None:
                self.backbone.stack.l2_keep = 0
            return
        layers = w.layer_bytes
        try:
            if k is None:
                l2, most = dsc.l2_sizes(w.qkv.device)
                k = dsc.auto_l2_keep(layers, l2, most)
            w.l2_keep = k
            if self.backbone.stack is not None:
                self.backbone.stack.l2_keep = -1
            self.l2_kept = dsc.persist_l2(w.qkv.device, dsc.keep_set_aside(layers, k))
        except RuntimeError as exc:  # (the hints still order L2's evictions, with no set-aside)
            self.l2_kept = 0
            if w.l2_keep is None:
                w.l2_keep = -1
            log.warning("REALTIME_STACK_L2_KEEP=%s: no persisting L2 set aside (%s); the copies keep their hints",
                        dsc.L2_KEEP if dsc.L2_KEEP is not None else "auto", exc)

    @torch.no_grad()
    def project_depth_inputs(self) -> Tensor:
        """depth_projector(depth_embed_audio(i)) for every row i of the depth embedding, [K V, Dd]
        in the model dtype: float32 sums rounded once, as the GEMV of ``_depth_input`` rounds them
        (the summation order differs)."""
        e, w = self.depth_embed_audio.weight, self.depth_projector.weight
        out = torch.empty(e.shape[0], w.shape[0], device=e.device, dtype=e.dtype)
        for i in range(0, e.shape[0], 8192):  # (float32 copies of 8192 rows at a time)
            out[i:i + 8192] = nn.functional.linear(e[i:i + 8192].float(), w.float()).to(e.dtype)
        return out

    def capture_step(self, state: CSMBatchState, sizes: Sequence[int] = (1, 2, 4, 8, 16, 32)) -> "CSMStepGraphs":
        """CUDA graphs of ``step`` for batches padded up to each of ``sizes`` (see CSMStepGraphs)."""
        return CSMStepGraphs(self, state, sizes)

    def is_eos(self, codes: Tensor) -> Tensor:
        """codes [B, K] -> [B] bool: True for the end-of-speech frame (all K codes are the EOS code)."""
        return (codes == self.config.codebook_eos_token_id).all(dim=-1)

    @torch.no_grad()
    def generate_codes(
        self,
        input_ids: Tensor | CSMPrompt,
        max_frames: int,
        greedy: bool = True,
        temperature: float = 0.9,
        top_k: int = 50,
        seed: int = 0,
    ) -> Tensor:
        """Generate up to ``max_frames`` frames for one prompt -> codes [frames, K] long (on the CPU).

        input_ids [1, T] text ids (or a CSMPrompt from ``build_prompt``). Stops before the first
        all-EOS frame (that frame is not returned). A thin loop over new_batch/prefill/step with one slot.
        """
        prompt = input_ids if isinstance(input_ids, CSMPrompt) else self.prompt_from_ids(input_ids)
        if max_frames < 0:
            raise UnsupportedError(f"max_frames must be >= 0, got {max_frames}")
        state = self.new_batch(1, len(prompt) + max_frames + 1)
        self.prefill(state, 0, prompt)
        slots = torch.zeros(1, dtype=torch.long)
        temp = torch.tensor([0.0 if greedy else float(temperature)])
        tk = torch.tensor([int(top_k)], dtype=torch.long)
        seeds = torch.tensor([int(seed)], dtype=torch.long)
        frames: list[Tensor] = []
        for _ in range(max_frames):
            codes = self.step(state, slots, temp, tk, seeds)[0].cpu()  # one host sync per frame
            if bool((codes == self.config.codebook_eos_token_id).all()):
                break
            frames.append(codes)
        if not frames:
            return torch.zeros(0, self.num_codebooks, dtype=torch.long)
        return torch.stack(frames)


def _sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seeds: Tensor, steps: Tensor) -> Tensor:
    """The engine sampler; with the kernels on and CUDA logits, the fused Triton sampler (one kernel
    instead of ~60; the same tokens). CSM never uses top-p (``top_p`` is all ones here), which is the
    one thing the fused sampler leaves out."""
    if use_kernels() and logits.is_cuda:
        from realtime.kernels.sampling import sample as fused_sample

        return fused_sample(logits, temperature, top_k, seeds, steps)
    return sample(logits, temperature, top_k, top_p, seeds, steps)


def _check_rows(state: CSMBatchState, slots: Tensor | Sequence[int]) -> None:
    """Host-side checks of a step's slots (skipped for slots already on a GPU: that would sync)."""
    slots = torch.as_tensor(slots)
    if slots.device.type != "cpu":
        return
    listed = slots.tolist()
    if len(set(listed)) != len(listed):
        raise ConfigError(f"step got duplicate slots {listed}")
    for s in listed:
        if not 0 <= s < state.n_slots or state.lengths[s] == 0:
            raise ConfigError(f"slot {s} was not prefilled")
        if state.lengths[s] >= state.max_seq_len:
            raise UnsupportedError(f"slot {s} is full ({state.max_seq_len} positions)")
    for s in listed:
        state.lengths[s] += 1


class CSMStepGraphs:
    """``CSM.step`` replayed from CUDA graphs, two per padded batch size: the frame's codes, then
    the backbone step that feeds the frame back.

    Eager decoding launches thousands of small kernels per frame (K-1 depth passes, 2K samplers), so it
    is bound by launch overhead; a graph replays them at once. Call it like ``step``: slots [B] (CPU,
    distinct), temperature [B], top_k [B], seeds [B] -> codes [B, K]. B is padded to the smallest
    captured size >= B with rows in the state's scratch slot; B above the largest size runs eagerly.
    With ``to_host`` the codes come back on the host as soon as the first graph has made them,
    while the feed-back step still runs: the frame can be decoded to audio one backbone step sooner.
    The graphs hold the state's tensors: use them with that state only.
    """

    def __init__(self, csm: CSM, state: CSMBatchState, sizes: Sequence[int]) -> None:
        if csm.device.type != "cuda":
            raise UnsupportedError("CUDA graphs need a CUDA device")
        self.csm, self.state = csm, state
        self.sizes = sorted({int(n) for n in sizes if int(n) > 0})
        if not self.sizes:
            raise ConfigError("capture_step needs at least one positive batch size")
        dev = csm.device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph, list[Tensor], Tensor]] = {}
        for n in sorted(self.sizes, reverse=True):  # largest first: smaller ones reuse its pool memory
            inputs = [
                torch.full((n,), state.scratch, dtype=torch.long, device=dev),
                torch.zeros(n, dtype=torch.float32, device=dev),
                torch.zeros(n, dtype=torch.long, device=dev),
                torch.zeros(n, dtype=torch.long, device=dev),
            ]
            codes_graph, out = capture_graph(lambda: csm._codes_rows(state, *inputs), self.pool, warmups=2)
            feed_graph, _ = capture_graph(lambda: csm._feed_rows(state, inputs[0], out), self.pool, warmups=2)
            self.graphs[n] = (codes_graph, feed_graph, inputs, out)
        self._host = torch.empty((self.sizes[-1], csm.num_codebooks), dtype=torch.long, pin_memory=True)
        self._ready = torch.cuda.Event()

    @torch.no_grad()
    def __call__(self, slots: Tensor, temperature: Tensor, top_k: Tensor, seeds: Tensor,
                 to_host: bool = False) -> Tensor:
        slots = torch.as_tensor(slots, dtype=torch.long).cpu()
        b = slots.shape[0]
        n = next((m for m in self.sizes if m >= b), None)
        if n is None:
            codes = self.csm.step(self.state, slots, temperature, top_k, seeds)
            return codes.cpu() if to_host else codes
        _check_rows(self.state, slots)
        codes_graph, feed_graph, (g_slots, g_temp, g_topk, g_seeds), out = self.graphs[n]
        pad = n - b
        g_slots.copy_(torch.cat([slots, torch.full((pad,), self.state.scratch, dtype=torch.long)]), non_blocking=True)
        g_temp.copy_(torch.cat([torch.as_tensor(temperature, dtype=torch.float32).cpu(), torch.zeros(pad)]), non_blocking=True)
        g_topk.copy_(torch.cat([torch.as_tensor(top_k, dtype=torch.long).cpu(), torch.zeros(pad, dtype=torch.long)]), non_blocking=True)
        g_seeds.copy_(torch.cat([torch.as_tensor(seeds, dtype=torch.long).cpu(), torch.zeros(pad, dtype=torch.long)]), non_blocking=True)
        codes_graph.replay()
        if to_host:
            host = self._host[:b]
            host.copy_(out[:b], non_blocking=True)
            self._ready.record()
            feed_graph.replay()
            self._ready.synchronize()  # the codes only: the feed-back step keeps running
            return host.clone()
        codes = out[:b].clone()
        feed_graph.replay()
        return codes


def _pad_prompts(prompts: Sequence[CSMPrompt], t: int, b: int, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Prompts right-padded into host tensors ids [b, t], codes [b, t, K], is_audio [b, t] (rows past
    len(prompts) and positions past each prompt: text id 0)."""
    ids = torch.zeros(b, t, dtype=torch.long)
    codes = torch.zeros(b, t, k, dtype=torch.long)
    is_audio = torch.zeros(b, t, dtype=torch.bool)
    for i, p in enumerate(prompts):
        n = len(p)
        ids[i, :n] = p.ids
        codes[i, :n] = p.codes
        is_audio[i, :n] = p.is_audio
    return ids, codes, is_audio


class CSMPrefillGraphs:
    """``CSM.prefill_many`` replayed from CUDA graphs, one per (batch, padded length) bucket.

    An eager prefill of CSM-1B is ~250 kernel launches from Python, ~10x its GPU time at the short
    prompts speech starts with, and a burst of new streams queued them one by one. A replay costs
    the GPU time of the bucket's padded shape. Call through ``CSM.prefill_many(..., graphs=...)``,
    which resets the slots and keeps the host-side lengths; ``fits(B, T)`` says whether a bucket
    holds the batch. The graphs hold the state's tensors: use them with that state only.
    """

    def __init__(self, csm: CSM, state: CSMBatchState, batches: Sequence[int], lengths: Sequence[int]) -> None:
        if csm.device.type != "cuda":
            raise UnsupportedError("CUDA graphs need a CUDA device")
        self.csm, self.state = csm, state
        self.batches = sorted({int(n) for n in batches if int(n) > 0})
        if not self.batches or not any(int(n) > 0 for n in lengths):
            raise ConfigError("capture_prefill needs positive batch sizes and lengths")
        # A prompt fills at most max_seq_len - 1 positions: longer buckets shrink to that.
        self.lengths = sorted({min(int(n), state.max_seq_len - 1) for n in lengths if int(n) > 0})
        dev, k = csm.device, csm.num_codebooks
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, list[Tensor]]] = {}
        # Largest first: the smaller graphs reuse its pool memory.
        for b in reversed(self.batches):
            for t in reversed(self.lengths):
                inputs = [
                    torch.full((b,), state.scratch, dtype=torch.long, device=dev),
                    torch.zeros(b, t, dtype=torch.long, device=dev),
                    torch.zeros(b, t, k, dtype=torch.long, device=dev),
                    torch.zeros(b, t, dtype=torch.bool, device=dev),
                    torch.ones(b, dtype=torch.long, device=dev),
                ]
                graph, _ = capture_graph(lambda: csm._prefill_rows(state, *inputs), self.pool, warmups=1)
                self.graphs[(b, t)] = (graph, inputs)
        torch.cuda.synchronize()

    def fits(self, b: int, t: int) -> bool:
        return b <= self.batches[-1] and t <= self.lengths[-1]

    @torch.no_grad()
    def __call__(self, slots: Sequence[int], prompts: Sequence[CSMPrompt]) -> None:
        n, longest = len(prompts), max(len(p) for p in prompts)
        b = next(m for m in self.batches if m >= n)
        t = next(m for m in self.lengths if m >= longest)
        graph, (g_slots, g_ids, g_codes, g_audio, g_len) = self.graphs[(b, t)]
        ids, codes, is_audio = _pad_prompts(prompts, t, b, self.csm.num_codebooks)
        lengths = torch.ones(b, dtype=torch.long)
        lengths[:n] = torch.tensor([len(p) for p in prompts])
        rows = torch.full((b,), self.state.scratch, dtype=torch.long)
        rows[:n] = torch.tensor(list(slots), dtype=torch.long)
        for dst, src in zip((g_slots, g_ids, g_codes, g_audio, g_len), (rows, ids, codes, is_audio, lengths), strict=True):
            dst.copy_(src, non_blocking=True)
        graph.replay()


def _read_safetensors(root: Path) -> dict[str, Tensor]:
    """All tensors of ``model.safetensors`` or of the shards named by ``model.safetensors.index.json``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    single = root / "model.safetensors"
    index = root / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelFormatError(f"cannot read {index}: {e}") from None
        files = [root / name for name in sorted(set(weight_map.values()))]
    else:
        raise ModelFormatError(f"CSM checkpoint folder {str(root)!r} has no model.safetensors")
    sd: dict[str, Tensor] = {}
    for f in files:
        try:
            sd.update(load_file(str(f), device="cpu"))
        except (OSError, SafetensorError) as e:
            raise ModelFormatError(f"cannot read {f}: {e}") from None
    return sd
