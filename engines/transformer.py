"""Llama-style decoder stack shared by the text engine and the CSM backbone / depth decoder.

One implementation of pre-norm decoder layers (RMSNorm -> GQA attention with half-rotation RoPE
-> RMSNorm -> SwiGLU MLP) plus the final RMSNorm. No embedding and no LM head: callers own those.

Submodule names equal Hugging Face Llama/Qwen3 so their state dicts load without renaming.
The KV cache is preallocated with a fixed shape and written at explicit positions, so rows of a
batch may sit at different positions (continuous batching) and the forward pass is free of
data-dependent Python control flow (CUDA-graph friendly).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from realtime.errors import ConfigError, ModelFormatError, UnsupportedError
from realtime.kernels.decode_stack import MAX_M as STACK_MAX_M  # plain constants: importing them needs no Triton
from realtime.kernels.gemv import MAX_M as GEMV_MAX_M

__all__ = ["TransformerConfig", "KVCache", "Transformer", "rope_frequencies", "RMSNorm", "fuse_params", "point_params_at",
           "stack_enabled"]


@dataclass(frozen=True)
class TransformerConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF rope dict without rope_theta, e.g. {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
    # "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}; None = plain RoPE.
    rope_scaling: dict | None = None
    max_seq_len: int = 2048
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        if min(self.dim, self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim, self.intermediate_size) <= 0:
            raise ConfigError(f"transformer sizes must be positive: {self}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ConfigError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2 != 0:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "TransformerConfig":
        """Build from a HF config dict (LlamaConfig, Qwen3Config, CsmConfig, CsmDepthDecoderConfig).

        Accepts both the transformers>=5 ``rope_parameters`` dict and the older ``rope_theta`` +
        ``rope_scaling`` pair.
        """
        hf = dict(hf)
        try:
            dim = int(hf["hidden_size"])
            n_heads = int(hf["num_attention_heads"])
            n_layers = int(hf["num_hidden_layers"])
            inter = int(hf["intermediate_size"])
        except KeyError as e:
            raise ConfigError(f"HF config lacks {e.args[0]!r}") from None
        n_kv = int(hf.get("num_key_value_heads") or n_heads)
        head_dim = int(hf.get("head_dim") or dim // n_heads)
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedError(f"hidden_act={act!r} is not supported (only silu)")
        rope = dict(hf.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        if not rope and hf.get("rope_scaling"):
            rope = dict(hf["rope_scaling"])
        rope.pop("rope_theta", None)
        rtype = rope.get("rope_type", rope.get("type", "default"))
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedError("partial_rotary_factor != 1 is not supported")
        rope.pop("partial_rotary_factor", None)
        scaling = None if rtype in (None, "default") else {**rope, "rope_type": rtype}
        model_type = hf.get("model_type", "")
        return cls(
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            intermediate_size=inter,
            rms_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_seq_len=int(hf.get("max_position_embeddings", 2048)),
            qk_norm=model_type.startswith("qwen3"),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
        )


def rope_frequencies(cfg: TransformerConfig, device: torch.device | str | None = None) -> Tensor:
    """Inverse RoPE frequencies [D/2] in float32, computed exactly as transformers does."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / d))
    sc = cfg.rope_scaling
    if sc is None:
        return inv_freq
    rtype = sc.get("rope_type", sc.get("type"))
    if rtype == "linear":
        return inv_freq / float(sc["factor"])
    if rtype == "llama3":
        factor = float(sc["factor"])
        low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old_len = float(sc["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise UnsupportedError(f"rope_type={rtype!r} is not supported (default, linear, llama3)")


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; statistics in float32 like HF, weight applied in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if _KERNELS and x.is_cuda:
            from realtime.kernels.rmsnorm import rmsnorm

            return rmsnorm(x.contiguous(), self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class KVCache:
    """Preallocated per-slot K/V: k, v [n_layers, n_slots, n_kv_heads, max_seq_len, head_dim].

    A slot is one sequence (session). Positions are absolute; the forward pass writes them at
    explicit indices and masks keys beyond each query's position, so stale data past the current
    position is never read. ``reset`` zeroes slots anyway so NaN/inf from an aborted run cannot leak
    through a 0-weight in attention.
    """

    def __init__(
        self,
        cfg: TransformerConfig,
        n_slots: int,
        max_seq_len: int | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if n_slots <= 0:
            raise ConfigError(f"n_slots must be positive, got {n_slots}")
        self.n_slots = n_slots
        self.max_seq_len = int(max_seq_len or cfg.max_seq_len)
        shape = (cfg.n_layers, n_slots, cfg.n_kv_heads, self.max_seq_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        # Key positions, used to build the attention mask without reallocating each step.
        self.key_pos = torch.arange(self.max_seq_len, device=device)

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    def reset(self, slots: Tensor | list[int]) -> None:
        """Forget the given slots (zeroed in place; no reallocation)."""
        idx = torch.as_tensor(slots, dtype=torch.long, device=self.k.device)
        self.k[:, idx] = 0
        self.v[:, idx] = 0


def use_kernels(enabled: bool | None = None) -> bool:
    """The Triton fast path (fused RMSNorm and residual-add + RMSNorm, rotary, in-place decode
    attention; the CSM engine adds the fused sampler) on CUDA; off = plain PyTorch.

    On by default; REALTIME_KERNELS=0 (or ``use_kernels(False)``) turns it off. The kernels only run
    on CUDA tensors; on the CPU the PyTorch code below is used either way.
    """
    global _KERNELS
    if enabled is not None:
        _KERNELS = bool(enabled)
    return _KERNELS


_KERNELS = os.environ.get("REALTIME_KERNELS", "1") != "0"
# The one-kernel decode step (kernels/decode_stack.py) per engine: "0" (default until it has been
# measured on the H200: off), "1" (the first engine of the process that asks gets it), or a comma
# list of engines ("text", "csm"). One engine at most: two persistent kernels on one GPU at once,
# from two engines' streams, could each hold half the SMs and wait for the other half forever.
_STACK = os.environ.get("REALTIME_STACK", "0").strip().lower()


def _parse_stack_tune(text: str) -> dict[str, int]:
    """REALTIME_STACK_TUNE ("FMA=10,ATT_REGS=1") -> decode_stack's ``tune``; decode_stack checks the names."""
    tune = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not (sep and key.strip() and value.strip().lstrip("-").isdigit()):
            raise ValueError(f"REALTIME_STACK_TUNE: {item!r} is not NAME=integer (e.g. FMA=10,ATT_REGS=1)")
        tune[key.strip().upper()] = int(value)
    return tune


# Which stack kernel: "triton" (kernels/decode_stack.py, default) or "cuda" (the CUDA C++ kernel of
# kernels/decode_stack_cuda.py: one bf16 row on an sm_90 GPU with nvcc; other steps keep Triton's).
_STACK_KERNEL = os.environ.get("REALTIME_STACK_KERNEL", "triton").strip().lower()
if _STACK_KERNEL not in ("triton", "cuda"):
    raise ValueError(f"REALTIME_STACK_KERNEL must be triton or cuda, got {_STACK_KERNEL!r}")
# With the CUDA stack: a one-row step gathers its input row and computes its head in the stack's
# kernel (decode_row_fused: the text engine's embedding and LM head, CSM's depth inputs and
# codebook heads). "0": the engines' separate launches, as before (for A/B in the benches).
_STACK_FUSED = os.environ.get("REALTIME_STACK_FUSED", "1").strip() != "0"
# Switches of the stack kernel for the benches (decode_stack's ``tune``); empty: its defaults.
_STACK_TUNE = _parse_stack_tune(os.environ.get("REALTIME_STACK_TUNE", ""))
_stack_owner: list[str] = []


def stack_enabled(engine: str) -> bool:
    """Whether ``engine`` ("text", "csm") runs its decode steps as one persistent kernel (see
    ``_STACK``); at most one engine per process gets a yes."""
    if _STACK in ("", "0") or (_STACK != "1" and engine not in _STACK.split(",")):
        return False
    if _stack_owner and _stack_owner[0] != engine:
        return False
    if not _stack_owner:
        _stack_owner.append(engine)
    return True
# The decode GEMV (kernels/gemv.py) per projection: "auto" times it against cuBLAS once per shape
# at fuse time and keeps the faster; "1" always (M <= GEMV_MAX_M rows), "0" never.
_GEMV = os.environ.get("REALTIME_GEMV", "auto").strip().lower()


def use_gemv(w: Tensor, bias: Tensor | None = None, swiglu: bool = False, partials: bool = False,
             gelu: str | None = None) -> bool:
    """Whether decode-time products with this weight take the Triton GEMV (see ``_GEMV``);
    ``partials``: the product feeds a residual add + RMSNorm that can sum split-K partials;
    ``gelu``: the GEMV computes the product's GELU too (F.gelu's ``approximate``)."""
    if not (_KERNELS and w.is_cuda) or _GEMV == "0":
        return False
    if _GEMV == "1":
        return True
    from realtime.kernels.gemv import faster_than_library

    return faster_than_library(w, bias, swiglu, partials, gelu)


class CPUProduct:
    """A weight's faster CPU product, attached to the weight as ``w.cpu_product`` (``project`` uses
    it for CPU inputs): 4-bit codes with a bf16 scale and offset per 32 inputs, w = (q - 8) * scale
    + zero, for torch's CPU int4 GEMM (GGUF Q4_0 / Q4_1 weights, exactly their codes); the weight
    as symmetric int8 with a bf16 scale a row (``int8``: torch's CPU int8 GEMM, for a weight read
    whole every step, such as the LM head); or the weight in bfloat16 (``codes`` None). Either way
    the product runs on bf16 inputs and returns x's dtype. On a 2-core AVX512-BF16 VM the embedded
    SmolLM2 decodes ~2.5× faster than in float32."""

    def __init__(self, w: Tensor | None, codes: Tensor | None = None, scale: Tensor | None = None,
                 zero: Tensor | None = None, int8: bool = False) -> None:
        self.bf16 = self.int8 = None
        if int8:  # symmetric int8 a row, bf16 scale: torch's CPU int8 GEMM (half the bytes of bf16)
            assert w is not None and codes is None
            w = w.detach().float()
            s = w.abs().amax(1).clamp_min(1e-30) / 127
            self.int8 = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            self.int8_scale = s.to(torch.bfloat16)
            return
        if codes is None:
            assert w is not None
            self.bf16 = w.detach().to(torch.bfloat16)
            return
        n, k = codes.shape
        assert k % 32 == 0 and scale is not None and zero is not None and scale.shape == zero.shape == (n, k // 32)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        self.scales_zeros = torch.stack([scale.t(), zero.t()], -1).to(torch.bfloat16).contiguous()

    def __call__(self, x: Tensor, bias: Tensor | None) -> Tensor:
        xb = x.to(torch.bfloat16)
        if self.bf16 is not None:
            y = F.linear(xb, self.bf16)
        elif self.int8 is not None:
            y = torch.ops.aten._weight_int8pack_mm(xb.reshape(-1, x.shape[-1]).contiguous(), self.int8,
                                                   self.int8_scale).reshape(*x.shape[:-1], -1)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb.reshape(-1, x.shape[-1]).contiguous(), self.packed, 32,
                                                            self.scales_zeros).reshape(*x.shape[:-1], -1)
        y = y.to(x.dtype)
        return y if bias is None else y + bias


def _on_gemv(x: Tensor, gemv: bool) -> bool:
    """Whether a product chosen for the GEMV (``gemv``) takes it for these rows x [M, K]."""
    return gemv and x.shape[0] <= GEMV_MAX_M


def project(x: Tensor, w: Tensor, bias: Tensor | None, gemv: bool) -> Tensor:
    """x [M, K] @ w.T + bias: the GEMV for M <= GEMV_MAX_M rows when ``gemv``, the weight's
    ``CPUProduct`` for CPU inputs when it has one, else the library GEMM."""
    if _on_gemv(x, gemv):
        from realtime.kernels.gemv import linear

        return linear(x, w, bias)
    fast = getattr(w, "cpu_product", None)
    if fast is not None and not x.is_cuda:
        return fast(x, bias)
    return F.linear(x, w, bias)


def linear(lin: nn.Linear, x: Tensor) -> Tensor:
    """``lin(x)`` through ``project`` (so a CPU product attached to its weight is used)."""
    return project(x, lin.weight, lin.bias, False)


def project_to_norm(x: Tensor, w: Tensor, bias: Tensor | None, gemv: bool) -> Any:
    """``project`` for a product that only feeds the next residual add + RMSNorm: may return the
    GEMV's split-K partial sums (``gemv.Partials``) when that was measured faster; ``_add_norm``
    takes either."""
    if _on_gemv(x, gemv):
        from realtime.kernels.gemv import linear_partials

        return linear_partials(x, w, bias)
    return F.linear(x, w, bias)


def project_gelu(x: Tensor, w: Tensor, bias: Tensor | None, gemv: bool, approximate: str) -> Tensor:
    """F.gelu(``project``(x, w, bias), approximate): on the GEMV, the GELU in its epilogue."""
    if _on_gemv(x, gemv):
        from realtime.kernels.gemv import linear_gelu

        return linear_gelu(x, w, bias, approximate)
    return F.gelu(project(x, w, bias, False), approximate=approximate)


def _add_norm(out: Any, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rmsnorm(out + residual), out + residual) for a sublayer output or its split-K partials."""
    from realtime.kernels.gemv import Partials
    from realtime.kernels.rmsnorm import add_rmsnorm, add_rmsnorm_partials

    if isinstance(out, Partials):
        return add_rmsnorm_partials(out.sums, residual, weight, eps)
    return add_rmsnorm(out, residual, weight, eps)


def _fused_layer_loop(x: Tensor) -> bool:
    """Whether Transformer.forward takes the kernels' layer loops (a function so the CPU tests can
    run those loops under TRITON_INTERPRET)."""
    return _KERNELS and x.is_cuda


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    # CPU products of [q|k|v] in one (``CPUProduct``), set by the loader: one product for three.
    qkv_cpu: CPUProduct | None = None
    qkv_cpu_bias: Tensor | None = None

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, h * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.dim, hkv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.dim, hkv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, cfg.dim, bias=cfg.attention_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_eps)
            self.k_norm = RMSNorm(d, cfg.rms_eps)
        # Non-persistent buffers (None until ``fuse``): moved by .to(), absent from state dicts.
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)
        self.gemv_qkv = self.gemv_o = False

    def fuse(self) -> None:
        """One [q|k|v] weight; the three projections' parameters become views into it."""
        if self.qkv_weight is not None:
            return
        projs = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = fuse_params([p.weight for p in projs])
        if self.cfg.attention_bias:
            self.qkv_bias = fuse_params([p.bias for p in projs])
        self.gemv_qkv = use_gemv(self.qkv_weight, self.qkv_bias)
        self.gemv_o = use_gemv(self.o_proj.weight, self.o_proj.bias, partials=True)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        layer: int,
        cache: KVCache | None,
        slots: Tensor | None,
        pos: Tensor,
    ) -> Tensor:
        """x [B, T, dim]; cos/sin [B, 1, T, D]; mask [B, 1, T, S] bool over the cache's keys, or None:
        causal over the T inputs alone (no cache, or a fresh prefill that also writes them to it) -> [B, T, dim]."""
        cfg = self.cfg
        b, t, _ = x.shape
        nq, nkv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        if self.qkv_weight is not None:  # one GEMM for q|k|v (see Transformer.fuse_projections)
            q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).split([nq, nkv, nkv], dim=-1)
        elif self.qkv_cpu is not None and not x.is_cuda:
            q, k, v = self.qkv_cpu(x, self.qkv_cpu_bias).split([nq, nkv, nkv], dim=-1)
        else:
            q, k, v = (linear(p, x) for p in (self.q_proj, self.k_proj, self.v_proj))
        q = q.view(b, t, cfg.n_heads, cfg.head_dim)
        k = k.view(b, t, cfg.n_kv_heads, cfg.head_dim)
        v = v.view(b, t, cfg.n_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = q.transpose(1, 2)  # [B, H, T, D]
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)
        fast = _KERNELS and x.is_cuda
        if fast:
            from realtime.kernels.rotary import apply_rotary

            q, k = apply_rotary(q, k, cos, sin)
        else:
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        if cache is not None and fast and t == 1 and 16 <= cfg.head_dim <= 256:  # the kernel's head dims
            from realtime.kernels.decode_attention import decode_attention

            cache.k[layer, slots[:, None], :, pos] = k.transpose(1, 2).to(cache.dtype)
            cache.v[layer, slots[:, None], :, pos] = v.transpose(1, 2).to(cache.dtype)
            # keys 0..pos are valid for this query: reads the cache in place, no gather copy
            out = decode_attention(q[:, :, 0], cache.k[layer], cache.v[layer], slots, pos[:, 0] + 1)
            return linear(self.o_proj, out.reshape(b, 1, cfg.n_heads * cfg.head_dim).to(x.dtype))
        if cache is not None:
            assert slots is not None
            one = slots.numel() == 1 and slots.device.type == "cpu"  # one CPU row: views, no index ops
            if one:
                s = int(slots[0])
            if one and t == 1:
                p = int(pos[0, 0])
                cache.k[layer, s, :, p] = k[0, :, 0]
                cache.v[layer, s, :, p] = v[0, :, 0]
            else:  # advanced indices [B,1] and [B,T] separated by a slice: the indexed view is [B, T, Hkv, D]
                cache.k[layer, slots[:, None], :, pos] = k.transpose(1, 2).to(cache.dtype)
                cache.v[layer, slots[:, None], :, pos] = v.transpose(1, 2).to(cache.dtype)
            if mask is None:  # a fresh prefill: these T inputs are all the keys (see Transformer.forward)
                if cache.dtype != q.dtype:  # attend to what the cache holds, as the masked path does
                    k, v = k.to(cache.dtype).to(q.dtype), v.to(cache.dtype).to(q.dtype)
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=cfg.n_heads != cfg.n_kv_heads)
            else:
                used = mask.shape[-1]  # the keys the mask spans (a prefix of the cache on the CPU)
                rows = slice(s, s + 1) if one else slots  # [B, Hkv, S used, D]: one row's a view (a gather copies)
                k = cache.k[layer, rows, :, :used].to(q.dtype)
                v = cache.v[layer, rows, :, :used].to(q.dtype)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=cfg.n_heads != cfg.n_kv_heads)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=cfg.n_heads != cfg.n_kv_heads)
        return linear(self.o_proj, out.transpose(1, 2).reshape(b, t, cfg.n_heads * cfg.head_dim))


class MLP(nn.Module):
    # The CPU product of [gate|up] in one (``CPUProduct``), set by the loader.
    gate_up_cpu: CPUProduct | None = None
    gate_up_cpu_bias: Tensor | None = None

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.dim, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.dim, bias=cfg.mlp_bias)
        self.mlp_bias = cfg.mlp_bias
        self.register_buffer("gate_up_weight", None, persistent=False)
        self.register_buffer("gate_up_bias", None, persistent=False)
        self.gemv_gate_up = self.gemv_down = False

    def fuse(self) -> None:
        """One [gate|up] weight; the two projections' parameters become views into it."""
        if self.gate_up_weight is not None:
            return
        projs = (self.gate_proj, self.up_proj)
        self.gate_up_weight = fuse_params([p.weight for p in projs])
        if self.mlp_bias:
            self.gate_up_bias = fuse_params([p.bias for p in projs])
        self.gemv_gate_up = use_gemv(self.gate_up_weight, self.gate_up_bias, swiglu=True)
        self.gemv_down = use_gemv(self.down_proj.weight, self.down_proj.bias, partials=True)

    def decode(self, x: Tensor) -> Any:
        """x [M, dim] (fused weights) -> [M, dim], or the down projection's split-K partials
        (``project_to_norm``): SwiGLU in the GEMV's epilogue when chosen."""
        if self.gemv_gate_up and x.shape[0] <= GEMV_MAX_M:
            from realtime.kernels.gemv import swiglu

            a = swiglu(x, self.gate_up_weight, self.gate_up_bias)
        else:
            gate, up = F.linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
            a = F.silu(gate) * up
        return project_to_norm(a, self.down_proj.weight, self.down_proj.bias, self.gemv_down)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_weight is not None:
            gate, up = F.linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
            return linear(self.down_proj, F.silu(gate) * up)
        if self.gate_up_cpu is not None and not x.is_cuda:
            gate, up = self.gate_up_cpu(x, self.gate_up_cpu_bias).chunk(2, dim=-1)
            return linear(self.down_proj, F.silu(gate) * up)
        return linear(self.down_proj, F.silu(linear(self.gate_proj, x)) * linear(self.up_proj, x))


def fuse_params(params: list[nn.Parameter]) -> Tensor:
    """Concatenate parameters along dim 0 into one tensor and re-point each parameter at its slice,
    so the fused tensor costs no extra memory and later in-place loads (``copy_``) reach both."""
    with torch.no_grad():
        fused = torch.cat([p.detach() for p in params], dim=0)
    point_params_at(params, fused)
    return fused


def point_params_at(params: list[nn.Parameter], fused: Tensor) -> None:
    """Re-point each parameter at its slice of ``fused`` along dim 0, in order (the parameters'
    values must already be there)."""
    at = 0
    for p in params:
        n = p.shape[0]
        p.data = fused[at:at + n]
        at += n


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.dim, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.rms_eps)


class Transformer(nn.Module):
    """Decoder layers + final RMSNorm (no embedding, no LM head)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.rms_eps)
        # Non-persistent so HF state dicts (which carry no inv_freq) load strictly.
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)
        self._rope_tables: dict[tuple, tuple[Tensor, Tensor]] = {}
        self.stack = None  # kernels.decode_stack.StackWeights once ``enable_decode_stack`` ran
        self.stack_programs: int | None = None  # programs of the persistent kernel (None: one per SM)
        self.stack_cuda = False  # one-row bf16 steps take the CUDA C++ stack (REALTIME_STACK_KERNEL=cuda)

    def rope_table(self, n: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos, sin) [n, D] in ``dtype`` for positions 0..n-1, on inv_freq's device: the same
        values ``forward`` computes per step (same float32 ops, then the cast). Built once per
        (n, dtype, device); build it before a CUDA-graph capture (the capture warm-up does)."""
        key = (n, dtype, self.inv_freq.device)
        if key not in self._rope_tables:
            pos = torch.arange(n, device=self.inv_freq.device)
            freqs = pos.to(torch.float32)[:, None] * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            self._rope_tables[key] = (emb.cos().to(dtype), emb.sin().to(dtype))
        return self._rope_tables[key]

    def _apply(self, fn, recurse=True):  # keep inv_freq float32 under .to(bfloat16), like HF
        inv = self.inv_freq
        out = super()._apply(fn, recurse)
        if not inv.is_meta:
            self.inv_freq = inv.to(device=self.inv_freq.device, dtype=torch.float32)
        return out

    def forward(
        self,
        x: Tensor,
        pos: Tensor,
        cache: KVCache | None = None,
        slots: Tensor | None = None,
        fresh: bool = False,
    ) -> Tensor:
        """x [B, T, dim], pos [B, T] absolute positions -> hidden states [B, T, dim] after the final norm.

        With a cache: writes K/V of these T positions into cache[slots] at ``pos`` and attends over
        cache positions <= each query's position. Without: plain causal attention over the T inputs.
        ``fresh`` (with a cache) is the caller's promise that every row starts at position 0
        (pos[b, t] == t) and has nothing else in its slot: the K/V are still written, but attention
        is causal over the T inputs alone — no gather of the slot's whole cache, no [T, S] mask. Rows
        may be right-padded: a real position never attends to a later (padding) one.
        """
        fused = _fused_layer_loop(x)
        if fused and cache is not None and x.shape[1] == 1 and self._decode_fusable():
            if slots is None:
                raise ConfigError("Transformer.forward: a cache needs slots")
            return self._decode(x, pos[:, 0], cache, slots)
        # RoPE angles in float32 regardless of the compute dtype (as HF does), then cast.
        freqs = pos.to(torch.float32)[..., None] * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, D]
        cos = emb.cos().to(x.dtype)
        sin = emb.sin().to(x.dtype)
        mask = None
        if cache is not None:
            if slots is None:
                raise ConfigError("Transformer.forward: a cache needs slots")
            if not fresh:
                # On the CPU the positions are on the host, so the keys can stop at the last one in
                # use: a decode step then gathers and attends over the used prefix of each slot,
                # not its whole cache (on a GPU that read would be a sync: the mask spans it all).
                used = int(pos.max()) + 1 if pos.device.type == "cpu" and pos.numel() else cache.max_seq_len
                mask = (cache.key_pos[None, None, :used] <= pos[:, :, None])[:, None]  # [B, 1, T, S used]
        if fused:
            return self._layers_fused_norms(x, cos, sin, mask, cache, slots, pos)
        for i, layer in enumerate(self.layers):
            h = layer.self_attn(layer.input_layernorm(x), cos, sin, mask, i, cache, slots, pos)
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def _layers_fused_norms(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                            cache: KVCache | None, slots: Tensor | None, pos: Tensor) -> Tensor:
        """The layer loop with each residual add fused into the RMSNorm that follows it (Triton):
        the same arithmetic as the plain loop (the sum is rounded to the residual dtype first)."""
        if not len(self.layers):
            return self.norm(x)
        return self._fused_norm_loop(
            x.contiguous(),
            lambda i, layer, h: layer.self_attn(h, cos, sin, mask, i, cache, slots, pos).contiguous(),
            lambda layer, h: layer.mlp(h).contiguous())

    def _fused_norm_loop(self, x: Tensor, attend: Callable[[int, "DecoderLayer", Tensor], Any],
                         mlp: Callable[["DecoderLayer", Tensor], Any]) -> Tensor:
        """x [..., dim] contiguous (at least one layer) -> the final-norm output. Each layer's input
        norm and the final norm take the residual add before them (one kernel each);
        ``attend(i, layer, h)`` and ``mlp(layer, h)`` return the sublayers' outputs, contiguous, or
        their split-K partial sums (summed by the add + norm kernel)."""
        from realtime.kernels.rmsnorm import rmsnorm

        eps = self.cfg.rms_eps
        h = rmsnorm(x, self.layers[0].input_layernorm.weight, eps)
        for i, layer in enumerate(self.layers):
            h, x = _add_norm(attend(i, layer, h), x, layer.post_attention_layernorm.weight, eps)
            nxt = self.layers[i + 1].input_layernorm.weight if i + 1 < len(self.layers) else self.norm.weight
            h, x = _add_norm(mlp(layer, h), x, nxt, eps)
        return h

    def _decode_fusable(self) -> bool:
        """The one-token fast path needs fused projections, no q/k norm, and the kernels' head dims."""
        cfg = self.cfg
        return (len(self.layers) > 0 and self.layers[0].self_attn.qkv_weight is not None
                and self.layers[0].mlp.gate_up_weight is not None and not cfg.qk_norm
                and 16 <= cfg.head_dim <= 256)

    def _decode(self, x: Tensor, pos: Tensor, cache: KVCache, slots: Tensor) -> Tensor:
        """One token per row with the kernels: x [B, 1, dim], pos [B] -> [B, 1, dim] after the final norm.

        Per layer: q|k|v GEMV -> RoPE + K/V cache write (one kernel) -> decode attention -> o GEMV ->
        residual add + RMSNorm -> gate|up GEMV with SwiGLU -> down GEMV -> residual add + RMSNorm
        (o and down may leave split-K partial sums, which the add + norm kernel sums).
        The angles come from a position table instead of being recomputed each step.
        """
        from realtime.kernels.decode_attention import decode_attention
        from realtime.kernels.rotary import rotary_cache_write

        cfg = self.cfg
        b = x.shape[0]
        cos, sin = self.rope_table(cache.max_seq_len, x.dtype)
        pos = pos.contiguous()  # once here, not in every layer's kernel call
        if self.stack is not None and b <= STACK_MAX_M and x.dtype == self.stack.qkv.dtype == cache.dtype:
            args = (self.stack, x.reshape(b, cfg.dim).contiguous(), pos, cache.k, cache.v, slots.contiguous(), cos, sin)
            if self.stack_cuda and b == 1:
                from realtime.kernels.decode_stack_cuda import decode_stack_cuda

                h = decode_stack_cuda(*args, programs=self.stack_programs)
            else:
                from realtime.kernels.decode_stack import decode_stack

                h = decode_stack(*args, programs=self.stack_programs, tune=_STACK_TUNE or None)
            return h.view(b, 1, cfg.dim)
        lengths = pos + 1  # keys 0..pos are valid for this query

        def attend(i: int, layer: DecoderLayer, h: Tensor) -> Tensor:
            att = layer.self_attn
            qkv = project(h, att.qkv_weight, att.qkv_bias, att.gemv_qkv)
            q = rotary_cache_write(qkv, cos, sin, pos, cache.k[i], cache.v[i], slots, cfg.n_heads, cfg.n_kv_heads)
            o = decode_attention(q, cache.k[i], cache.v[i], slots, lengths).reshape(b, cfg.n_heads * cfg.head_dim)
            return project_to_norm(o, att.o_proj.weight, att.o_proj.bias, att.gemv_o)

        h = self._fused_norm_loop(x.reshape(b, cfg.dim).contiguous(), attend, lambda layer, h: layer.mlp.decode(h))
        return h.view(b, 1, cfg.dim)

    def decode_row_fused(self, table: Tensor, index: Tensor, pos: Tensor, cache: KVCache, slots: Tensor,
                         head: Tensor | None = None, offset: int = 0, sample: tuple | None = None,
                         token: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor | None] | None:
        """One row's decode step in ONE kernel of the CUDA stack, with its input gathered there
        (``table[index[0] + offset]``: an embedding, [rows, dim]) and, with ``head`` [V, dim], the
        head's logits after the final norm, and with ``sample`` (temperature, top_k, seeds, steps,
        step_add: see ``decode_stack_cuda``) their token, into ``token`` if given:
        -> (final-norm output [1, dim], logits [1, V] in bf16 or None, token int64 [1] or None).
        None where the CUDA stack does not take the step (the caller then gathers, projects and
        samples itself): no CUDA stack, a batch, dtypes other than the stack's, a head too wide
        to sample in the kernel, or REALTIME_STACK_FUSED=0.
        index, pos, slots: int64 [1] on the GPU; no host syncs (CUDA-graph capturable)."""
        if not (_STACK_FUSED and self.stack_cuda and index.shape == (1,) and pos.shape == (1,) and slots.shape == (1,)
                and index.dtype == torch.long and table.dim() == 2 and table.shape[1] == self.cfg.dim
                and table.dtype == self.stack.qkv.dtype == cache.dtype and table.is_contiguous()
                and (head is None or head.dtype == table.dtype)):
            return None
        from realtime.kernels.decode_stack_cuda import MAX_SAMPLE_V, decode_stack_cuda

        if sample is not None and (head is None or head.shape[0] > MAX_SAMPLE_V):
            return None
        cos, sin = self.rope_table(cache.max_seq_len, table.dtype)
        r = decode_stack_cuda(self.stack, table, pos.contiguous(), cache.k, cache.v, slots.contiguous(), cos, sin,
                              programs=self.stack_programs, x_index=index, x_offset=offset, head=head, sample=sample,
                              token=token)
        if sample is not None:
            return r
        return (r[0], r[1], None) if head is not None else (r, None, None)

    def enable_decode_stack(self, programs: int | None = None) -> bool:
        """Run one-token steps of <= 4 rows as ONE persistent kernel over all layers
        (``kernels.decode_stack``) instead of ~9 launches a layer. Call after ``fuse_projections``;
        the layers' weights move into stacked [L, ...] tensors (views stay in the layers, no
        extra memory). False (and nothing changed) where the stack kernel does not apply: no
        kernels, biases, q/k norm, or shapes it does not take. Only one persistent kernel may run
        on a GPU at a time, so only one engine per GPU should enable it."""
        from realtime.kernels.decode_stack import stack_weights, takes_shapes

        cfg = self.cfg
        if not (self._decode_fusable() and _KERNELS and not cfg.attention_bias and not cfg.mlp_bias
                and takes_shapes(cfg.dim, cfg.intermediate_size, cfg.n_heads, cfg.head_dim)):
            return False

        if self.stack is None:
            self.stack = stack_weights(self)
        self.stack_programs = programs
        if _STACK_KERNEL == "cuda":
            from realtime.kernels import decode_stack_cuda as dsc

            w = self.stack
            self.stack_cuda = (w.qkv.is_cuda and w.qkv.dtype == torch.bfloat16 and dsc.available(w.qkv.device)
                               and dsc.takes(cfg.dim, cfg.intermediate_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim))
        return True

    def fuse_projections(self) -> None:
        """Fuse q|k|v and gate|up into one GEMM each (half the GEMM launches of a decode step).
        Call after the weights are loaded and placed; the parameters stay as views (state_dict and
        in-place reloads still work). A later ``.to()`` re-materialises them separately (correct,
        but the memory is then doubled): fuse last."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def load_hf_state_dict(self, sd: Mapping[str, Tensor], prefix: str) -> None:
        """Load from an HF state dict whose stack lives under ``prefix`` (e.g. "model.").

        Only keys under ``prefix + "layers."`` and ``prefix + "norm."`` belong to this module (the
        caller's embedding etc. under the same prefix are ignored). Strict on those: missing,
        unexpected or shape-mismatched keys raise ModelFormatError naming them.
        """
        own = self.state_dict()
        theirs = {
            k[len(prefix):]: v
            for k, v in sd.items()
            if k.startswith(prefix + "layers.") or k.startswith(prefix + "norm.")
        }
        missing = sorted(set(own) - set(theirs))
        unexpected = sorted(set(theirs) - set(own))
        bad_shape = [
            f"{k}: {tuple(theirs[k].shape)} vs {tuple(own[k].shape)}"
            for k in own
            if k in theirs and tuple(theirs[k].shape) != tuple(own[k].shape)
        ]
        if missing or unexpected or bad_shape:
            parts = []
            if missing:
                parts.append("missing: " + ", ".join(prefix + k for k in missing[:20]))
            if unexpected:
                parts.append("unexpected: " + ", ".join(prefix + k for k in unexpected[:20]))
            if bad_shape:
                parts.append("shape mismatch: " + "; ".join(bad_shape[:20]))
            raise ModelFormatError("transformer weights do not match the config (" + " | ".join(parts) + ")")
        with torch.no_grad():
            for k, p in own.items():
                p.copy_(theirs[k])
