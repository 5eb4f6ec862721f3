"""DiT forward, samplers, batched stepping and previews vs diffusers (random tiny weights, CPU fp32)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderTiny,
    DDIMScheduler,
    DiTPipeline,
    DiTTransformer2DModel,
    EulerDiscreteScheduler,
)
from PIL import Image

from realtime.engines.diffusion import (
    SD15_LATENT_RGB,
    DiTEngine,
    ScheduleConfig,
    latent2rgb,
    to_jpeg,
    to_png,
)
from realtime.engines.dit import DiT, convert_state_dict
from realtime.engines.vae import KLDecoder, TinyDecoder
from realtime.errors import ModelFormatError, ProtocolError, UnsupportedError

SEEDS = (11, 22)
LABELS = (3, 917)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _dit(seed: int, std: float = 0.05, **kw) -> DiTTransformer2DModel:
    torch.manual_seed(seed)
    cfg = dict(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=8,
        num_layers=2,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=1000,
    )
    cfg.update(kw)
    m = DiTTransformer2DModel(**cfg)
    # diffusers zero-inits nothing here, but scale everything so adaLN gates/shifts are non-trivial
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, std)
    return m.eval()


def _vae() -> AutoencoderKL:
    torch.manual_seed(5)
    return AutoencoderKL(
        block_out_channels=(8, 16),
        layers_per_block=1,
        norm_num_groups=4,
        latent_channels=4,
        up_block_types=("UpDecoderBlock2D",) * 2,
        down_block_types=("DownEncoderBlock2D",) * 2,
    ).eval()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A diffusers DiT pipeline folder (transformer/, vae/, scheduler/) + preview_decoder/."""
    d = tmp_path_factory.mktemp("dit_ckpt")
    pipe = DiTPipeline(transformer=_dit(0), vae=_vae(), scheduler=DDIMScheduler())
    pipe.save_pretrained(d)
    torch.manual_seed(6)
    AutoencoderTiny(encoder_block_out_channels=(8,) * 4, decoder_block_out_channels=(8,) * 4).save_pretrained(
        d / "preview_decoder"
    )
    return d, pipe


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize(
    "kw",
    [
        {},  # learned sigma, 2 layers, 4x4 tokens
        dict(num_attention_heads=4, attention_head_dim=4, out_channels=None, num_layers=3, sample_size=12,
             activation_fn="gelu", num_embeds_ada_norm=10),  # no learned sigma, exact GELU, 6x6 tokens
    ],
)
def test_dit_forward_matches_diffusers(tmp_path, kw):
    ref = _dit(1, std=0.2, **kw)
    ref.save_pretrained(tmp_path / "transformer")
    ours = DiT.from_pretrained(tmp_path)
    c = ref.config
    assert len(ours.cond) == c.num_layers  # random per-block embedders differ: kept per block
    torch.manual_seed(2)
    x = torch.randn(3, 4, c.sample_size, c.sample_size)
    t = torch.tensor([999, 500, 3])
    y = torch.tensor([1, c.num_embeds_ada_norm, 7])  # includes the null class
    with torch.no_grad():
        want = ref(x, timestep=t, class_labels=y).sample
        got = ours(x, t, y)
        assert got.shape == want.shape == (3, c.out_channels or 4, c.sample_size, c.sample_size)
        assert _rel(got, want) < 1e-4
        # bfloat16 path runs and stays close (loose: bf16 has ~3 significant digits)
        bf = DiT.from_pretrained(tmp_path, dtype=torch.bfloat16)(x.bfloat16(), t, y).float()
        assert _rel(bf, want) < 5e-2


def test_dit_shared_condition_dedup(tmp_path):
    ref = _dit(3, std=0.2, num_layers=3)
    with torch.no_grad():  # make the per-block embedder copies identical, as in converted real weights
        src = ref.transformer_blocks[0].norm1.emb.state_dict()
        for blk in ref.transformer_blocks[1:]:
            blk.norm1.emb.load_state_dict(src)
    ref.save_pretrained(tmp_path / "transformer")
    ours = DiT.from_pretrained(tmp_path)
    assert len(ours.cond) == 1
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([10, 700]), torch.tensor([0, 999])
    with torch.no_grad():
        assert _rel(ours(x, t, y), ref(x, timestep=t, class_labels=y).sample) < 1e-4


def test_dit_strict_loading():
    ref = _dit(4)
    sd = dict(ref.state_dict())
    from realtime.engines.dit import DiTConfig

    cfg = DiTConfig.from_diffusers(dict(ref.config))
    convert_state_dict(sd, cfg)  # exact set: fine
    with pytest.raises(ModelFormatError):
        convert_state_dict({**sd, "extra.weight": torch.zeros(1)}, cfg)
    sd.pop("proj_out_2.bias")
    with pytest.raises(ModelFormatError):
        convert_state_dict(sd, cfg)
    with pytest.raises(ModelFormatError):
        DiTConfig.from_diffusers({**dict(ref.config), "norm_type": "ada_norm"})


# ----------------------------------------------------------------------------- sampling


def test_ddim_matches_dit_pipeline(ckpt):
    folder, pipe = ckpt
    captured = []
    decode = pipe.vae.decode

    def spy(z, **kw):
        captured.append(z.clone())
        return decode(z, **kw)

    pipe.vae.decode = spy
    try:
        gens = [torch.Generator().manual_seed(s) for s in SEEDS]
        want_img = pipe(list(LABELS), guidance_scale=4.0, generator=gens, num_inference_steps=10,
                        output_type="pt").images
    finally:
        pipe.vae.decode = decode
    want = captured[0] * pipe.vae.config.scaling_factor  # back to diffusion space

    eng = DiTEngine.from_pretrained(folder)
    assert eng.schedule.clip_sample  # DDIMScheduler() default, read from scheduler/
    got = eng.generate(list(LABELS), list(SEEDS), num_steps=10, guidance_scale=4.0, sampler="ddim")
    assert _rel(got, want) <= 1e-3
    img = eng.decode(got)
    assert img.shape == want_img.shape == (2, 3, 16, 16)
    assert (img - want_img).abs().max().item() < 1e-4


def _reference_loop(model, sched, labels, seeds, steps, g):
    """DiTPipeline's loop, plus the scheduler's init_noise_sigma / scale_model_input (for Euler)."""
    sched.set_timesteps(steps)
    lat = torch.cat([torch.randn((1, 4, 8, 8), generator=torch.Generator().manual_seed(s)) for s in seeds])
    lat = lat * sched.init_noise_sigma
    y = torch.tensor(labels)
    if g > 1:
        y = torch.cat([y, torch.full_like(y, 1000)])
    with torch.no_grad():
        for t in sched.timesteps:
            inp = sched.scale_model_input(lat, t)
            if g > 1:
                inp = torch.cat([inp, inp])
            out = model(inp, timestep=t.expand(inp.shape[0]), class_labels=y).sample
            eps = out[:, :4]
            if g > 1:
                c, u = eps.chunk(2)
                eps = u + g * (c - u)
            lat = sched.step(eps, t, lat).prev_sample
    return lat


@pytest.mark.parametrize(
    "sched,sampler,g",
    [
        (EulerDiscreteScheduler(), "euler", 3.0),
        (EulerDiscreteScheduler(timestep_spacing="leading", steps_offset=1), "euler", 1.0),
        (DDIMScheduler(timestep_spacing="trailing", set_alpha_to_one=False, clip_sample=False), "ddim", 2.0),
        (DDIMScheduler(beta_schedule="scaled_linear", beta_end=0.012, timestep_spacing="linspace"), "ddim", 1.0),
    ],
)
def test_samplers_match_diffusers_schedulers(ckpt, sched, sampler, g):
    folder, pipe = ckpt
    want = _reference_loop(pipe.transformer, sched, list(LABELS), SEEDS, 7, g)
    eng = DiTEngine(DiT.from_pretrained(folder), KLDecoder.from_pretrained(folder), None,
                    ScheduleConfig.from_diffusers(dict(sched.config)))
    got = eng.generate(list(LABELS), list(SEEDS), num_steps=7, guidance_scale=g, sampler=sampler)
    assert _rel(got, want) <= 1e-4


def test_batched_steps_equal_solo_runs(ckpt):
    folder, _ = ckpt
    eng = DiTEngine.from_pretrained(folder)
    solo_a = eng.generate([LABELS[0]], [SEEDS[0]], num_steps=6, guidance_scale=4.0, sampler="ddim")[0]
    solo_b = eng.generate([LABELS[1]], [SEEDS[1]], num_steps=4, guidance_scale=1.0, sampler="euler")[0]

    a = eng.new_state(LABELS[0], SEEDS[0], num_steps=6, guidance_scale=4.0, sampler="ddim")
    b = eng.new_state(LABELS[1], SEEDS[1], num_steps=4, guidance_scale=1.0, sampler="euler")
    eng.step_batch([a])
    eng.step_batch([a])  # a is 2 steps ahead when b joins
    assert (a.step_index, b.step_index) == (2, 0)
    while not a.done:
        eng.step_batch([s for s in (b, a) if not s.done])
    assert b.done and a.step_index == 6
    assert _rel(a.latents, solo_a) < 1e-5
    assert _rel(b.latents, solo_b) < 1e-5

    # reset reuses the buffers and reproduces the run
    buf = a.latents
    eng.reset_state(a, LABELS[0], SEEDS[0], num_steps=6, guidance_scale=4.0, sampler="ddim")
    assert a.latents is buf and a.step_index == 0 and not a.x0.any()
    while not a.done:
        eng.step_batch([a])
    assert _rel(a.latents, solo_a) < 1e-5


def test_request_validation(ckpt):
    folder, _ = ckpt
    eng = DiTEngine.from_pretrained(folder)
    with pytest.raises(ProtocolError):
        eng.new_state(1000, 0)  # the null class is not a valid request
    with pytest.raises(ProtocolError):
        eng.new_state(1, 0, num_steps=0)
    with pytest.raises(UnsupportedError):
        eng.new_state(1, 0, sampler="plms")
    # different seeds give different noise, same seed the same
    s1, s2, s3 = eng.new_state(1, 7), eng.new_state(1, 7), eng.new_state(1, 8)
    assert torch.equal(s1.latents, s2.latents) and not torch.equal(s1.latents, s3.latents)


# ----------------------------------------------------------------------------- previews


def test_previews(ckpt):
    folder, _ = ckpt
    eng = DiTEngine.from_pretrained(folder)
    st = [eng.new_state(y, s, num_steps=5) for y, s in zip(LABELS, SEEDS)]
    eng.step_batch(st)
    assert st[0].x0.abs().sum() > 0

    fast = eng.preview(st, "latent2rgb")
    assert fast.shape == (2, 3, 8, 8) and fast.dtype == torch.float32
    assert fast.min() >= 0 and fast.max() <= 1
    # the map itself: a unit latent on channel k gives (row k + 1) / 2
    unit = torch.zeros(1, 4, 2, 2)
    unit[0, 2] = 1.0
    want = (torch.tensor(SD15_LATENT_RGB[2]) + 1) / 2
    assert torch.allclose(latent2rgb(unit)[0, :, 0, 0], want.clamp(0, 1))

    tae = eng.preview(st, "taesd")
    ref = AutoencoderTiny.from_pretrained(folder / "preview_decoder").eval()
    with torch.no_grad():
        want_tae = (ref.decode(torch.stack([s.x0 for s in st])).sample / 2 + 0.5).clamp(0, 1)
    assert tae.shape == (2, 3, 64, 64)
    assert (tae - want_tae).abs().max().item() < 1e-5
    with pytest.raises(UnsupportedError):
        eng.preview(st, "vae")
    with pytest.raises(UnsupportedError):
        DiTEngine(eng.dit, eng.vae).preview(st, "taesd")
    assert isinstance(eng.preview_decoder, TinyDecoder)

    jpg = to_jpeg(fast[0], 96)
    im = Image.open(io.BytesIO(jpg))
    assert im.format == "JPEG" and im.size == (96, 96) and im.mode == "RGB"
    assert Image.open(io.BytesIO(to_jpeg(tae[1], (48, 32)))).size == (48, 32)
    png = to_png(tae[0])
    im = Image.open(io.BytesIO(png))
    assert im.format == "PNG" and im.size == (64, 64)
    back = torch.from_numpy(np.array(im)).permute(2, 0, 1)
    assert torch.equal(back, (tae[0] * 255).round().to(torch.uint8))  # lossless


@pytest.mark.gpu
def test_engine_on_cuda(ckpt, monkeypatch):
    folder, _ = ckpt
    # TF32 convolutions would perturb the fp32 comparison; random-weight CFG sampling amplifies noise
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    cpu = DiTEngine.from_pretrained(folder)
    want = cpu.generate(list(LABELS), list(SEEDS), num_steps=10, guidance_scale=4.0)
    # fp32 on CUDA: same math, same seeded (CPU-generated) noise
    g32 = DiTEngine.from_pretrained(folder, device="cuda")
    got = g32.generate(list(LABELS), list(SEEDS), num_steps=10, guidance_scale=4.0)
    assert got.device.type == "cuda" and got.dtype == torch.float32
    assert _rel(got.cpu(), want) < 1e-3
    assert (g32.decode(got).cpu() - cpu.decode(want)).abs().max().item() < 1e-3

    # bf16: one step's x0 prediction stays close (a whole guided random-weight run drifts ~10 %)
    gbf = DiTEngine.from_pretrained(folder, device="cuda", dtype=torch.bfloat16)
    c1 = [cpu.new_state(y, s, num_steps=10, guidance_scale=4.0) for y, s in zip(LABELS, SEEDS)]
    b1 = [gbf.new_state(y, s, num_steps=10, guidance_scale=4.0) for y, s in zip(LABELS, SEEDS)]
    assert torch.equal(b1[0].latents.cpu(), c1[0].latents)
    cpu.step_batch(c1)
    gbf.step_batch(b1)
    assert _rel(torch.stack([s.x0 for s in b1]).cpu(), torch.stack([s.x0 for s in c1])) < 5e-2
    while not b1[0].done:
        gbf.step_batch(b1)
    lat = torch.stack([s.latents for s in b1])
    assert torch.isfinite(lat).all()
    assert gbf.preview(b1, "latent2rgb").shape == (2, 3, 8, 8)
    assert gbf.preview(b1, "taesd").shape == (2, 3, 64, 64)
    img = gbf.decode(lat)
    assert img.dtype == torch.float32 and img.shape == (2, 3, 16, 16)
    assert Image.open(io.BytesIO(to_png(img[0]))).size == (16, 16)
