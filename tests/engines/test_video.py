"""The clip engine behind /v1/video (FrameDiTEngine) and the frame-strip / MP4 encoders (CPU fp32,
the tiny random DiT folder of test_dit.py: 8x8 latents, 16 px frames)."""

from __future__ import annotations

import io
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from realtime.engines.video import (
    MAX_STRIP_WIDTH,
    FrameClipConfig,
    FrameDiTEngine,
    clip_noise,
    from_mp4,
    load_video_engine,
    mp4_unavailable,
    strip_frame_size,
    to_mp4,
    to_strip_jpeg,
)
from realtime.errors import ModelFormatError, ProtocolError, UnsupportedError

from test_dit import _rel, ckpt  # noqa: F401 - the checkpoint fixture

pytest.importorskip("imageio_ffmpeg")


def test_clip_noise_is_seeded_and_correlated() -> None:
    shape = (4, 16, 16)
    a = clip_noise(7, 6, shape, 0.1)
    assert a.shape == (6, *shape) and a.dtype == torch.float32
    assert torch.equal(a, clip_noise(7, 6, shape, 0.1)) and not torch.equal(a, clip_noise(8, 6, shape, 0.1))
    assert abs(a.std().item() - 1) < 0.05  # unit variance: the model sees ordinary noise
    corr = torch.corrcoef(a.flatten(1))[~torch.eye(6, dtype=torch.bool)]
    assert (corr - 0.9).abs().max() < 0.05  # any two frames correlate by 1 - frame_noise
    # the shared field is the image path's noise for the same seed
    image_noise = torch.randn((1, *shape), generator=torch.Generator("cpu").manual_seed(7))[0]
    assert torch.equal(clip_noise(7, 3, shape, 0.0)[2], image_noise)


def test_frames_are_the_image_path_from_their_noise(ckpt) -> None:  # noqa: ANN001
    """Honesty check: each frame is exactly the image DiT started from that frame's noise."""
    folder, _ = ckpt
    eng = FrameDiTEngine.from_pretrained(folder)
    clip = eng.generate(3, 11, frames=3, num_steps=5, guidance_scale=4.0, sampler="ddim")
    assert clip.shape == (3, 4, 8, 8)
    noise = clip_noise(11, 3, eng.image.latent_shape, eng.cfg.frame_noise)
    for f in range(3):
        st = eng.image.new_state(3, 0, 5, 4.0, "ddim")
        eng.image.reset_state(st, 3, 0, 5, 4.0, "ddim", noise=noise[f])
        while not st.done:
            eng.image.step_batch([st])
        assert _rel(clip[f], st.latents) < 1e-5
    assert (clip[0] - clip[1]).abs().mean() > 1e-3  # the per-frame noise makes the frames differ
    # without per-frame noise every frame is the /v1/image picture of that seed
    still = FrameDiTEngine(eng.image, FrameClipConfig(frame_noise=0.0)).generate(3, 11, 2, 5, 4.0, "ddim")
    image = eng.image.generate([3], [11], 5, 4.0, "ddim")[0]
    assert _rel(still[0], image) < 1e-5 and _rel(still[1], image) < 1e-5


def test_batched_clips_equal_offline(ckpt) -> None:  # noqa: ANN001
    """Clips of different lengths, step counts and samplers stepped together (one joining late) end
    where each would alone; a pooled state is re-armed in place for a shorter clip."""
    folder, _ = ckpt
    eng = load_video_engine(folder)
    assert isinstance(eng, FrameDiTEngine)
    solo_a = eng.generate(3, 11, frames=4, num_steps=6, guidance_scale=4.0, sampler="ddim")
    solo_b = eng.generate(917, 22, frames=2, num_steps=4, guidance_scale=1.0, sampler="euler")

    a = eng.new_state(3, 11, 6, 4.0, "ddim", frames=4)
    b = eng.new_state(917, 22, 4, 1.0, "euler", frames=2)
    eng.step_batch([a])
    eng.step_batch([a])  # a is 2 steps ahead when b joins
    while not a.done:
        eng.step_batch([s for s in (b, a) if not s.done])
    assert b.done and (a.step_index, b.step_index) == (6, 4)
    assert a.x0.shape == (4, 4, 8, 8) and a.x0.abs().sum() > 0
    assert _rel(a.latents, solo_a) < 1e-5 and _rel(b.latents, solo_b) < 1e-5

    buf = a.latents_buf
    eng.reset_state(a, 917, 22, 4, 1.0, "euler", frames=2)
    assert a.latents_buf is buf and a.step_index == 0 and a.latents.shape == (2, 4, 8, 8)
    while not a.done:
        eng.step_batch([a])
    assert _rel(a.latents, solo_b) < 1e-5


def test_preview_and_decode(ckpt) -> None:  # noqa: ANN001
    folder, _ = ckpt
    eng = FrameDiTEngine.from_pretrained(folder, cfg=FrameClipConfig(decode_batch=2))
    assert eng.frame_size == 16 and eng.has_preview_decoder and eng.max_frames == 32
    assert eng.max_steps == 1000 and eng.num_classes == 1000 and eng.name == "dit-frames"
    sts = [eng.new_state(3, 1, 4, frames=3), eng.new_state(5, 2, 4, frames=2)]
    eng.step_batch(sts)
    fast = eng.preview(sts, "latent2rgb")
    assert [tuple(x.shape) for x in fast] == [(3, 3, 8, 8), (2, 3, 8, 8)]
    assert torch.equal(fast[1], eng.image.preview(sts[1].rows[:2], "latent2rgb"))
    tae = eng.preview(sts, "taesd")
    assert [tuple(x.shape) for x in tae] == [(3, 3, 64, 64), (2, 3, 64, 64)]
    with pytest.raises(UnsupportedError):
        eng.preview(sts, "vae")
    frames = eng.decode([st.latents for st in sts])  # 5 frames in VAE calls of 2
    assert [tuple(x.shape) for x in frames] == [(3, 3, 16, 16), (2, 3, 16, 16)]
    whole = eng.image.decode(torch.cat([st.latents for st in sts]))
    assert (torch.cat(frames) - whole).abs().max() < 1e-5 and 0 <= whole.min() and whole.max() <= 1


def test_bad_requests(ckpt, tmp_path) -> None:  # noqa: ANN001
    folder, _ = ckpt
    eng = FrameDiTEngine.from_pretrained(folder)
    st = eng.new_state(3, 1, 4, frames=2)
    before = st.latents_buf.clone()
    for kw in (dict(frames=0), dict(frames=33), dict(class_label=1000), dict(num_steps=0)):
        args = dict(class_label=3, seed=9, num_steps=4, frames=2) | kw
        with pytest.raises(ProtocolError):
            eng.reset_state(st, **args)
    assert torch.equal(st.latents_buf, before) and st.frames == 2  # refused before any write
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text('{"_class_name": "UNet2DConditionModel"}')
    with pytest.raises(ModelFormatError):
        load_video_engine(tmp_path)


def test_frame_strip() -> None:
    frames = torch.zeros(4, 3, 8, 8, dtype=torch.uint8)
    for f in range(4):
        frames[f, f % 3] = 255  # red, green, blue, red
    im = Image.open(io.BytesIO(to_strip_jpeg(frames, 32)))
    assert im.format == "JPEG" and im.size == (4 * 32, 32)
    px = np.asarray(im.convert("RGB")).astype(int)
    for f in range(4):  # each frame keeps its colour up to its edges (JPEG's 2x2 chroma blocks aside)
        tile = px[:, f * 32 + 2:(f + 1) * 32 - 2]
        assert tile[:, :, f % 3].min() > 200 and np.delete(tile, f % 3, axis=2).max() < 60
    assert strip_frame_size(256, 8) == 256 and strip_frame_size(256, 32) == MAX_STRIP_WIDTH // 32
    assert Image.open(io.BytesIO(to_strip_jpeg(frames.float() / 255, 16))).size == (64, 16)


def test_mp4_round_trip() -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.nn.functional.interpolate(torch.rand(1, 3, 6, 6, generator=g), size=(48, 64), mode="bilinear")
    frames = ((base + 0.05 * torch.arange(6).view(6, 1, 1, 1)).clamp(0, 1) * 255).round().to(torch.uint8)
    data = to_mp4(frames, fps=12)
    assert data[4:8] == b"ftyp" and b"avc1" in data  # an MP4 holding H.264
    got, fps = from_mp4(data)
    assert fps == 12 and got.shape == (6, 3, 48, 64)
    assert (got.int() - frames.int()).abs().float().mean() < 6  # measured 4.6 (mostly 4:2:0 chroma)
    odd, _ = from_mp4(to_mp4(frames[:2, :, :47, :63], fps=8))
    assert odd.shape == (2, 3, 46, 62)  # yuv420p: odd sides lose their last row / column


def test_mp4_unavailable_names_the_extra(monkeypatch) -> None:  # noqa: ANN001
    assert mp4_unavailable() is None
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # import fails as if not installed
    assert "realtime[video]" in mp4_unavailable()

