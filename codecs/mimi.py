"""Mimi neural audio codec (Kyutai), both directions, offline and streaming, in plain PyTorch.

Architecture (facts from transformers' ``MimiModel``, re-implemented here):

    encode: audio [B, 1, N] -> SEANet encoder (causal convs, strided downsampling, 24 kHz -> 25 Hz)
            -> encoder transformer (causal, sliding window, RoPE, LayerScale)
            -> downsample conv (k=4, s=2, replicate padding; 25 Hz -> 12.5 Hz)
            -> split RVQ (semantic RVQ of 1 codebook + acoustic RVQ of K-1, both fed the same input)
            -> codes [B, K, T]
    decode: codes [B, K, T] -> split RVQ lookup -> upsample (depthwise transposed conv, 12.5 -> 25 Hz)
            -> decoder transformer -> SEANet decoder (transposed convs, causal convs) -> audio [B, 1, T*1920]

Causality facts (why streaming is exact, not approximate):
  * every Conv1d is causal: left padding of (effective_kernel - stride), nothing on the right when the
    input length is a multiple of the stride;
  * every ConvTranspose1d is "right trimmed" (trim_right_ratio = 1): output sample p only receives
    contributions from inputs j with j * stride <= p, so it is causal too.  The (kernel - stride) samples
    that the offline path trims off the end are exactly the "overlap tail" that the streaming path keeps
    and adds to the start of the next step's output;
  * the transformers are causal with a sliding window W (250): position q sees keys q-W+1 .. q.
  Hence decoded sample p depends only on code frames 0 .. p // frame_size, and the streaming decoder
  reproduces the offline decode of the same codes on EVERY sample (float rounding aside), including the
  last (kernel - stride) samples of each transposed conv: offline, those last samples are the same partial
  sums that streaming emits (the missing contributions would come from frames that do not exist yet).
  The offline decode of a longer continuation also agrees with a streamed prefix on every emitted sample.
  The encoder is likewise exact when audio arrives in whole frames (N a multiple of ``frame_size``);
  the offline encoder additionally accepts any N, right-padding each conv like the reference (a trailing
  partial frame, which streaming cannot produce until the frame is complete).

Streaming state lives in ``MimiStreamingDecoder`` / ``MimiStreamingEncoder`` objects (one row per slot),
never on the module; buffers are allocated once, written in place and reset per slot by mask.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from realtime.engines.channels_last import conv, conv_transpose1d_cl, from_cl, to_cl
from realtime.engines.transformer import fuse_params, project, project_gelu, use_gemv, use_kernels
from realtime.errors import ConfigError, ModelFormatError, UnsupportedError

__all__ = ["Mimi", "MimiConfig", "MimiStreamingDecoder", "MimiStreamingEncoder"]


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MimiConfig:
    """Architecture of a Mimi codec.  Defaults are the published ``kyutai/mimi`` model."""

    sample_rate: int = 24_000
    channels: int = 1
    hidden_size: int = 512
    num_filters: int = 64
    num_residual_layers: int = 1
    upsampling_ratios: tuple[int, ...] = (8, 6, 5, 4)
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_growth_rate: int = 2
    compress: int = 2
    use_conv_shortcut: bool = False
    codebook_size: int = 2048
    codebook_dim: int = 256
    num_quantizers: int = 32
    num_semantic_quantizers: int = 1
    upsample_groups: int = 512
    num_layers: int = 8
    intermediate_size: int = 2048
    num_heads: int = 8
    num_kv_heads: int = 8
    head_dim: int = 64
    hidden_act: str = "gelu"
    norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    sliding_window: int = 250
    attention_bias: bool = False
    # 25 Hz -> 12.5 Hz resampling conv pair (HF: kernel 2 * int(encodec_frame_rate / frame_rate), stride 2).
    resample_kernel: int = 4
    resample_stride: int = 2

    @property
    def hop_length(self) -> int:
        """Samples per SEANet latent step (25 Hz for the default model)."""
        return math.prod(self.upsampling_ratios)

    @property
    def frame_size(self) -> int:
        """Samples per code frame: SEANet hop times the resampling stride (1920 by default)."""
        return self.hop_length * self.resample_stride

    @property
    def frame_rate(self) -> float:
        return self.sample_rate / self.frame_size

    @classmethod
    def from_hf(cls, d: dict) -> MimiConfig:
        """Map a transformers ``MimiConfig`` dict (config.json) to ours, refusing what we do not implement."""
        if d.get("model_type", "mimi") != "mimi":
            raise ModelFormatError(f"codec config has model_type {d.get('model_type')!r}, expected 'mimi'")
        if not d.get("use_causal_conv", True):
            raise UnsupportedError("non-causal Mimi (use_causal_conv=False) cannot stream")
        if float(d.get("trim_right_ratio", 1.0)) != 1.0:
            raise UnsupportedError("only trim_right_ratio=1.0 (fully causal transposed convs) is supported")
        if d.get("pad_mode", "constant") != "constant":
            raise UnsupportedError(f"pad_mode {d.get('pad_mode')!r} is not supported (only 'constant')")
        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise UnsupportedError(f"rope_type {rope.get('rope_type')!r} is not supported")
        if d.get("sliding_window") is None:
            raise UnsupportedError("Mimi without a sliding window cannot stream with bounded state")
        rks = d.get("residual_kernel_size", 3)
        if isinstance(rks, list):
            raise UnsupportedError("a list of residual kernel sizes is not supported")
        ratios = tuple(int(r) for r in (d.get("upsampling_ratios") or (8, 6, 5, 4)))
        sr = int(d.get("sampling_rate", 24_000))
        hidden = int(d.get("hidden_size", 512))
        heads = int(d.get("num_attention_heads", 8))
        hop = math.prod(ratios)
        encodec_rate = math.ceil(sr / hop)
        frame_rate = d.get("frame_rate") or sr / (hop * 2)
        if frame_rate == encodec_rate:
            raise UnsupportedError("Mimi without the 25->12.5 Hz resampling convs is not supported")
        vq_hidden = int(d.get("vector_quantization_hidden_dimension", 256))
        codebook_dim = int(d.get("codebook_dim") or hidden)
        if vq_hidden != codebook_dim:
            raise ModelFormatError(
                f"vector_quantization_hidden_dimension {vq_hidden} != codebook_dim {codebook_dim}"
            )
        cfg = cls(
            sample_rate=sr,
            channels=int(d.get("audio_channels", 1)),
            hidden_size=hidden,
            num_filters=int(d.get("num_filters", 64)),
            num_residual_layers=int(d.get("num_residual_layers", 1)),
            upsampling_ratios=ratios,
            kernel_size=int(d.get("kernel_size", 7)),
            last_kernel_size=int(d.get("last_kernel_size", 3)),
            residual_kernel_size=int(rks),
            dilation_growth_rate=int(d.get("dilation_growth_rate", 2)),
            compress=int(d.get("compress", 2)),
            use_conv_shortcut=bool(d.get("use_conv_shortcut", False)),
            codebook_size=int(d.get("codebook_size", 2048)),
            codebook_dim=codebook_dim,
            num_quantizers=int(d.get("num_quantizers", 32)),
            num_semantic_quantizers=int(d.get("num_semantic_quantizers", 1)),
            upsample_groups=int(d.get("upsample_groups", 512)),
            num_layers=int(d.get("num_hidden_layers", 8)),
            intermediate_size=int(d.get("intermediate_size", 2048)),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            hidden_act=str(d.get("hidden_act", "gelu")),
            norm_eps=float(d.get("norm_eps", 1e-5)),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10_000.0))),
            sliding_window=int(d["sliding_window"]),
            attention_bias=bool(d.get("attention_bias", False)),
            resample_kernel=2 * int(encodec_rate / frame_rate),
            resample_stride=2,
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if not 0 < self.num_semantic_quantizers < self.num_quantizers:
            raise ConfigError("need 0 < num_semantic_quantizers < num_quantizers")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_heads must be a multiple of num_kv_heads")
        if self.hidden_act not in _ACTIVATIONS:
            raise UnsupportedError(f"hidden_act {self.hidden_act!r} is not supported")
        if self.sliding_window < 1:
            raise ConfigError("sliding_window must be >= 1")
        if self.resample_kernel > 2 * self.resample_stride:
            # The overlap tail of the upsampling transposed conv must fit in one step's output.
            raise UnsupportedError("resample kernel longer than twice its stride is not supported")


_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}
# The activations the decode GEMV can apply in its epilogue (F.gelu's ``approximate`` argument).
_GEMV_GELU = {"gelu": "none", "gelu_pytorch_tanh": "tanh"}


# --------------------------------------------------------------------------------------------------
# Convolutions: offline forward (reference padding) and streaming step (explicit state)
# --------------------------------------------------------------------------------------------------


def _fused_step(x: torch.Tensor) -> bool:
    """Whether a streaming step on x runs its glue as Triton kernels: a conv step's elementwise ops
    (``kernels.seanet``: ELU + state concat + state update; overlap add + tail update + bias), and
    the transformer's ring positions and window attention (``kernels.window_attention``), which can
    also step a subset of the slots' state in place. On CUDA with the kernels on; elsewhere the
    plain PyTorch ops, exactly as they were."""
    return use_kernels() and x.is_cuda


class CausalConv1d(nn.Module):
    """Causal Conv1d.  Offline: pad left by (k_eff - stride), right up to a whole number of strides.

    Streaming: the state holds the last (k_eff - stride) input samples; ``step`` inputs must be a
    multiple of ``stride`` long and give exactly len/stride outputs.
    """

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1, dilation: int = 1,
                 groups: int = 1, bias: bool = True, replicate: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel, stride, dilation=dilation, groups=groups, bias=bias)
        self.c_in = c_in
        self.stride = stride
        self.pad = (kernel - 1) * dilation + 1 - stride
        assert self.pad >= 0, "kernel shorter than stride"
        self.replicate = replicate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, C, T] -> [B, C', ceil(T / stride)]."""
        extra = -x.shape[-1] % self.stride
        if self.replicate:
            x = F.pad(x, (self.pad, extra), mode="replicate")
        else:
            x = F.pad(x, (self.pad, extra))
        return self.conv(x)

    def state_shape(self) -> tuple[int, int]:
        return (self.c_in, self.pad)

    def step(self, x: torch.Tensor, state: torch.Tensor, fresh: torch.Tensor | None = None,
             elu: bool = False, rows: torch.Tensor | None = None, bias: bool = True) -> torch.Tensor:
        """x [B, C, n*stride], state [B, C, pad] (updated in place) -> [B, C', n]. Or all three
        channels-last and 4-D: [B, C, 1, T] (see ``MimiStreamingDecoder``). ``rows`` [B]: the
        state is [S, C, pad] and row b steps its row rows[b] in place (the fused path only).
        ``bias=False`` (the fused path only) leaves the bias to the caller.

        ``fresh`` [B] bool marks slots whose stream starts now: with replicate padding their left
        context is the first input sample repeated (what offline replicate padding sees).
        ``elu`` convolves elu(x) instead (the activation before the conv, fused with the state
        concatenation where ``_fused_step``).
        """
        assert x.shape[-1] % self.stride == 0, "streaming input must be a whole number of strides"
        if self.pad and not self.replicate and _fused_step(x):
            from realtime.kernels.seanet import state_concat

            return conv(self.conv, state_concat(x, state, elu, rows), bias)
        assert rows is None or self.pad == 0, "rows= needs the fused step"
        if elu:
            x = F.elu(x)
        if self.pad == 0:
            return conv(self.conv, x, bias)
        assert bias, "bias=False needs the fused step"
        left = state
        if self.replicate:
            assert fresh is not None and x.dim() == 3
            left = torch.where(fresh[:, None, None], x[..., :1].expand_as(state), state)
        buf = torch.cat([left, x], dim=-1)
        y = conv(self.conv, buf)
        state.copy_(buf[..., buf.shape[-1] - self.pad:])
        return y


class CausalConvTranspose1d(nn.Module):
    """Right-trimmed ConvTranspose1d (causal).  Streaming state: the (kernel - stride) overlap tail."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, groups: int = 1,
                 bias: bool = True) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(c_in, c_out, kernel, stride, groups=groups, bias=bias)
        self.c_out = c_out
        self.stride = stride
        self.overlap = kernel - stride
        assert 0 <= self.overlap <= stride, "overlap tail must fit in one input step's output"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, C, T] -> [B, C', T * stride]."""
        y = self.conv(x)
        return y[..., : y.shape[-1] - self.overlap]

    def state_shape(self) -> tuple[int, int]:
        return (self.c_out, self.overlap)

    def step(self, x: torch.Tensor, tail: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, C, n], tail [B, C', kernel - stride] (updated in place) -> [B, C', n * stride]. Or all
        three channels-last and 4-D: [B, C, 1, T]. ``rows``: as ``CausalConv1d.step``."""
        # Without bias so the bias is added once per output sample, not once per overlapping input.
        if x.dim() == 3:
            y = F.conv_transpose1d(x, self.conv.weight, None, self.stride, groups=self.conv.groups)
        else:
            y = conv_transpose1d_cl(self.conv, x, bias=False)
        n_out = x.shape[-1] * self.stride
        if self.overlap and _fused_step(y):
            from realtime.kernels.seanet import overlap_add

            return overlap_add(y, tail, self.conv.bias, n_out, rows)
        assert rows is None or self.overlap == 0, "rows= needs the fused step"
        if self.overlap:
            head = y[..., : self.overlap] + tail
            tail.copy_(y[..., n_out:])
            y = torch.cat([head, y[..., self.overlap: n_out]], dim=-1)
        if self.conv.bias is not None:
            bias = self.conv.bias
            y = y + (bias[:, None] if x.dim() == 3 else bias[:, None, None])
        return y


class ResBlock(nn.Module):
    """SEANet residual block: x + conv1(elu(conv_k(elu(x)))) (optionally a 1x1 conv shortcut)."""

    def __init__(self, cfg: MimiConfig, dim: int, dilation: int) -> None:
        super().__init__()
        hidden = dim // cfg.compress
        # ELUs sit at indices 0 and 2 so parameter names match the reference checkpoint (block.1, block.3).
        self.block = nn.ModuleList([
            nn.ELU(), CausalConv1d(dim, hidden, cfg.residual_kernel_size, dilation=dilation),
            nn.ELU(), CausalConv1d(hidden, dim, 1),
        ])
        self.shortcut = CausalConv1d(dim, dim, 1) if cfg.use_conv_shortcut else None

    def convs(self) -> list[CausalConv1d]:
        out = [self.block[1], self.block[3]]
        if self.shortcut is not None:
            out.append(self.shortcut)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block[1](F.elu(x))
        h = self.block[3](F.elu(h))
        return (x if self.shortcut is None else self.shortcut(x)) + h

    def step(self, x: torch.Tensor, states: list[torch.Tensor], rows: torch.Tensor | None = None,
             elu_out: bool = False) -> torch.Tensor:
        """The block's streaming step (``elu_out``: the ELU of its output, for an ELU that follows)."""
        conv_k, conv_1 = self.block[1], self.block[3]
        res = x if self.shortcut is None else self.shortcut.step(x, states[2], rows=rows)
        if _fused_step(x) and conv_k.conv.bias is not None and conv_1.conv.bias is not None:
            from realtime.kernels.seanet import bias_act

            # Each bias in the kernel after its conv: with the ELU, and with the residual add (+ ELU)
            h = bias_act(conv_k.step(x, states[0], elu=True, rows=rows, bias=False), conv_k.conv.bias, elu=True)
            h = conv_1.step(h, states[1], rows=rows, bias=False)
            return bias_act(h, conv_1.conv.bias, residual=res, elu=elu_out)
        h = conv_k.step(x, states[0], elu=True, rows=rows)
        h = conv_1.step(F.elu(h), states[1], rows=rows)  # 1x1: no state to fuse the ELU with
        return F.elu(res + h) if elu_out else res + h


class _SEANet(nn.Module):
    """Shared streaming plumbing: a ``layers`` list of ELU / conv / res-block modules run in order."""

    layers: nn.ModuleList

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.elu(x) if isinstance(layer, nn.ELU) else layer(x)
        return x

    def state_shapes(self) -> list[tuple[int, int]]:
        shapes = []
        for layer in self.layers:
            if isinstance(layer, ResBlock):
                shapes += [c.state_shape() for c in layer.convs()]
            elif isinstance(layer, (CausalConv1d, CausalConvTranspose1d)):
                shapes.append(layer.state_shape())
        return shapes

    def _elu_owners(self) -> list[str | None]:
        """Per layer, for an ELU, which step applies it: "conv" (the CausalConv1d after it, fused
        with its state), "block" (the ResBlock before it, fused with its residual add), or "self";
        None for the other layers. Fixed by the layer list, so worked out once."""
        if getattr(self, "_owners", None) is None:
            layers, owners = list(self.layers), []
            for j, layer in enumerate(layers):
                owner = None
                if isinstance(layer, nn.ELU):
                    if j + 1 < len(layers) and isinstance(layers[j + 1], CausalConv1d):
                        owner = "conv"
                    elif j > 0 and isinstance(layers[j - 1], ResBlock):
                        owner = "block"
                    else:
                        owner = "self"
                owners.append(owner)
            self._owners = owners
        return self._owners

    def step(self, x: torch.Tensor, states: list[torch.Tensor], rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, C, T] -> the layers' streaming output; ``states`` (updated in place) as
        ``state_shapes``; ``rows``: the states are [S, ...] and row b steps row rows[b] of each."""
        owners = self._elu_owners() + [None]
        i = 0
        for j, layer in enumerate(self.layers):
            if isinstance(layer, nn.ELU):
                if owners[j] == "self":
                    x = F.elu(x)
            elif isinstance(layer, ResBlock):
                n = len(layer.convs())
                x = layer.step(x, states[i: i + n], rows, elu_out=owners[j + 1] == "block")
                i += n
            elif isinstance(layer, CausalConvTranspose1d):
                x = layer.step(x, states[i], rows)
                i += 1
            else:
                x = layer.step(x, states[i], elu=j > 0 and owners[j - 1] == "conv", rows=rows)
                i += 1
        assert i == len(states)
        return x


class SEANetEncoder(_SEANet):
    """audio [B, 1, N] -> latents [B, hidden, N / hop]."""

    def __init__(self, cfg: MimiConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = [CausalConv1d(cfg.channels, cfg.num_filters, cfg.kernel_size)]
        scale = 1
        for ratio in reversed(cfg.upsampling_ratios):
            dim = scale * cfg.num_filters
            for j in range(cfg.num_residual_layers):
                layers.append(ResBlock(cfg, dim, cfg.dilation_growth_rate**j))
            layers += [nn.ELU(), CausalConv1d(dim, dim * 2, ratio * 2, stride=ratio)]
            scale *= 2
        layers += [nn.ELU(), CausalConv1d(scale * cfg.num_filters, cfg.hidden_size, cfg.last_kernel_size)]
        self.layers = nn.ModuleList(layers)


class SEANetDecoder(_SEANet):
    """latents [B, hidden, T] -> audio [B, 1, T * hop]."""

    def __init__(self, cfg: MimiConfig) -> None:
        super().__init__()
        scale = 2 ** len(cfg.upsampling_ratios)
        layers: list[nn.Module] = [CausalConv1d(cfg.hidden_size, scale * cfg.num_filters, cfg.kernel_size)]
        for ratio in cfg.upsampling_ratios:
            dim = scale * cfg.num_filters
            layers += [nn.ELU(), CausalConvTranspose1d(dim, dim // 2, ratio * 2, ratio)]
            for j in range(cfg.num_residual_layers):
                layers.append(ResBlock(cfg, dim // 2, cfg.dilation_growth_rate**j))
            scale //= 2
        layers += [nn.ELU(), CausalConv1d(cfg.num_filters, cfg.channels, cfg.last_kernel_size)]
        self.layers = nn.ModuleList(layers)


# --------------------------------------------------------------------------------------------------
# Transformer (causal, sliding window, RoPE, LayerScale)
# --------------------------------------------------------------------------------------------------


class LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + scale * x in one kernel."""
        return torch.addcmul(residual, self.scale, x)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def window_mask(qpos: torch.Tensor, kpos: torch.Tensor, window: int) -> torch.Tensor:
    """qpos [B, n], kpos [B, S] (-1: empty) -> bool [B, 1, n, S]: query t sees key s when
    0 <= qpos[t] - kpos[s] < window."""
    diff = qpos[:, :, None] - kpos[:, None, :]
    return ((kpos[:, None, :] >= 0) & (diff >= 0) & (diff < window))[:, None]


def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, gemv: bool,
            gelu: str | None = None) -> torch.Tensor:
    """x [B, T, C] @ w.T + bias over its B * T rows through ``engines.transformer.project``: the
    decode GEMV when it was measured faster for this weight (``gemv``, see
    ``Transformer.choose_gemv``) and the rows fit it, else cuBLAS. ``gelu`` (F.gelu's
    ``approximate``): the product's GELU, in the GEMV's epilogue where it runs."""
    rows = x.reshape(-1, x.shape[-1])
    y = project(rows, w, bias, gemv) if gelu is None else project_gelu(rows, w, bias, gemv, gelu)
    return y.view(*x.shape[:-1], -1)


class Attention(nn.Module):
    # Whether the fused q|k|v and the output product take the decode GEMV (Transformer.choose_gemv).
    gemv_qkv = gemv_o = False

    def __init__(self, cfg: MimiConfig) -> None:
        super().__init__()
        h, kv, d, c = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.h, self.kv, self.d = h, kv, d
        self.q_proj = nn.Linear(c, h * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(c, kv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(c, kv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, c, bias=cfg.attention_bias)
        self.scale = 1.0 / math.sqrt(d)
        # Non-persistent (None until ``fuse``): absent from state dicts, moved by .to().
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)

    def fuse(self) -> None:
        """One [q|k|v] weight (one GEMM instead of three); the projections' parameters become views
        into it. Call after loading and placing the weights."""
        if self.qkv_weight is None:
            projs = (self.q_proj, self.k_proj, self.v_proj)
            self.qkv_weight = fuse_params([p.weight for p in projs])
            if self.q_proj.bias is not None:
                self.qkv_bias = fuse_params([p.bias for p in projs])

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, C], cos/sin [B or 1, T, D] -> q [B, H, T, D], k, v [B, Hkv, T, D] (RoPE applied)."""
        b, t, _ = x.shape
        if self.qkv_weight is not None:
            q, k, v = _linear(x, self.qkv_weight, self.qkv_bias, self.gemv_qkv).split(
                [self.h * self.d, self.kv * self.d, self.kv * self.d], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, t, self.h, self.d).transpose(1, 2)
        k = k.view(b, t, self.kv, self.d).transpose(1, 2)
        v = v.view(b, t, self.kv, self.d).transpose(1, 2)
        if use_kernels() and x.is_cuda:  # one Triton kernel for both rotations (~10 elementwise kernels)
            from realtime.kernels.rotary import apply_rotary

            return (*apply_rotary(q, k, cos.expand(b, t, self.d), sin.expand(b, t, self.d)), v)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """o_proj of the heads' outputs o [B, T, H * D] (on the decode GEMV where chosen)."""
        return _linear(o, self.o_proj.weight, self.o_proj.bias, self.gemv_o)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, H, Tq, D], k/v [B, Hkv, Tk, D], mask bool [B or 1, 1, Tq, Tk] -> [B, Tq, C]."""
        if self.kv != self.h:
            k = k.repeat_interleave(self.h // self.kv, dim=1)
            v = v.repeat_interleave(self.h // self.kv, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        b, _, t, _ = o.shape
        return self.output(o.transpose(1, 2).reshape(b, t, self.h * self.d))

    def attend_ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor,
                    kpos: torch.Tensor, window: int,
                    new: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                    rows: torch.Tensor | None = None) -> torch.Tensor:
        """``attend`` over a KV ring by positions: q [B, H, n, D] at qpos [B, n], k/v [B, Hkv, C, D]
        at kpos [B, C] (-1 empty); a query sees keys 0 <= qpos - kpos < window -> [B, n, C_out].
        ``new`` = (k_new, v_new [B, Hkv, n, D], ring [B, n]): the step's keys, written into the ring
        at those slots first. On CUDA one Triton kernel (``kernels.window_attention``) does the
        write and the attention and writes the layout o_proj reads. ``rows`` [B] (that path only):
        k, v, kpos are the whole ring [S, ...] and row b attends its row rows[b]."""
        if _fused_step(q):
            from realtime.kernels.window_attention import window_attention

            o = window_attention(q, k, v, qpos, kpos, window, self.scale, new, rows)  # [B, n, H, D]
            b, t = o.shape[:2]
            return self.output(o.reshape(b, t, self.h * self.d))
        from realtime.kernels.window_attention import ring_write_ref

        assert rows is None, "rows= needs the fused step"
        ring_write_ref(k, v, *new)
        return self.attend(q, k, v, window_mask(qpos, kpos, window))


class TransformerLayer(nn.Module):
    # Whether the MLP's two products take the decode GEMV (Transformer.choose_gemv); fc1's GEMV
    # applies a GELU activation itself.
    gemv_fc1 = gemv_fc2 = False

    def __init__(self, cfg: MimiConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.mlp.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size)
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.gelu = _GEMV_GELU.get(cfg.hidden_act)  # the GEMV's epilogue form of act, or None

    def mlp_out(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP of the normalised input h [B, T, C] (without the LayerScale residual)."""
        fc1, fc2 = self.mlp.fc1, self.mlp.fc2
        if self.gelu is not None:
            a = _linear(h, fc1.weight, fc1.bias, self.gemv_fc1, self.gelu)
        else:
            a = self.act(_linear(h, fc1.weight, fc1.bias, self.gemv_fc1))
        return _linear(a, fc2.weight, fc2.bias, self.gemv_fc2)

    def mlp_block(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp_layer_scale.add_to(x, self.mlp_out(self.post_attention_layernorm(x)))


@dataclass
class KVState:
    """Ring-buffer KV cache of one transformer, one row per slot.

    kv [2, L, B, Hkv, Cw, D]: keys then values, with Cw = ``Transformer.ring_size()``: the W - 1
    past keys that complete a query's window (it also sees itself), plus one code frame's new keys.
    kp [B, Cw + 1] long: the absolute position held by each ring slot (-1 = empty), then the slot's
    next position. One tensor each, so a batch of slots is gathered and written back in two kernels
    (``select`` / ``write``).
    """

    kv: torch.Tensor
    kp: torch.Tensor

    @property
    def k(self) -> torch.Tensor:
        return self.kv[0]

    @property
    def v(self) -> torch.Tensor:
        return self.kv[1]

    @property
    def kv_pos(self) -> torch.Tensor:
        return self.kp[:, :-1]

    @property
    def pos(self) -> torch.Tensor:
        return self.kp[:, -1]

    def select(self, slots: torch.Tensor) -> KVState:
        """A copy of the rows ``slots`` (graph-capturable: ``slots`` is a device tensor)."""
        return KVState(self.kv[:, :, slots], self.kp[slots])

    def write(self, slots: torch.Tensor, part: KVState) -> None:
        """Store ``part`` (from ``select``) back into the rows ``slots``."""
        self.kv[:, :, slots] = part.kv
        self.kp[slots] = part.kp

    def reset(self, mask: torch.Tensor) -> None:
        self.kv_pos.masked_fill_(mask[:, None], -1)
        # RoPE scores and the window mask depend on position differences only, so restarting at 0 is
        # not needed for correctness; it keeps positions small (fp32 RoPE precision on long sessions).
        self.pos.masked_fill_(mask, 0)


def _add_norm(x: torch.Tensor, h: torch.Tensor, ls: LayerScale, ln: nn.LayerNorm | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x + ls.scale * h, and ``ln`` of it (None: no norm follows) -> (new x, its norm). On CUDA one
    Triton kernel (``kernels.layernorm``) does both; elsewhere an addcmul and the LayerNorm."""
    if ln is not None and use_kernels() and x.is_cuda:
        from realtime.kernels.layernorm import scale_add_layernorm

        y, s = scale_add_layernorm(x, h, ls.scale, ln.weight, ln.bias, ln.eps)
        return s, y
    x = ls.add_to(x, h)
    return x, None if ln is None else ln(x)


class Transformer(nn.Module):
    """Causal sliding-window transformer on [B, T, C] latents."""

    def __init__(self, cfg: MimiConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList([TransformerLayer(cfg) for _ in range(cfg.num_layers)])
        self.window = cfg.sliding_window
        self.cfg = cfg
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _rope(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [B, T] long -> cos, sin [B, T, D] (computed in fp32 like the reference, then cast)."""
        freqs = pos.float()[..., None] * self.inv_freq.float()
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Offline: x [B, T, C] -> [B, T, C], positions 0 .. T-1."""
        t = x.shape[1]
        pos = torch.arange(t, device=x.device)
        cos, sin = self._rope(pos[None], x.dtype)
        diff = pos[:, None] - pos[None, :]
        mask = ((diff >= 0) & (diff < self.window))[None, None]
        for layer in self.layers:
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
            x = layer.self_attn_layer_scale.add_to(x, layer.self_attn.attend(q, k, v, mask))
            x = layer.mlp_block(x)
        return x

    def choose_gemv(self) -> None:
        """For each product of a decode step, whether the Triton GEMV beats cuBLAS at a step's few
        rows (measured once per weight shape on CUDA, see ``engines.transformer.use_gemv``; False
        on the CPU or with the kernels off). Call outside graph capture: the measurement syncs."""
        for layer in self.layers:
            att, mlp = layer.self_attn, layer.mlp
            att.gemv_qkv = att.qkv_weight is not None and use_gemv(att.qkv_weight, att.qkv_bias)
            att.gemv_o = use_gemv(att.o_proj.weight, att.o_proj.bias)
            layer.gemv_fc1 = use_gemv(mlp.fc1.weight, mlp.fc1.bias, gelu=layer.gelu)
            layer.gemv_fc2 = use_gemv(mlp.fc2.weight, mlp.fc2.bias)

    def ring_size(self) -> int:
        """KV ring slots per row: the W - 1 past keys a query needs, plus room for one code frame's
        tokens, so a step of one frame writes its keys first and attends over the ring alone."""
        return max(self.window - 1, 1) + self.cfg.resample_stride

    def new_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> KVState:
        cw = self.ring_size()
        shape = (2, len(self.layers), batch, self.cfg.num_kv_heads, cw, self.cfg.head_dim)
        kp = torch.full((batch, cw + 1), -1, device=device, dtype=torch.long)
        kp[:, -1] = 0
        return KVState(kv=torch.zeros(shape, device=device, dtype=dtype), kp=kp)

    def writes_first(self, n: int) -> bool:
        """Whether a step of n tokens writes its keys into the ring before attending (see ``step``)."""
        return n + max(self.window - 1, 0) <= self.ring_size()

    def step(self, x: torch.Tensor, st: KVState, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Streaming: x [B, n, C] (the next n tokens of every slot) -> [B, n, C]; ``st`` updated in place.

        When the ring has room for the n new keys beside the W - 1 past ones they need (a step of one
        code frame), the keys go into the ring first and the queries attend over the ring alone. A
        longer step attends over [ring, new keys] and then keeps the last ones in the ring. Either
        way the position mask, not the ring order, decides what a query sees. ``rows`` [B] (a
        write-first step on the fused path only): ``st`` holds S rows and row b of x steps st's row
        rows[b] in place."""
        b, n, _ = x.shape
        cw = st.kv_pos.shape[1]
        first = self.writes_first(n)  # write first: nothing a query needs is overwritten
        if first:  # positions, ring slots, RoPE angles, the ring's positions (one kernel where fused)
            from realtime.kernels.window_attention import ring_positions, ring_positions_ref

            positions = ring_positions if _fused_step(x) else ring_positions_ref
            qpos, ring, cos, sin = positions(st.kp, self.inv_freq, n, x.dtype, rows)
        else:
            assert rows is None, "rows= needs a write-first step"
            qpos = st.pos[:, None] + torch.arange(n, device=x.device)  # [B, n]
            cos, sin = self._rope(qpos, x.dtype)
            keep = min(n, cw)  # only the last Cw new tokens can ever be needed again
            ring = qpos[:, n - keep:] % cw
            mask = window_mask(qpos, torch.cat([st.kv_pos, qpos], dim=1), self.window)  # keys: [ring, new]
            idx = ring[:, None, :, None].expand(b, self.cfg.num_kv_heads, keep, self.cfg.head_dim)
        h = self.layers[0].input_layernorm(x)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.self_attn.qkv(h, cos, sin)
            kc, vc = st.k[i], st.v[i]
            if first:
                a = layer.self_attn.attend_ring(q, kc, vc, qpos, st.kv_pos, self.window, (k, v, ring), rows)
            else:
                a = layer.self_attn.attend(q, torch.cat([kc, k], dim=2), torch.cat([vc, v], dim=2), mask)
                kc.scatter_(2, idx, k[:, :, n - keep:])
                vc.scatter_(2, idx, v[:, :, n - keep:])
            x, h = _add_norm(x, a, layer.self_attn_layer_scale, layer.post_attention_layernorm)
            m = layer.mlp_out(h)
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else None
            x, h = _add_norm(x, m, layer.mlp_layer_scale, nxt)
        if not first:
            st.kv_pos.scatter_(1, ring, qpos[:, n - keep:])
            st.pos.add_(n)
        return x


# --------------------------------------------------------------------------------------------------
# Split residual vector quantizer
# --------------------------------------------------------------------------------------------------


class RVQ(nn.Module):
    """Residual VQ with optional 1x1 in/out projections.  ``codebooks`` [K, card, dim] kept in fp32."""

    def __init__(self, cfg: MimiConfig, n_q: int) -> None:
        super().__init__()
        self.register_buffer("codebooks", torch.zeros(n_q, cfg.codebook_size, cfg.codebook_dim))
        self.input_proj = self.output_proj = None
        if cfg.codebook_dim != cfg.hidden_size:
            self.input_proj = nn.Conv1d(cfg.hidden_size, cfg.codebook_dim, 1, bias=False)
            self.output_proj = nn.Conv1d(cfg.codebook_dim, cfg.hidden_size, 1, bias=False)

    def encode(self, x: torch.Tensor, n_q: int) -> torch.Tensor:
        """x [B, C, T] -> codes [B, n_q, T]."""
        if self.input_proj is not None:
            x = self.input_proj(x)
        b, d, t = x.shape
        residual = x.transpose(1, 2).reshape(b * t, d).float()
        codes = []
        for i in range(n_q):
            cb = self.codebooks[i].float()
            # Same distance as the reference (cdist in fp32, argmin), so codes match exactly.
            idx = torch.cdist(residual[None], cb[None], p=2)[0].argmin(dim=-1)
            residual = residual - F.embedding(idx, cb)
            codes.append(idx.view(b, t))
        return torch.stack(codes, dim=1)

    def decode(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """codes [B, k, T] -> [B, C, T]."""
        # One gather from the k codebooks laid end to end, then the fp32 sum over k (not k
        # lookups and adds: ~2k kernels a step).
        k = codes.shape[1]
        cb = self.codebooks[:k].float()  # [k, card, dim]
        card = cb.shape[1]
        idx = codes + (torch.arange(k, device=codes.device) * card)[None, :, None]
        q = F.embedding(idx, cb.reshape(k * card, -1)).sum(dim=1)  # [B, T, dim]
        q = q.transpose(1, 2).to(dtype)
        return q if self.output_proj is None else self.output_proj(q)


class SplitRVQ(nn.Module):
    def __init__(self, cfg: MimiConfig, num_codebooks: int) -> None:
        super().__init__()
        self.n_sem = cfg.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = RVQ(cfg, self.n_sem)
        self.acoustic_residual_vector_quantizer = RVQ(cfg, num_codebooks - self.n_sem)

    def encode(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """x [B, C, T] -> [B, k, T]; both RVQs see the same input (the acoustic one is not a residual of
        the semantic one)."""
        codes = self.semantic_residual_vector_quantizer.encode(x, self.n_sem)
        if k > self.n_sem:
            codes = torch.cat([codes, self.acoustic_residual_vector_quantizer.encode(x, k - self.n_sem)], dim=1)
        return codes

    def decode(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = self.semantic_residual_vector_quantizer.decode(codes[:, : self.n_sem], dtype)
        if codes.shape[1] > self.n_sem:
            out = out + self.acoustic_residual_vector_quantizer.decode(codes[:, self.n_sem:], dtype)
        return out

    def folded_table(self) -> torch.Tensor:
        """Every codebook with its quantizer's output projection folded in: [K, card, C] float32,
        table[k] = codebook_k @ W.T, semantic codebooks first (``kernels.codebook``: a step's
        decode is then one gather-and-sum). Made once per weights and device, then cached."""
        rvqs = (self.semantic_residual_vector_quantizer, self.acoustic_residual_vector_quantizer)
        params = [q.codebooks for q in rvqs] + [q.output_proj.weight for q in rvqs if q.output_proj is not None]
        key = tuple((t.data_ptr(), t._version, t.device) for t in params)
        if getattr(self, "_folded_key", None) != key:
            parts = []
            with torch.no_grad():
                for q in rvqs:
                    cb = q.codebooks.float()  # [k, card, dim]
                    if q.output_proj is not None:
                        cb = cb @ q.output_proj.weight[:, :, 0].float().t()  # [k, card, C]
                    parts.append(cb)
            self._folded, self._folded_key = torch.cat(parts).contiguous(), key
        return self._folded


# --------------------------------------------------------------------------------------------------
# The codec
# --------------------------------------------------------------------------------------------------


class Mimi(nn.Module):
    """Mimi codec.  Build with ``Mimi.from_pretrained``; use ``encode``/``decode`` offline, or
    ``streaming_encoder``/``streaming_decoder`` for per-slot streaming state objects."""

    def __init__(self, cfg: MimiConfig, num_codebooks: int | None = None) -> None:
        super().__init__()
        cfg.validate()
        k = cfg.num_quantizers if num_codebooks is None else num_codebooks
        if not cfg.num_semantic_quantizers <= k <= cfg.num_quantizers:
            raise ConfigError(
                f"num_codebooks {k} must be in [{cfg.num_semantic_quantizers}, {cfg.num_quantizers}]"
            )
        self.cfg = cfg
        self.num_codebooks = k
        self.sample_rate = cfg.sample_rate
        self.frame_size = cfg.frame_size
        self.frame_rate = cfg.frame_rate
        self.encoder = SEANetEncoder(cfg)
        self.encoder_transformer = Transformer(cfg)
        self.downsample = CausalConv1d(cfg.hidden_size, cfg.hidden_size, cfg.resample_kernel,
                                       stride=cfg.resample_stride, bias=False, replicate=True)
        self.upsample = CausalConvTranspose1d(cfg.hidden_size, cfg.hidden_size, cfg.resample_kernel,
                                              cfg.resample_stride, groups=cfg.upsample_groups, bias=False)
        self.decoder_transformer = Transformer(cfg)
        self.decoder = SEANetDecoder(cfg)
        self.quantizer = SplitRVQ(cfg, k)

    # ---- loading ---------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, num_codebooks: int | None = None) -> Mimi:
        """Load a ``MimiModel.save_pretrained`` folder, or the ``codec_model.*`` part of a
        ``CsmForConditionalGeneration.save_pretrained`` folder (config.json with ``codec_config``).

        ``num_codebooks`` defaults to the CSM model's ``num_codebooks`` (CSM folder) or all quantizers.
        """
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelFormatError(f"no config.json in {path}")
        try:
            raw = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as e:
            raise ModelFormatError(f"unreadable config.json in {path}: {e}") from None
        if not isinstance(raw, dict):
            raise ModelFormatError("config.json is not an object")
        if "codec_config" in raw:
            prefix, hf_cfg = "codec_model.", raw["codec_config"]
            if not isinstance(hf_cfg, dict):
                raise ModelFormatError("codec_config is not an object")
            if num_codebooks is None and raw.get("num_codebooks") is not None:
                num_codebooks = int(raw["num_codebooks"])
        elif raw.get("model_type") == "mimi":
            prefix, hf_cfg = "", raw
        else:
            raise ModelFormatError(
                f"{cfg_file}: neither a Mimi config (model_type 'mimi') nor a CSM config with codec_config"
            )
        cfg = MimiConfig.from_hf(hf_cfg)
        if num_codebooks is not None and num_codebooks > cfg.num_quantizers:
            raise ModelFormatError(f"num_codebooks {num_codebooks} > codec's {cfg.num_quantizers} quantizers")
        tensors = _read_safetensors(path, prefix)
        model = cls(cfg, num_codebooks)  # built in fp32 on CPU, loaded, then moved
        model._load_hf_state(tensors)
        model.to(device=device, dtype=dtype)
        # Codebooks stay fp32: nearest-neighbour search and the 32-way sum are precision sensitive and tiny.
        for rvq in (model.quantizer.semantic_residual_vector_quantizer, model.quantizer.acoustic_residual_vector_quantizer):
            rvq.codebooks = rvq.codebooks.float()
        for tr in (model.encoder_transformer, model.decoder_transformer):
            tr.inv_freq = tr.inv_freq.float()
            for layer in tr.layers:
                layer.self_attn.fuse()
        model.eval().requires_grad_(False)
        return model

    def _expected_hf_keys(self) -> dict[str, tuple[int, ...] | None]:
        """Checkpoint key -> shape (None: any shape), for ALL quantizers of the config."""
        cfg = self.cfg
        keys: dict[str, tuple[int, ...] | None] = {}
        for name, t in self.state_dict().items():
            if name.endswith(".codebooks"):
                continue
            keys[name] = tuple(t.shape)
        for part, n in (("semantic", cfg.num_semantic_quantizers),
                        ("acoustic", cfg.num_quantizers - cfg.num_semantic_quantizers)):
            for i in range(n):
                base = f"quantizer.{part}_residual_vector_quantizer.layers.{i}.codebook."
                keys[base + "initialized"] = (1,)
                keys[base + "cluster_usage"] = (cfg.codebook_size,)
                keys[base + "embed_sum"] = (cfg.codebook_size, cfg.codebook_dim)
        return keys

    def _load_hf_state(self, tensors: dict[str, torch.Tensor]) -> None:
        expected = self._expected_hf_keys()
        missing = sorted(set(expected) - set(tensors))
        unexpected = sorted(set(tensors) - set(expected))
        if missing or unexpected:
            raise ModelFormatError(
                f"Mimi checkpoint keys do not match: missing {_abbrev(missing)}, unexpected {_abbrev(unexpected)}"
            )
        bad = [f"{k} {tuple(tensors[k].shape)} != {s}" for k, s in expected.items()
               if s is not None and tuple(tensors[k].shape) != s]
        if bad:
            raise ModelFormatError(f"Mimi checkpoint shapes do not match: {_abbrev(bad)}")
        own = {k: v.float() for k, v in tensors.items() if ".codebook." not in k}
        for part, rvq in (("semantic", self.quantizer.semantic_residual_vector_quantizer),
                          ("acoustic", self.quantizer.acoustic_residual_vector_quantizer)):
            embeds = []
            for i in range(rvq.codebooks.shape[0]):
                base = f"quantizer.{part}_residual_vector_quantizer.layers.{i}.codebook."
                usage = tensors[base + "cluster_usage"].float()
                embeds.append(tensors[base + "embed_sum"].float() / usage.clamp(min=1e-5)[:, None])
            own[f"quantizer.{part}_residual_vector_quantizer.codebooks"] = (
                torch.stack(embeds) if embeds else rvq.codebooks.new_zeros(rvq.codebooks.shape)
            )
        result = self.load_state_dict(own, strict=True)
        assert not result.missing_keys and not result.unexpected_keys

    # ---- offline ---------------------------------------------------------------------------------

    @property
    def _dtype(self) -> torch.dtype:
        return self.decoder.layers[0].conv.weight.dtype

    def _check_codes(self, codes: torch.Tensor) -> None:
        if codes.dim() != 3 or not 1 <= codes.shape[1] <= self.num_codebooks:
            raise UnsupportedError(
                f"codes must be [B, K<= {self.num_codebooks}, T], got {tuple(codes.shape)}"
            )

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes LongTensor [B, K, T] -> audio [B, 1, T * frame_size]."""
        self._check_codes(codes)
        x = self.upsample(self.quantizer.decode(codes, self._dtype))
        x = self.decoder_transformer(x.transpose(1, 2)).transpose(1, 2)
        return self.decoder(x)

    @torch.no_grad()
    def encode(self, audio: torch.Tensor) -> torch.Tensor:
        """audio [B, 1, N] -> codes LongTensor [B, K, ceil(N / frame_size)] (K = num_codebooks)."""
        if audio.dim() != 3 or audio.shape[1] != self.cfg.channels:
            raise UnsupportedError(f"audio must be [B, {self.cfg.channels}, N], got {tuple(audio.shape)}")
        x = self.encoder(audio.to(self._dtype))
        x = self.encoder_transformer(x.transpose(1, 2)).transpose(1, 2)
        return self.quantizer.encode(self.downsample(x), self.num_codebooks)

    # ---- streaming -------------------------------------------------------------------------------

    def streaming_decoder(self, batch_size: int, channels_last: bool | None = None) -> MimiStreamingDecoder:
        return MimiStreamingDecoder(self, batch_size, channels_last)

    def streaming_encoder(self, batch_size: int) -> MimiStreamingEncoder:
        return MimiStreamingEncoder(self, batch_size)


def _abbrev(items: list[str], n: int = 8) -> str:
    if not items:
        return "[]"
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return "[" + ", ".join(items[:n]) + "]" + more


def _read_safetensors(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Tensors under ``prefix`` (prefix stripped) from model.safetensors or a sharded index."""
    from safetensors import safe_open

    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelFormatError(f"bad {index.name}: {e}") from None
        files = sorted({path / f for k, f in weight_map.items() if k.startswith(prefix)})
    else:
        raise ModelFormatError(f"no model.safetensors(.index.json) in {path}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    if k.startswith(prefix):
                        out[k[len(prefix):]] = sf.get_tensor(k)
        except (OSError, ValueError, RuntimeError) as e:
            raise ModelFormatError(f"cannot read {f.name}: {e}") from None
    if not out:
        raise ModelFormatError(f"no tensors with prefix {prefix!r} in {path}")
    return out


def _slot_mask(mask: torch.Tensor | Iterable[bool] | None, batch: int, device: torch.device) -> torch.Tensor:
    if mask is None:
        return torch.ones(batch, dtype=torch.bool, device=device)
    m = torch.as_tensor(mask, dtype=torch.bool, device=device)
    if m.shape != (batch,):
        raise UnsupportedError(f"reset mask must have shape [{batch}], got {tuple(m.shape)}")
    return m


def _state_views(flat: torch.Tensor, shapes: list[tuple[int, int]], layouts: list[bool]) -> list[torch.Tensor]:
    """Views of one [B, total] buffer, one per (C, n) state: [B, C, n], or channels-last [B, C, 1, n]
    (stored time-major) where ``layouts`` says so."""
    out, o, b = [], 0, flat.shape[0]
    for (c, n), cl in zip(shapes, layouts, strict=True):
        part = flat[:, o: o + c * n]
        o += c * n
        out.append(part.view(b, n, c).transpose(1, 2).unsqueeze(2) if cl else part.view(b, c, n))
    assert o == flat.shape[1]
    return out


class MimiStreamingDecoder:
    """Per-slot streaming decoder state.  ``step(codes [B, K, n]) -> audio [B, 1, n * frame_size]``.

    State (all fixed size, written in place): the upsample conv's overlap tail, the decoder
    transformer's KV ring (W - 1 past tokens + one frame's, per layer) and every SEANet conv's left context /
    transposed conv's overlap tail.  Output sample p of a slot equals ``Mimi.decode`` of that slot's
    codes since its last reset, for every p (see the module docstring).

    Layout: the conv states are views of one [B, total] buffer and the KV ring is two tensors, so
    ``step(codes, slots)`` (a batch of some slots, as the server runs it) gathers and writes back a
    slot's whole state in three kernels each. Where the step runs on the kernels (``_fused_step``,
    a write-first transformer step) and ``in_place`` is set (the default), it gathers nothing:
    every kernel that touches a state reads and writes the slots' rows of the whole state in
    place. With ``channels_last`` (the default on CUDA in bf16 and fp16) the SEANet decoder runs on channels-last 4-D activations [B, C, 1, T], which cuDNN
    convolves without layout transposes. On the CPU, and in float32 (the parity mode), the plain
    [B, C, T] path stays: there cuDNN's TF32 convs pick their algorithm by batch size in either
    layout, and a graphed bucket would not equal an eager step to float32 precision.
    """

    def __init__(self, mimi: Mimi, batch_size: int, channels_last: bool | None = None) -> None:
        if batch_size < 1:
            raise ConfigError("batch_size must be >= 1")
        self.mimi = mimi
        self.batch_size = batch_size
        w = mimi.decoder.layers[0].conv.weight
        dev, dt = w.device, w.dtype
        if channels_last is None:  # REALTIME_MIMI_CHANNELS_LAST=0/1 overrides the default (for A/B runs)
            env = os.environ.get("REALTIME_MIMI_CHANNELS_LAST", "").strip()
            channels_last = env != "0" if env else dev.type == "cuda" and dt in (torch.bfloat16, torch.float16)
        self.channels_last = bool(channels_last)
        conv_shapes = mimi.decoder.state_shapes()
        self._shapes = [mimi.upsample.state_shape(), *conv_shapes]
        self._layouts = [False] + [self.channels_last] * len(conv_shapes)  # the upsample runs before the transformer
        self.state = torch.zeros(batch_size, sum(c * n for c, n in self._shapes), device=dev, dtype=dt)
        self.upsample_tail, *self.convs = _state_views(self.state, self._shapes, self._layouts)
        self.kv = mimi.decoder_transformer.new_state(batch_size, dev, dt)
        mimi.decoder_transformer.choose_gemv()  # the step's products: GEMV or cuBLAS, measured per shape
        if _fused_step(self.state):
            mimi.quantizer.folded_table()  # made now, outside any graph capture
        self.in_place = True  # False: always gather a slot subset's state and write it back (A/B runs)

    @torch.no_grad()
    def step(self, codes: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """codes LongTensor [B, K, n] -> audio [B, 1, n * frame_size], for all slots (B = batch_size)
        or for the slots ``slots`` [B] (a device tensor, so the call can be captured in a CUDA graph;
        a slot listed twice is stepped twice from the same state, and one of the writes wins)."""
        m = self.mimi
        m._check_codes(codes)
        if slots is None:
            assert codes.shape[0] == self.batch_size, "codes batch must equal the decoder's batch_size"
            return self._step(codes, self.upsample_tail, self.convs, self.kv)
        assert codes.shape[0] == slots.shape[0], "one row of codes per slot"
        tokens = codes.shape[-1] * m.cfg.resample_stride  # the transformer's step length
        if self.in_place and m.decoder_transformer.writes_first(tokens) and _fused_step(self.state):
            # On the kernels, each state-touching kernel steps the slots' rows in place (they
            # read the slot list as a contiguous vector: no copy when it already is).
            return self._step(codes, self.upsample_tail, self.convs, self.kv, slots.contiguous())
        state, kv = self.state[slots], self.kv.select(slots)
        tail, *convs = _state_views(state, self._shapes, self._layouts)
        out = self._step(codes, tail, convs, kv)
        self.state[slots] = state
        self.kv.write(slots, kv)
        return out

    def _step(self, codes: torch.Tensor, tail: torch.Tensor, convs: list[torch.Tensor], kv: KVState,
              rows: torch.Tensor | None = None) -> torch.Tensor:
        m = self.mimi
        if _fused_step(self.state) and codes.shape[1] == m.num_codebooks:
            from realtime.kernels.codebook import codebook_sum

            # RVQ decode as one gather-and-sum over the projection-folded codebooks
            latents = codebook_sum(codes, m.quantizer.folded_table(), m._dtype)
        else:
            latents = m.quantizer.decode(codes, m._dtype)
        x = m.upsample.step(latents, tail, rows)
        # Time-major [B, T, C] into the transformer, so its output, seen as [B, C, T], is channels-last.
        x = m.decoder_transformer.step(x.transpose(1, 2).contiguous(), kv, rows).transpose(1, 2)
        if self.channels_last:
            return from_cl(m.decoder.step(to_cl(x), convs, rows))
        return m.decoder.step(x, convs, rows)

    def reset(self, mask: torch.Tensor | None = None) -> None:
        """Restart the streams of the slots where ``mask`` [B] is True (all slots when None)."""
        m = _slot_mask(mask, self.batch_size, self.state.device)
        # Stale KV entries need no clearing: kv_pos = -1 masks them out.
        self.state.masked_fill_(m[:, None], 0)
        self.kv.reset(m)


class MimiStreamingEncoder:
    """Per-slot streaming encoder state.  ``step(audio [B, 1, n * frame_size]) -> codes [B, K, n]``.

    Equal to ``Mimi.encode`` of the slot's audio since its last reset, frame for frame.
    """

    def __init__(self, mimi: Mimi, batch_size: int) -> None:
        if batch_size < 1:
            raise ConfigError("batch_size must be >= 1")
        self.mimi = mimi
        self.batch_size = batch_size
        w = mimi.encoder.layers[0].conv.weight
        dev, dt = w.device, w.dtype
        self.convs = [torch.zeros(batch_size, *s, device=dev, dtype=dt) for s in mimi.encoder.state_shapes()]
        self.kv = mimi.encoder_transformer.new_state(batch_size, dev, dt)
        self.down = torch.zeros(batch_size, *mimi.downsample.state_shape(), device=dev, dtype=dt)
        # Slots whose next step is their first: the downsample conv's replicate padding needs it.
        self.fresh = torch.ones(batch_size, dtype=torch.bool, device=dev)

    @torch.no_grad()
    def step(self, audio: torch.Tensor) -> torch.Tensor:
        """audio [B, 1, n * frame_size] -> codes LongTensor [B, K, n]."""
        m = self.mimi
        if audio.dim() != 3 or audio.shape[1] != m.cfg.channels or audio.shape[-1] % m.frame_size:
            raise UnsupportedError(
                f"streaming audio must be [B, {m.cfg.channels}, n*{m.frame_size}], got {tuple(audio.shape)}"
            )
        assert audio.shape[0] == self.batch_size, "audio batch must equal the encoder's batch_size"
        x = m.encoder.step(audio.to(m._dtype), self.convs)
        x = m.encoder_transformer.step(x.transpose(1, 2), self.kv).transpose(1, 2)
        x = m.downsample.step(x, self.down, self.fresh)
        self.fresh.fill_(False)
        return m.quantizer.encode(x, m.num_codebooks)

    def reset(self, mask: torch.Tensor | None = None) -> None:
        """Restart the streams of the slots where ``mask`` [B] is True (all slots when None)."""
        m = _slot_mask(mask, self.batch_size, self.down.device)
        for t in (*self.convs, self.down):
            t.masked_fill_(m.view(-1, *([1] * (t.dim() - 1))), 0)
        self.fresh.masked_fill_(m, True)
        self.kv.reset(m)
