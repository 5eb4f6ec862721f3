"""Video engines for /v1/video: the interface the service steps, one plumbing engine behind it, and
the frame-strip / MP4 encoders.

``VideoEngine`` is what realtime/video_service.py needs from a model that denoises a clip of F
latent frames in batched steps — the clip counterpart of ``DiTEngine``'s image calls:

    new_state() once per pool slot → reset_state(state, label, seed, steps, guidance, sampler, frames)
    → step_batch([...clips in flight, each at its own step...]) until state.done
      (between steps: preview(states, kind) maps each clip's predicted x0 [F, C, h, w] to RGB)
    → decode([state.latents, ...]) → per clip [F, 3, H, W] in [0, 1].

Pick an engine for a checkpoint folder with ``load_video_engine`` (keyed by the transformer class).

``FrameDiTEngine`` is a PLUMBING engine, not a video model: it runs the image DiT of an ordinary
DiT folder (transformer/ + vae/) on every frame of the clip, as one batch per step. The frames are
denoised independently — there is no temporal attention and no temporal VAE; what ties them together
is only the initial noise: one noise field shared by the clip plus a small per-frame part (see
``clip_noise``), and one class label, guidance scale and sampler. The result is a flip-book of close
variations of one picture. It exists so the protocol, scheduler lane, previews and MP4 path are real
and tested; a real video DiT plugs in behind the same interface later.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from realtime.engines.diffusion import DiTEngine, ImageState, to_jpeg
from realtime.errors import ConfigError, ModelFormatError, ProtocolError

MAX_STRIP_WIDTH = 2048  # a preview frame strip is at most this wide: frames shrink when F x size exceeds it
MP4_QUALITY = 8  # imageio-ffmpeg's 0..10 scale; for libx264 it maps to crf = int((1 - q / 10) * 51) = 10
VIDEO_EXTRA = "pip install 'realtime[video]'"


@dataclass(eq=False)
class ClipState:
    """One clip request, reusable per pool slot (``VideoEngine.new_state`` / ``reset_state``).

    The buffers hold ``max_frames`` latent frames; a request uses the first ``frames``. ``latents``
    [F, C, h, w] float32 (device) is the current x_t of each frame; ``x0`` [F, C, h, w] the clean
    latents predicted by the last step (zeros before the first).
    """

    latents_buf: torch.Tensor  # [F_max, C, h, w]
    x0_buf: torch.Tensor  # [F_max, C, h, w]
    frames: int = 0
    class_label: int = 0
    seed: int = 0
    num_steps: int = 1
    guidance_scale: float = 1.0
    sampler: str = "ddim"
    step_index: int = 0
    extra: dict = field(default_factory=dict)  # free slot for the caller

    @property
    def latents(self) -> torch.Tensor:
        return self.latents_buf[: self.frames]

    @property
    def x0(self) -> torch.Tensor:
        return self.x0_buf[: self.frames]

    @property
    def done(self) -> bool:
        return self.step_index >= self.num_steps


class VideoEngine(ABC):
    """What the video service needs from a clip denoiser (see the module docstring for the call order)."""

    name: str = "video"

    @classmethod
    @abstractmethod
    def from_pretrained(cls, folder: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32) -> "VideoEngine":
        """Load from a checkpoint folder."""

    @property
    @abstractmethod
    def frame_size(self) -> int:
        """Pixels per side of a decoded frame (the ``size`` a request must ask for)."""

    @property
    @abstractmethod
    def max_frames(self) -> int:
        """The most frames one clip may have."""

    @property
    @abstractmethod
    def num_classes(self) -> int: ...

    @property
    @abstractmethod
    def max_steps(self) -> int:
        """The longest schedule a request may ask for."""

    @property
    @abstractmethod
    def has_preview_decoder(self) -> bool:
        """Whether ``preview(..., "taesd")`` works (``"latent2rgb"`` always does)."""

    @abstractmethod
    def new_state(self, class_label: int = 0, seed: int = 0, num_steps: int = 50, guidance_scale: float = 4.0,
                  sampler: str = "ddim", frames: int = 2) -> ClipState:
        """A state with buffers for ``max_frames``, armed for this request."""

    @abstractmethod
    def reset_state(self, state: ClipState, class_label: int, seed: int, num_steps: int = 50,
                    guidance_scale: float = 4.0, sampler: str = "ddim", frames: int = 2) -> None:
        """Re-arm ``state`` for a new request in its existing buffers; bad input raises before any write."""

    @abstractmethod
    def step_batch(self, states: list[ClipState]) -> None:
        """Advance every clip by one step (clips may sit at different steps). Done states are refused."""

    @abstractmethod
    def preview(self, states: list[ClipState], kind: str = "latent2rgb") -> list[torch.Tensor]:
        """Per clip: its predicted x0 as RGB [F, 3, h', w'] float32 in [0, 1] (cheap, any resolution)."""

    @abstractmethod
    def decode(self, latents: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per clip: final latents [F, C, h, w] → frames [F, 3, H, W] float32 in [0, 1]."""

    def generate(self, class_label: int, seed: int, frames: int, num_steps: int = 50, guidance_scale: float = 4.0,
                 sampler: str = "ddim") -> torch.Tensor:
        """Offline: the final latents [F, C, h, w] of one clip (decode with ``decode([...])[0]``)."""
        st = self.new_state(class_label, seed, num_steps, guidance_scale, sampler, frames)
        while not st.done:
            self.step_batch([st])
        return st.latents.clone()


# ---------------------------------------------------------------------- the plumbing engine


@dataclass(frozen=True)
class FrameClipConfig:
    max_frames: int = 32
    frame_noise: float = 0.1  # variance share of each frame's own noise; the rest is one field per clip
    decode_batch: int = 16  # frames per VAE call (bounds activation memory at 512 px)


def clip_noise(seed: int, frames: int, shape: tuple[int, ...], frame_noise: float) -> torch.Tensor:
    """Temporally correlated initial noise [F, *shape] float32 (CPU), unit variance per element.

    ``sqrt(1 - r) * shared + sqrt(r) * own_f`` with r = ``frame_noise``: any two frames correlate by
    1 - r. ``shared`` is the first draw of ``Generator('cpu').manual_seed(seed)``, i.e. exactly the
    noise /v1/image starts from for that seed, so with r = 0 every frame is that image.
    """
    gen = torch.Generator("cpu").manual_seed(int(seed))
    shared = torch.randn((1, *shape), generator=gen, dtype=torch.float32)
    own = torch.randn((frames, *shape), generator=gen, dtype=torch.float32)
    return math.sqrt(1.0 - frame_noise) * shared + math.sqrt(frame_noise) * own


@dataclass(eq=False)
class _FrameClip(ClipState):
    rows: list[ImageState] = field(default_factory=list)  # one image state per frame, viewing the buffers


class FrameDiTEngine(VideoEngine):
    """An image DiT run on every frame of a clip, one batch per step (plumbing, not a video model).

    Each frame is an ``ImageState`` whose latents and x0 are views of the clip's buffers, so one
    ``DiTEngine.step_batch`` over all frames of all clips in flight is the whole step: same
    samplers, classifier-free guidance and schedules as /v1/image, frame f of a clip equal to the
    image path started from ``clip_noise(seed)[f]``.
    """

    name = "dit-frames"

    def __init__(self, image: DiTEngine, cfg: FrameClipConfig = FrameClipConfig()) -> None:
        if not 0.0 <= cfg.frame_noise <= 1.0:
            raise ConfigError("frame_noise must be in [0, 1]")
        if cfg.max_frames < 1 or cfg.decode_batch < 1:
            raise ConfigError("max_frames and decode_batch must be positive")
        self.image = image
        self.cfg = cfg

    @classmethod
    def from_pretrained(cls, folder: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, cfg: FrameClipConfig = FrameClipConfig()) -> "FrameDiTEngine":
        return cls(DiTEngine.from_pretrained(folder, device, dtype), cfg)

    @property
    def frame_size(self) -> int:
        return self.image.image_size

    @property
    def max_frames(self) -> int:
        return self.cfg.max_frames

    @property
    def num_classes(self) -> int:
        return self.image.dit.cfg.num_classes

    @property
    def max_steps(self) -> int:
        return self.image.schedule.num_train_timesteps

    @property
    def has_preview_decoder(self) -> bool:
        return self.image.preview_decoder is not None

    def new_state(self, class_label: int = 0, seed: int = 0, num_steps: int = 50, guidance_scale: float = 4.0,
                  sampler: str = "ddim", frames: int = 2) -> ClipState:
        shape = (self.cfg.max_frames, *self.image.latent_shape)
        buf = torch.zeros(shape, dtype=torch.float32, device=self.image.device)
        x0 = torch.zeros_like(buf)
        rows = [ImageState(0, 0, 1, 1.0, "ddim", buf[f], x0[f], torch.zeros(1, 7)) for f in range(shape[0])]
        st = _FrameClip(buf, x0, rows=rows)
        self.reset_state(st, class_label, seed, num_steps, guidance_scale, sampler, frames)
        return st

    def reset_state(self, state: ClipState, class_label: int, seed: int, num_steps: int = 50,
                    guidance_scale: float = 4.0, sampler: str = "ddim", frames: int = 2) -> None:
        assert isinstance(state, _FrameClip), "not a state of this engine"
        if not 1 <= int(frames) <= self.cfg.max_frames:
            raise ProtocolError(f"frames must be in 1..{self.cfg.max_frames}")
        noise = clip_noise(seed, int(frames), self.image.latent_shape, self.cfg.frame_noise)
        # every row validates the same arguments, so a bad request fails on row 0 before any write
        for f in range(int(frames)):
            self.image.reset_state(state.rows[f], class_label, seed, num_steps, guidance_scale, sampler,
                                   noise=noise[f])
        state.frames, state.class_label, state.seed = int(frames), int(class_label), int(seed)
        state.num_steps, state.guidance_scale, state.sampler = int(num_steps), float(guidance_scale), sampler
        state.step_index = 0
        state.extra.clear()

    def _rows(self, states: list[ClipState]) -> list[ImageState]:
        return [r for st in states for r in st.rows[: st.frames]]  # type: ignore[attr-defined]

    def step_batch(self, states: list[ClipState]) -> None:
        if not states:
            return
        assert all(not s.done for s in states), "step_batch got a finished clip"
        self.image.step_batch(self._rows(states))
        for st in states:
            st.step_index = st.rows[0].step_index  # type: ignore[attr-defined]

    def preview(self, states: list[ClipState], kind: str = "latent2rgb") -> list[torch.Tensor]:
        rgb = self.image.preview(self._rows(states), kind)  # [sum F, 3, h', w']
        return list(rgb.split([st.frames for st in states]))

    @torch.no_grad()
    def decode(self, latents: list[torch.Tensor]) -> list[torch.Tensor]:
        flat = torch.cat(latents)  # [sum F, C, h, w]
        rgb = torch.cat([self.image.decode(chunk) for chunk in flat.split(self.cfg.decode_batch)])
        return list(rgb.split([len(x) for x in latents]))


# Engines by the transformer class of a checkpoint folder (transformer/config.json "_class_name").
ENGINES: dict[str, type[VideoEngine]] = {"DiTTransformer2DModel": FrameDiTEngine,
                                         "Transformer2DModel": FrameDiTEngine}


def load_video_engine(folder: str | Path, device: str | torch.device = "cpu",
                      dtype: torch.dtype = torch.float32) -> VideoEngine:
    """The engine for a checkpoint folder, picked by its transformer class."""
    cfg_path = Path(folder) / "transformer" / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"no transformer/config.json under {folder}")
    name = json.loads(cfg_path.read_text()).get("_class_name", "DiTTransformer2DModel")
    if name not in ENGINES:
        raise ModelFormatError(f"no video engine for transformer class {name!r}; have {sorted(ENGINES)}")
    return ENGINES[name].from_pretrained(folder, device, dtype)


# ---------------------------------------------------------------------- encoders (encoder threads)


def strip_frame_size(preview_size: int, frames: int) -> int:
    """Side of each frame in a preview strip: ``preview_size``, shrunk so the strip fits MAX_STRIP_WIDTH."""
    return max(1, min(preview_size, MAX_STRIP_WIDTH // frames))


def to_strip_jpeg(frames: torch.Tensor, side: int, quality: int = 80) -> bytes:
    """Frames [F, 3, h, w] (uint8, or float in [0, 1]) → one JPEG ``F * side`` wide, ``side`` tall.

    Each frame is resized on its own (antialiased bilinear), so no frame bleeds into its neighbour.
    """
    assert frames.ndim == 4 and frames.shape[1] == 3, "expected frames [F, 3, h, w]"
    x = frames.float() / 255 if frames.dtype == torch.uint8 else frames.float()
    if x.shape[-2:] != (side, side):
        x = F.interpolate(x, size=(side, side), mode="bilinear", antialias=True, align_corners=False)
    return to_jpeg(torch.cat(list(x.clamp(0, 1)), dim=-1), quality=quality)  # [3, side, F * side]


def mp4_unavailable() -> str | None:
    """Why MP4 output cannot work here (imageio-ffmpeg or its bundled ffmpeg is missing), else None."""
    try:
        import imageio_ffmpeg

        imageio_ffmpeg.get_ffmpeg_exe()
    except (ImportError, RuntimeError):
        return f"video output needs imageio-ffmpeg, which is not installed: {VIDEO_EXTRA}"
    return None


def to_mp4(frames: torch.Tensor, fps: int, quality: float = MP4_QUALITY) -> bytes:
    """Frames [F, 3, H, W] uint8 → H.264 (libx264, yuv420p) MP4 bytes, ``fps`` frames per second.

    yuv420p needs even sides: an odd last row or column is dropped. The moov atom goes first
    (``+faststart``) so a client can start playing before it has the whole file. Runs ffmpeg as a
    subprocess (imageio-ffmpeg's bundled binary) into a temporary file: seconds at most, so call it
    on an encoder thread, never the event loop or the device worker.
    """
    import imageio_ffmpeg

    assert frames.ndim == 4 and frames.shape[1] == 3 and frames.dtype == torch.uint8, "expected uint8 [F, 3, H, W]"
    _, _, h, w = frames.shape
    arr = frames[:, :, : h - h % 2, : w - w % 2].permute(0, 2, 3, 1).contiguous().cpu().numpy()
    with tempfile.TemporaryDirectory(prefix="realtime-mp4-") as d:
        path = os.path.join(d, "clip.mp4")
        writer = imageio_ffmpeg.write_frames(path, (arr.shape[2], arr.shape[1]), fps=fps, codec="libx264",
                                             pix_fmt_out="yuv420p", quality=quality, macro_block_size=2,
                                             ffmpeg_log_level="error", output_params=["-movflags", "+faststart"])
        writer.send(None)  # start ffmpeg
        for frame in arr:
            writer.send(frame)
        writer.close()  # waits for ffmpeg to finish the file
        return Path(path).read_bytes()


def from_mp4(data: bytes) -> tuple[torch.Tensor, float]:
    """MP4 bytes → (frames [F, 3, H, W] uint8, fps), decoded by the bundled ffmpeg (tests, clients)."""
    import imageio_ffmpeg
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="realtime-mp4-") as d:
        path = os.path.join(d, "clip.mp4")
        Path(path).write_bytes(data)
        gen = imageio_ffmpeg.read_frames(path)
        meta = next(gen)
        w, h = meta["size"]
        frames = np.stack([np.frombuffer(b, np.uint8).reshape(h, w, 3) for b in gen])
    return torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous(), float(meta["fps"])
