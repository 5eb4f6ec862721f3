"""Latent -> image decoders: the kl-f8 AutoencoderKL decoder and the TAESD tiny decoder.

Both take *diffusion-space* latents [B, 4, h, w] (what DiT / SD samplers produce, i.e. already
multiplied by the VAE scaling factor) and return images [B, 3, 8h, 8w] in [-1, 1] (the diffusers
convention for both; ``to_unit`` maps to [0, 1] as DiTPipeline does before saving).

- ``KLDecoder``: diffusers ``AutoencoderKL`` (folder ``vae/``): ``z = latents / scaling_factor
  (+ shift_factor)``, post_quant_conv, conv_in, mid block (resnet, single-head self-attention,
  resnet), up blocks (resnets + nearest x2 + conv), GroupNorm/SiLU/conv_out. scaling_factor is
  0.18215 for the SD kl-f8 VAE used by DiT. ``decode_raw(z)`` equals ``AutoencoderKL.decode(z)``.
  Its SD weights overflow in float16; run it in float32 or bfloat16.
- ``TinyDecoder``: the decoder half of diffusers ``AutoencoderTiny`` (TAESD; folder
  ``preview_decoder/``): tanh soft-clamp at +-3, conv/ReLU stacks with residual blocks, nearest x2
  upsampling. Its own scaling_factor is 1.0 for TAESD (it consumes diffusion-space latents
  directly). Cheap enough for per-step previews.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from realtime.errors import ConfigError, ModelFormatError

_WEIGHTS = "diffusion_pytorch_model.safetensors"


def to_unit(images: torch.Tensor) -> torch.Tensor:
    """[-1, 1] images -> [0, 1], clamped (DiTPipeline's ``samples / 2 + 0.5``)."""
    return (images / 2 + 0.5).clamp(0, 1)


def _read(folder: Path, sub: str) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    d = folder / sub if (folder / sub).is_dir() else folder
    cfg_path, w_path = d / "config.json", d / _WEIGHTS
    if not cfg_path.is_file() or not w_path.is_file():
        raise ConfigError(f"no {sub} (config.json + {_WEIGHTS}) under {folder}")
    return json.loads(cfg_path.read_text()), load_file(str(w_path), device="cpu")


def _load_strict(model: nn.Module, sd: dict[str, torch.Tensor], what: str) -> None:
    own = model.state_dict()
    if set(own) != set(sd):
        missing, extra = sorted(set(own) - set(sd)), sorted(set(sd) - set(own))
        raise ModelFormatError(f"{what} weights do not match: missing {missing[:5]}, unexpected {extra[:5]}")
    for k, v in sd.items():
        if own[k].shape != v.shape:
            raise ModelFormatError(f"{what} tensor {k!r} has shape {tuple(v.shape)}, expected {tuple(own[k].shape)}")
    model.load_state_dict(sd, strict=True)


# --------------------------------------------------------------------------- AutoencoderKL


@dataclass(frozen=True)
class KLDecoderConfig:
    latent_channels: int = 4
    out_channels: int = 3
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    norm_num_groups: int = 32
    scaling_factor: float = 0.18215
    shift_factor: float | None = None
    use_post_quant_conv: bool = True
    mid_attention: bool = True

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "KLDecoderConfig":
        name = cfg.get("_class_name", "AutoencoderKL")
        if name != "AutoencoderKL":
            raise ModelFormatError(f"vae class {name!r} is not AutoencoderKL")
        ups = cfg.get("up_block_types", ["UpDecoderBlock2D"])
        if any(u != "UpDecoderBlock2D" for u in ups):
            raise ModelFormatError(f"unsupported VAE up blocks {ups}")
        if cfg.get("act_fn", "silu") != "silu":
            raise ModelFormatError("only SiLU VAEs are supported")
        if cfg.get("latents_mean") is not None or cfg.get("latents_std") is not None:
            raise ModelFormatError("per-channel latents_mean/std VAEs are not supported")
        blocks = tuple(int(c) for c in cfg.get("block_out_channels", (64,)))
        if len(ups) != len(blocks):
            raise ModelFormatError("VAE up_block_types and block_out_channels differ in length")
        shift = cfg.get("shift_factor")
        return cls(
            latent_channels=int(cfg.get("latent_channels", 4)),
            out_channels=int(cfg.get("out_channels", 3)),
            block_out_channels=blocks,
            layers_per_block=int(cfg.get("layers_per_block", 1)),
            norm_num_groups=int(cfg.get("norm_num_groups", 32)),
            scaling_factor=float(cfg.get("scaling_factor", 0.18215)),
            shift_factor=None if shift is None else float(shift),
            use_post_quant_conv=bool(cfg.get("use_post_quant_conv", True)),
            mid_attention=bool(cfg.get("mid_block_add_attention", True)),
        )


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin, eps=1e-6)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, cout, eps=1e-6)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (x if self.shortcut is None else self.shortcut(x)) + h


class SpatialAttention(nn.Module):
    """Single-head self-attention over the H*W positions, GroupNorm first, residual."""

    def __init__(self, c: int, groups: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(groups, c, eps=1e-6)
        self.qkv = nn.Linear(c, 3 * c)
        self.out = nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        t = self.norm(x).view(b, c, h * w).transpose(1, 2)  # [B, T, C]
        q, k, v = self.qkv(t)[:, None].chunk(3, dim=-1)  # each [B, 1, T, C]
        a = F.scaled_dot_product_attention(q, k, v)[:, 0]
        return x + self.out(a).transpose(1, 2).reshape(b, c, h, w)


class KLDecoder(nn.Module):
    """Diffusion latents [B, 4, h, w] -> images [B, 3, 8h, 8w] in [-1, 1] (for 4 up blocks)."""

    def __init__(self, cfg: KLDecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        ch = list(reversed(cfg.block_out_channels))
        g = cfg.norm_num_groups
        self.post_quant = nn.Conv2d(cfg.latent_channels, cfg.latent_channels, 1) if cfg.use_post_quant_conv else None
        self.conv_in = nn.Conv2d(cfg.latent_channels, ch[0], 3, padding=1)
        self.mid_res1 = ResBlock(ch[0], ch[0], g)
        self.mid_attn = SpatialAttention(ch[0], g) if cfg.mid_attention else None
        self.mid_res2 = ResBlock(ch[0], ch[0], g)
        self.ups = nn.ModuleList()
        self.up_convs = nn.ModuleList()
        prev = ch[0]
        for i, c in enumerate(ch):
            res = nn.ModuleList()
            for j in range(cfg.layers_per_block + 1):
                res.append(ResBlock(prev if j == 0 else c, c, g))
            self.ups.append(res)
            if i < len(ch) - 1:
                self.up_convs.append(nn.Conv2d(c, c, 3, padding=1))
            prev = c
        self.norm_out = nn.GroupNorm(g, ch[-1], eps=1e-6)
        self.conv_out = nn.Conv2d(ch[-1], cfg.out_channels, 3, padding=1)

    def decode_raw(self, z: torch.Tensor) -> torch.Tensor:
        """Unscaled VAE latents -> [-1, 1] images; equals diffusers ``AutoencoderKL.decode(z).sample``."""
        if self.post_quant is not None:
            z = self.post_quant(z)
        h = self.mid_res1(self.conv_in(z))
        if self.mid_attn is not None:
            h = self.mid_attn(h)
        h = self.mid_res2(h)
        for i, res in enumerate(self.ups):
            for r in res:
                h = r(h)
            if i < len(self.up_convs):
                h = self.up_convs[i](F.interpolate(h, scale_factor=2.0, mode="nearest"))
        return self.conv_out(F.silu(self.norm_out(h)))

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Diffusion-space latents [B, 4, h, w] -> images [B, 3, 8h, 8w] in [-1, 1] (not clamped)."""
        z = latents / self.cfg.scaling_factor
        if self.cfg.shift_factor is not None:
            z = z + self.cfg.shift_factor
        return self.decode_raw(z.to(self.conv_in.weight.dtype))

    @classmethod
    def from_pretrained(
        cls, folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> "KLDecoder":
        """Load ``folder/vae`` (or ``folder`` itself); encoder tensors are ignored, decoder ones strict."""
        raw_cfg, sd = _read(Path(folder), "vae")
        cfg = KLDecoderConfig.from_diffusers(raw_cfg)
        model = cls(cfg)
        _load_strict(model, _convert_kl(sd, cfg), "VAE decoder")
        return model.to(device=device, dtype=dtype).eval()


def _as_linear(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(w.shape[0], -1) if w.ndim > 2 else w


def _convert_kl(sd: dict[str, torch.Tensor], cfg: KLDecoderConfig) -> dict[str, torch.Tensor]:
    """diffusers AutoencoderKL keys -> ours (decoder only; q/k/v fused)."""
    src = {k: v for k, v in sd.items() if k.startswith("decoder.") or k.startswith("post_quant_conv.")}
    out: dict[str, torch.Tensor] = {}

    def take(key: str) -> torch.Tensor:
        if key not in src:
            raise ModelFormatError(f"VAE checkpoint lacks tensor {key!r}")
        return src.pop(key)

    def res(dst: str, s: str) -> None:
        for n in ("norm1", "conv1", "norm2", "conv2"):
            for p in ("weight", "bias"):
                out[f"{dst}.{n}.{p}"] = take(f"{s}.{n}.{p}")
        if f"{s}.conv_shortcut.weight" in src:
            out[f"{dst}.shortcut.weight"] = take(f"{s}.conv_shortcut.weight")
            out[f"{dst}.shortcut.bias"] = take(f"{s}.conv_shortcut.bias")

    if cfg.use_post_quant_conv:
        out["post_quant.weight"] = take("post_quant_conv.weight")
        out["post_quant.bias"] = take("post_quant_conv.bias")
    for p in ("weight", "bias"):
        out[f"conv_in.{p}"] = take(f"decoder.conv_in.{p}")
        out[f"norm_out.{p}"] = take(f"decoder.conv_norm_out.{p}")
        out[f"conv_out.{p}"] = take(f"decoder.conv_out.{p}")
    res("mid_res1", "decoder.mid_block.resnets.0")
    res("mid_res2", "decoder.mid_block.resnets.1")
    if cfg.mid_attention:
        a = "decoder.mid_block.attentions.0"
        for p in ("weight", "bias"):
            out[f"mid_attn.norm.{p}"] = take(f"{a}.group_norm.{p}")
            # old exports store 1x1-conv-shaped [C, C, 1, 1] projections; flatten to linear
            out[f"mid_attn.qkv.{p}"] = torch.cat([_as_linear(take(f"{a}.to_{n}.{p}")) for n in "qkv"])
            out[f"mid_attn.out.{p}"] = _as_linear(take(f"{a}.to_out.0.{p}"))
    for i in range(len(cfg.block_out_channels)):
        for j in range(cfg.layers_per_block + 1):
            res(f"ups.{i}.{j}", f"decoder.up_blocks.{i}.resnets.{j}")
        if i < len(cfg.block_out_channels) - 1:
            for p in ("weight", "bias"):
                out[f"up_convs.{i}.{p}"] = take(f"decoder.up_blocks.{i}.upsamplers.0.conv.{p}")
    if src:
        raise ModelFormatError(f"VAE checkpoint has unexpected decoder tensors: {sorted(src)[:5]}")
    return out


# --------------------------------------------------------------------------- TAESD


@dataclass(frozen=True)
class TinyDecoderConfig:
    latent_channels: int = 4
    out_channels: int = 3
    block_out_channels: tuple[int, ...] = (64, 64, 64, 64)
    num_blocks: tuple[int, ...] = (3, 3, 3, 1)
    upsampling_factor: int = 2
    scaling_factor: float = 1.0
    shift_factor: float = 0.0

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "TinyDecoderConfig":
        name = cfg.get("_class_name", "AutoencoderTiny")
        if name != "AutoencoderTiny":
            raise ModelFormatError(f"preview decoder class {name!r} is not AutoencoderTiny")
        if cfg.get("act_fn", "relu") != "relu" or cfg.get("upsample_fn", "nearest") != "nearest":
            raise ModelFormatError("only ReLU / nearest-upsampling TAESD decoders are supported")
        blocks = tuple(int(c) for c in cfg.get("decoder_block_out_channels", (64, 64, 64, 64)))
        nums = tuple(int(n) for n in cfg.get("num_decoder_blocks", (3, 3, 3, 1)))
        if len(blocks) != len(nums):
            raise ModelFormatError("TAESD decoder_block_out_channels and num_decoder_blocks differ in length")
        return cls(
            latent_channels=int(cfg.get("latent_channels", 4)),
            out_channels=int(cfg.get("out_channels", 3)),
            block_out_channels=blocks,
            num_blocks=nums,
            upsampling_factor=int(cfg.get("upsampling_scaling_factor", 2)),
            scaling_factor=float(cfg.get("scaling_factor", 1.0)),
            shift_factor=float(cfg.get("shift_factor", 0.0) or 0.0),
        )


class TinyBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.conv3 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1, bias=False) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv3(F.relu(self.conv2(F.relu(self.conv1(x)))))
        return F.relu(h + (x if self.skip is None else self.skip(x)))


class TinyDecoder(nn.Module):
    """TAESD: diffusion latents [B, 4, h, w] -> images [B, 3, 8h, 8w] in [-1, 1] (for 4 stages)."""

    def __init__(self, cfg: TinyDecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        ch = cfg.block_out_channels
        self.conv_in = nn.Conv2d(cfg.latent_channels, ch[0], 3, padding=1)
        self.stages = nn.ModuleList()
        self.stage_convs = nn.ModuleList()
        for i, n in enumerate(cfg.num_blocks):
            last = i == len(cfg.num_blocks) - 1
            self.stages.append(nn.ModuleList(TinyBlock(ch[i], ch[i]) for _ in range(n)))
            # the last conv maps to RGB (with bias); intermediate ones are bias-free, as TAESD
            self.stage_convs.append(nn.Conv2d(ch[i], cfg.out_channels if last else ch[i], 3, padding=1, bias=last))

    def decode_raw(self, z: torch.Tensor) -> torch.Tensor:
        """Equals diffusers ``AutoencoderTiny.decode(z).sample``."""
        h = F.relu(self.conv_in(torch.tanh(z / 3) * 3))
        n = len(self.stages)
        for i in range(n):
            for blk in self.stages[i]:
                h = blk(h)
            if i < n - 1:
                h = F.interpolate(h, scale_factor=self.cfg.upsampling_factor, mode="nearest")
            h = self.stage_convs[i](h)
        return h * 2 - 1

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Diffusion-space latents -> [-1, 1] images (not clamped)."""
        z = latents / self.cfg.scaling_factor + self.cfg.shift_factor
        return self.decode_raw(z.to(self.conv_in.weight.dtype))

    @classmethod
    def from_pretrained(
        cls, folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> "TinyDecoder":
        """Load ``folder/preview_decoder`` (or ``folder``); encoder tensors ignored, decoder strict."""
        raw_cfg, sd = _read(Path(folder), "preview_decoder")
        cfg = TinyDecoderConfig.from_diffusers(raw_cfg)
        model = cls(cfg)
        _load_strict(model, _convert_tiny(sd, cfg), "TAESD decoder")
        return model.to(device=device, dtype=dtype).eval()


def _convert_tiny(sd: dict[str, torch.Tensor], cfg: TinyDecoderConfig) -> dict[str, torch.Tensor]:
    """diffusers AutoencoderTiny ``decoder.layers.{i}`` (a flat Sequential) -> our staged names."""
    src = {k: v for k, v in sd.items() if k.startswith("decoder.")}
    out: dict[str, torch.Tensor] = {}

    def take(key: str) -> torch.Tensor:
        if key not in src:
            raise ModelFormatError(f"TAESD checkpoint lacks tensor {key!r}")
        return src.pop(key)

    out["conv_in.weight"] = take("decoder.layers.0.weight")
    out["conv_in.bias"] = take("decoder.layers.0.bias")
    idx = 2  # Sequential: conv, relu, then per stage: blocks, [upsample], conv
    n = len(cfg.num_blocks)
    for i, nb in enumerate(cfg.num_blocks):
        for j in range(nb):
            s, d = f"decoder.layers.{idx}", f"stages.{i}.{j}"
            for k in range(3):
                out[f"{d}.conv{k + 1}.weight"] = take(f"{s}.conv.{2 * k}.weight")
                out[f"{d}.conv{k + 1}.bias"] = take(f"{s}.conv.{2 * k}.bias")
            if f"{s}.skip.weight" in src:
                out[f"{d}.skip.weight"] = take(f"{s}.skip.weight")
            idx += 1
        if i < n - 1:
            idx += 1  # nn.Upsample has no parameters
        out[f"stage_convs.{i}.weight"] = take(f"decoder.layers.{idx}.weight")
        if i == n - 1:
            out[f"stage_convs.{i}.bias"] = take(f"decoder.layers.{idx}.bias")
        idx += 1
    if src:
        raise ModelFormatError(f"TAESD checkpoint has unexpected decoder tensors: {sorted(src)[:5]}")
    return out
