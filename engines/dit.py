"""Class-conditional DiT (Peebles & Xie 2022) denoiser, loaded from a diffusers checkpoint.

Checkpoint: a diffusers folder whose ``transformer/`` holds ``config.json`` (class
``DiTTransformer2DModel``) and ``diffusion_pytorch_model.safetensors`` — the layout of
facebook/DiT-XL-2-256 and -512. The math follows diffusers' ``DiTTransformer2DModel`` exactly
(proven in tests/engines/test_dit.py): patchify conv + fixed 2-D sin-cos positions, N blocks of
adaLN-Zero self-attention + GELU(tanh) MLP, an adaLN final layer, unpatchify. Learned sigma:
``out_channels == 2 * in_channels`` (eps first, then the variance interpolation channels).

Conditioning: the sinusoidal timestep embedding (256 channels, cos first, frequency shift 1, as
diffusers) through a 2-layer SiLU MLP, plus a class-embedding row. Class ``num_classes`` (1000 for
ImageNet) is the learned null class used for classifier-free guidance.

diffusers stores one copy of the timestep/class embedder per block (the converted original weights
are identical copies). We keep per-block embedders so random-weight checkpoints match exactly, but
when all copies are bit-identical at load we keep one and compute the conditioning once per step.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from realtime.errors import ConfigError, ModelFormatError

_WEIGHTS = "diffusion_pytorch_model.safetensors"
_TIME_CHANNELS = 256  # diffusers' CombinedTimestepLabelEmbeddings uses a fixed 256-dim sinusoid


@dataclass(frozen=True)
class DiTConfig:
    num_heads: int = 16
    head_dim: int = 72
    in_channels: int = 4
    out_channels: int = 8  # 2 * in_channels with learned sigma
    num_layers: int = 28
    sample_size: int = 32  # latent side (image side / 8)
    patch_size: int = 2
    num_classes: int = 1000  # the null (unconditional) class id equals this
    norm_eps: float = 1e-5  # the pre-MLP LayerNorm; the adaLN norms use 1e-6 (fixed in diffusers)
    activation: str = "gelu-approximate"
    attention_bias: bool = True

    @property
    def dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def learned_sigma(self) -> bool:
        return self.out_channels == 2 * self.in_channels

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "DiTConfig":
        """Map a diffusers ``DiTTransformer2DModel`` config.json dict to ours, refusing what we do not run."""
        name = cfg.get("_class_name", "DiTTransformer2DModel")
        if name not in ("DiTTransformer2DModel", "Transformer2DModel"):
            raise ModelFormatError(f"transformer class {name!r} is not a DiT")
        if cfg.get("norm_type", "ada_norm_zero") != "ada_norm_zero":
            raise ModelFormatError("only adaLN-Zero DiT checkpoints are supported")
        if cfg.get("norm_elementwise_affine", False):
            raise ModelFormatError("DiT with affine LayerNorm parameters is not supported")
        act = cfg.get("activation_fn", "gelu-approximate")
        if act not in ("gelu-approximate", "gelu"):
            raise ModelFormatError(f"unsupported DiT activation {act!r}")
        if cfg.get("num_embeds_ada_norm") is None:
            raise ModelFormatError("DiT config lacks num_embeds_ada_norm (class count)")
        in_ch = int(cfg.get("in_channels", 4))
        out_ch = cfg.get("out_channels")
        return cls(
            num_heads=int(cfg.get("num_attention_heads", 16)),
            head_dim=int(cfg.get("attention_head_dim", 72)),
            in_channels=in_ch,
            out_channels=in_ch if out_ch is None else int(out_ch),
            num_layers=int(cfg.get("num_layers", 28)),
            sample_size=int(cfg.get("sample_size", 32)),
            patch_size=int(cfg.get("patch_size", 2)),
            num_classes=int(cfg["num_embeds_ada_norm"]),
            norm_eps=float(cfg.get("norm_eps", 1e-5)),
            activation=act,
            attention_bias=bool(cfg.get("attention_bias", True)),
        )


DIT_XL_2_256 = DiTConfig()
DIT_XL_2_512 = replace(DIT_XL_2_256, sample_size=64)
PRESETS = {"DiT-XL/2-256": DIT_XL_2_256, "DiT-XL/2-512": DIT_XL_2_512}


def timestep_embedding(t: torch.Tensor, channels: int = _TIME_CHANNELS) -> torch.Tensor:
    """t [B] (int or float) -> [B, channels] float32; cos half first, exponent / (half - 1) as diffusers."""
    half = channels // 2
    exponent = -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / (half - 1)
    args = t.float()[:, None] * torch.exp(exponent)[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def sincos_pos_embed(dim: int, grid_h: int, grid_w: int, base_size: int) -> torch.Tensor:
    """Fixed 2-D positions [grid_h * grid_w, dim] float32, token n = row * grid_w + col.

    First half of the channels encodes the column, second half the row (MAE/DiT order); positions
    are scaled by base_size / grid so a different grid interpolates the trained one. Computed in
    float64 like the reference, then rounded to float32.
    """
    assert dim % 4 == 0, "sin-cos position embedding needs dim divisible by 4"
    rows = torch.arange(grid_h, dtype=torch.float32) / (grid_h / base_size)
    cols = torch.arange(grid_w, dtype=torch.float32) / (grid_w / base_size)
    omega = torch.arange(dim // 4, dtype=torch.float64) / (dim / 4.0)
    omega = 1.0 / 10000**omega

    def one_axis(pos: torch.Tensor) -> torch.Tensor:
        out = torch.outer(pos.double(), omega)
        return torch.cat([torch.sin(out), torch.cos(out)], dim=1)

    col = cols[None, :].expand(grid_h, grid_w).reshape(-1)
    row = rows[:, None].expand(grid_h, grid_w).reshape(-1)
    return torch.cat([one_axis(col), one_axis(row)], dim=1).float()


class ConditionEmbed(nn.Module):
    """(t [B], y [B]) -> c [B, D]: timestep MLP + class table (num_classes + 1 rows incl. the null)."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.time_fc1 = nn.Linear(_TIME_CHANNELS, cfg.dim)
        self.time_fc2 = nn.Linear(cfg.dim, cfg.dim)
        self.class_table = nn.Embedding(cfg.num_classes + 1, cfg.dim)

    def forward(self, t: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        temb = timestep_embedding(t).to(dtype)
        temb = self.time_fc2(F.silu(self.time_fc1(temb)))
        return temb + self.class_table(y)


class DiTBlock(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        d = cfg.dim
        self.cfg = cfg
        self.ada = nn.Linear(d, 6 * d)
        self.qkv = nn.Linear(d, 3 * d, bias=cfg.attention_bias)
        self.attn_out = nn.Linear(d, d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.gelu_approx = "tanh" if cfg.activation == "gelu-approximate" else "none"

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """x [B, N, D], c [B, D] (conditioning, pre-SiLU) -> [B, N, D]."""
        cfg = self.cfg
        b, n, d = x.shape
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.ada(F.silu(c)).chunk(6, dim=1)
        h = F.layer_norm(x, (d,), eps=1e-6) * (1 + scale_a[:, None]) + shift_a[:, None]
        q, k, v = self.qkv(h).view(b, n, 3, cfg.num_heads, cfg.head_dim).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v)  # [B, H, N, Dh]
        a = self.attn_out(a.transpose(1, 2).reshape(b, n, d))
        x = x + gate_a[:, None] * a
        h = F.layer_norm(x, (d,), eps=cfg.norm_eps) * (1 + scale_m[:, None]) + shift_m[:, None]
        h = self.fc2(F.gelu(self.fc1(h), approximate=self.gelu_approx))
        return x + gate_m[:, None] * h


class DiT(nn.Module):
    """Denoiser: forward(x [B, C, H, W], t [B], y [B]) -> [B, out_channels, H, W] (eps, then sigma)."""

    def __init__(self, cfg: DiTConfig, shared_condition: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        d, p = cfg.dim, cfg.patch_size
        self.patch = nn.Conv2d(cfg.in_channels, d, kernel_size=p, stride=p)
        grid = cfg.sample_size // p
        self.base_grid = grid
        self.register_buffer("pos", sincos_pos_embed(d, grid, grid, grid)[None], persistent=False)
        self.cond = nn.ModuleList(ConditionEmbed(cfg) for _ in range(1 if shared_condition else cfg.num_layers))
        self.blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.num_layers))
        self.final_ada = nn.Linear(d, 2 * d)
        self.final_proj = nn.Linear(d, p * p * cfg.out_channels)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        p = cfg.patch_size
        b, _, hh, ww = x.shape
        gh, gw = hh // p, ww // p
        h = self.patch(x).flatten(2).transpose(1, 2)  # [B, N, D]
        if (gh, gw) == (self.base_grid, self.base_grid):
            pos = self.pos
        else:  # off-size latents: interpolated positions, as diffusers' PatchEmbed does
            pos = sincos_pos_embed(cfg.dim, gh, gw, self.base_grid)[None].to(x.device)
        h = (h + pos).to(x.dtype)
        conds = [emb(t, y, h.dtype) for emb in self.cond]
        for i, block in enumerate(self.blocks):
            h = block(h, conds[i if len(conds) > 1 else 0])
        # diffusers' final layer conditions on the first block's embedder
        shift, scale = self.final_ada(F.silu(conds[0])).chunk(2, dim=1)
        h = F.layer_norm(h, (cfg.dim,), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]
        h = self.final_proj(h)  # [B, N, p*p*C]
        h = h.view(b, gh, gw, p, p, cfg.out_channels).permute(0, 5, 1, 3, 2, 4)
        return h.reshape(b, cfg.out_channels, gh * p, gw * p)

    @classmethod
    def from_pretrained(
        cls, folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> "DiT":
        """Load ``folder/transformer`` (or ``folder`` itself if it holds config.json) strictly."""
        from safetensors.torch import load_file

        folder = Path(folder)
        sub = folder / "transformer" if (folder / "transformer").is_dir() else folder
        cfg_path, w_path = sub / "config.json", sub / _WEIGHTS
        if not cfg_path.is_file() or not w_path.is_file():
            raise ConfigError(f"no DiT transformer (config.json + {_WEIGHTS}) under {folder}")
        cfg = DiTConfig.from_diffusers(json.loads(cfg_path.read_text()))
        sd = load_file(str(w_path), device="cpu")
        ours, shared = convert_state_dict(sd, cfg)
        model = cls(cfg, shared_condition=shared)
        _load_strict(model, ours)
        return model.to(device=device, dtype=dtype).eval()


def convert_state_dict(sd: dict[str, torch.Tensor], cfg: DiTConfig) -> tuple[dict[str, torch.Tensor], bool]:
    """diffusers DiTTransformer2DModel keys -> ours. Returns (state dict, shared_condition).

    Every source key must be used exactly once; q/k/v are fused into one projection.
    """
    sd = dict(sd)
    out: dict[str, torch.Tensor] = {}

    def take(key: str) -> torch.Tensor:
        if key not in sd:
            raise ModelFormatError(f"DiT checkpoint lacks tensor {key!r}")
        return sd.pop(key)

    out["patch.weight"] = take("pos_embed.proj.weight")
    out["patch.bias"] = take("pos_embed.proj.bias")
    conds = []
    for i in range(cfg.num_layers):
        src = f"transformer_blocks.{i}."
        e = src + "norm1.emb."
        conds.append(
            {
                "time_fc1.weight": take(e + "timestep_embedder.linear_1.weight"),
                "time_fc1.bias": take(e + "timestep_embedder.linear_1.bias"),
                "time_fc2.weight": take(e + "timestep_embedder.linear_2.weight"),
                "time_fc2.bias": take(e + "timestep_embedder.linear_2.bias"),
                "class_table.weight": take(e + "class_embedder.embedding_table.weight"),
            }
        )
        dst = f"blocks.{i}."
        out[dst + "ada.weight"] = take(src + "norm1.linear.weight")
        out[dst + "ada.bias"] = take(src + "norm1.linear.bias")
        a = src + "attn1."
        out[dst + "qkv.weight"] = torch.cat([take(a + f"to_{n}.weight") for n in "qkv"], dim=0)
        if cfg.attention_bias:
            out[dst + "qkv.bias"] = torch.cat([take(a + f"to_{n}.bias") for n in "qkv"], dim=0)
        out[dst + "attn_out.weight"] = take(a + "to_out.0.weight")
        out[dst + "attn_out.bias"] = take(a + "to_out.0.bias")
        out[dst + "fc1.weight"] = take(src + "ff.net.0.proj.weight")
        out[dst + "fc1.bias"] = take(src + "ff.net.0.proj.bias")
        out[dst + "fc2.weight"] = take(src + "ff.net.2.weight")
        out[dst + "fc2.bias"] = take(src + "ff.net.2.bias")
    out["final_ada.weight"] = take("proj_out_1.weight")
    out["final_ada.bias"] = take("proj_out_1.bias")
    out["final_proj.weight"] = take("proj_out_2.weight")
    out["final_proj.bias"] = take("proj_out_2.bias")
    sd.pop("pos_embed.pos_embed", None)  # older exports persist the fixed positions; we recompute them
    if sd:
        raise ModelFormatError(f"DiT checkpoint has unexpected tensors: {sorted(sd)[:5]}")
    shared = all(all(torch.equal(c[k], conds[0][k]) for k in c) for c in conds[1:])
    for i, c in enumerate(conds[:1] if shared else conds):
        for k, v in c.items():
            out[f"cond.{i}.{k}"] = v
    return out, shared


def _load_strict(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    own = model.state_dict()
    if set(own) != set(sd):
        missing, extra = sorted(set(own) - set(sd)), sorted(set(sd) - set(own))
        raise ModelFormatError(f"weights do not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
    for k, v in sd.items():
        if own[k].shape != v.shape:
            raise ModelFormatError(f"tensor {k!r} has shape {tuple(v.shape)}, expected {tuple(own[k].shape)}")
    model.load_state_dict(sd, strict=True)
