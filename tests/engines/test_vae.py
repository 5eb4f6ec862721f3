"""Our kl-f8 VAE decoder and TAESD decoder equal diffusers' AutoencoderKL / AutoencoderTiny decode."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKL, AutoencoderTiny

from realtime.engines.vae import KLDecoder, TinyDecoder, to_unit
from realtime.errors import ConfigError, ModelFormatError


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(
    "blocks,layers,groups",
    [((8, 16), 1, 4), ((8, 8, 16), 2, 8)],  # second: 3 stages, 3 resnets per up block, shortcut convs
)
def test_kl_decoder_matches_diffusers(tmp_path, blocks, layers, groups):
    torch.manual_seed(0)
    n = len(blocks)
    ref = AutoencoderKL(
        block_out_channels=blocks,
        layers_per_block=layers,
        norm_num_groups=groups,
        latent_channels=4,
        up_block_types=("UpDecoderBlock2D",) * n,
        down_block_types=("DownEncoderBlock2D",) * n,
    ).eval()
    with torch.no_grad():  # random GroupNorm affines too, so every tensor's mapping matters
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    ref.save_pretrained(tmp_path / "vae")
    ours = KLDecoder.from_pretrained(tmp_path)
    assert ours.cfg.scaling_factor == pytest.approx(0.18215)
    z = torch.randn(2, 4, 6, 6)
    with torch.no_grad():
        want = ref.decode(z).sample
        got = ours.decode_raw(z)
        assert got.shape == (2, 3, 6 * 2 ** (n - 1), 6 * 2 ** (n - 1))
        assert _rel(got, want) < 1e-5
        # decode() takes diffusion-space latents: divides by the scaling factor first (DiTPipeline)
        assert _rel(ours.decode(z * 0.18215), want) < 1e-5


def test_tiny_decoder_matches_diffusers(tmp_path):
    torch.manual_seed(1)
    ref = AutoencoderTiny(encoder_block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8)).eval()
    ref.save_pretrained(tmp_path / "preview_decoder")
    ours = TinyDecoder.from_pretrained(tmp_path)
    z = 2 * torch.randn(2, 4, 5, 5)  # beyond +-3 in places: exercises the tanh soft clamp
    with torch.no_grad():
        want = ref.decode(z).sample
        got = ours.decode(z)
    assert got.shape == (2, 3, 40, 40)
    assert _rel(got, want) < 1e-5
    u = to_unit(got)
    assert u.min() >= 0 and u.max() <= 1


def test_missing_and_mismatched_checkpoints(tmp_path):
    with pytest.raises(ConfigError):
        KLDecoder.from_pretrained(tmp_path)
    ref = AutoencoderKL(
        block_out_channels=(8, 16),
        layers_per_block=1,
        norm_num_groups=4,
        up_block_types=("UpDecoderBlock2D",) * 2,
        down_block_types=("DownEncoderBlock2D",) * 2,
    )
    ref.save_pretrained(tmp_path / "vae")
    cfg = (tmp_path / "vae" / "config.json").read_text().replace('"layers_per_block": 1', '"layers_per_block": 2')
    (tmp_path / "vae" / "config.json").write_text(cfg)
    with pytest.raises(ModelFormatError):
        KLDecoder.from_pretrained(tmp_path)
