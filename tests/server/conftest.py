"""Fixtures for the server tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def piper_backend():  # noqa: ANN201 - realtime.tts_piper.PiperBackend
    from realtime.tts_piper import PiperBackend

    backend = PiperBackend()
    backend.warmup()
    return backend


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):  # noqa: ANN001, ANN201
    """A tiny random DiT folder (transformer/, vae/, scheduler/, preview_decoder/): 64 px images,
    8x8 latents through a 4-block (8x) VAE. Served by the image and video tests."""
    from diffusers import AutoencoderKL, AutoencoderTiny, DDIMScheduler, DiTPipeline, DiTTransformer2DModel

    d = tmp_path_factory.mktemp("dit_serving")
    torch.manual_seed(0)
    dit = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
                                num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=1000)
    with torch.no_grad():
        for p in dit.parameters():
            p.normal_(0, 0.05)
    torch.manual_seed(5)
    vae = AutoencoderKL(block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4, latent_channels=4,
                        up_block_types=("UpDecoderBlock2D",) * 4, down_block_types=("DownEncoderBlock2D",) * 4)
    DiTPipeline(transformer=dit.eval(), vae=vae.eval(), scheduler=DDIMScheduler()).save_pretrained(d)
    torch.manual_seed(6)
    AutoencoderTiny(encoder_block_out_channels=(8,) * 4, decoder_block_out_channels=(8,) * 4).save_pretrained(
        d / "preview_decoder")
    return d
