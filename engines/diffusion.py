"""Class-conditional latent diffusion (DiT) sampling, one step at a time, with progressive previews.

The lead's scheduler owns a set of ``ImageState`` objects (one per request, reusable per slot) and
calls ``DiTEngine.step_batch(states)`` repeatedly; states may sit at different step indices and use
different step counts, guidance scales and samplers: each call runs ONE batched DiT forward for all
of them (plus one null-class row per guided state) and advances each by one step.

Samplers (written here, proven equal to diffusers in tests/engines/test_dit.py):

- ``"ddim"``: DDIMScheduler with eta = 0, including its quirks: ``prev_t = t - T // n`` for every
  timestep spacing, ``final_alpha_cumprod`` from ``set_alpha_to_one``, optional x0 clipping.
- ``"euler"``: EulerDiscreteScheduler (eps prediction, s_churn = 0, linear sigma interpolation,
  final sigma 0): ``x0 = x - sigma * eps``, ``x_next = x0 + sigma_next * eps``; the model sees
  ``x / sqrt(sigma^2 + 1)`` and the initial noise is scaled by ``init_noise_sigma``. (DiTPipeline
  itself forgets that scaling, so Euler is checked against diffusers' scheduler, not the pipeline.)

Both are written as ``x0 = (x - b * eps) / a`` (optionally clamped), ``x_next = p * x0 + q * eps``
with per-step scalars precomputed on the CPU in float32 (as diffusers' tables are), so a batch can
mix samplers and steps without host syncs. Latents are kept in float32 whatever the model dtype.

Classifier-free guidance follows diffusers' DiTPipeline exactly: it is on when guidance_scale > 1;
the null class is ``num_classes`` (1000 for ImageNet); ``eps = u + g * (c - u)`` on the first
``in_channels`` (all four eps) channels; the learned-sigma channels are dropped. The original
facebookresearch/DiT sampling script guides only channels [:3]; pass ``guidance_channels=3`` to
reproduce it.

Initial noise: ``torch.randn((1, C, S, S), generator=torch.Generator('cpu').manual_seed(seed))`` in
float32, then moved to the device, which is what DiTPipeline's ``randn_tensor`` does with a list of
per-image CPU generators, so a request's image depends only on its own seed.

Previews: ``latent2rgb`` (fixed linear map on the predicted x0, near-free) or the TAESD decoder
(``preview_decoder/`` in the checkpoint). Images are [B, 3, H, W] in [0, 1]; ``to_jpeg`` for
previews, ``to_png`` for finals.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from realtime.engines.dit import DiT
from realtime.engines.vae import KLDecoder, TinyDecoder, to_unit
from realtime.errors import ConfigError, ModelFormatError, ProtocolError, UnsupportedError

SAMPLERS = ("ddim", "euler")

# Latent -> RGB for the SD-1.x kl-f8 VAE (the VAE DiT uses), applied to *scaled* (diffusion-space)
# latents; rows are latent channels 0..3, columns R, G, B; result is in about [-1, 1]. These are the
# widely used SD15 ``latent_rgb_factors`` (ComfyUI comfy/latent_formats.py, no bias term).
SD15_LATENT_RGB = (
    (0.3512, 0.2297, 0.3227),
    (0.3250, 0.4974, 0.2350),
    (-0.2829, 0.1762, 0.2721),
    (-0.2120, -0.2616, -0.7177),
)

# coefficient row layout of ImageState.coefs
_T, _IN, _A, _B, _P, _Q, _CLIP = range(7)


@dataclass(frozen=True)
class ScheduleConfig:
    """The training noise schedule (diffusers scheduler_config.json fields we honour).

    Defaults are facebook/DiT-XL-2-256's DDIMScheduler config (linear betas, no clipping).
    ``timestep_spacing=None`` means each sampler's diffusers default (DDIM "leading", Euler "linspace").
    """

    num_train_timesteps: int = 1000
    beta_start: float = 0.0001
    beta_end: float = 0.02
    beta_schedule: str = "linear"
    trained_betas: tuple[float, ...] | None = None
    set_alpha_to_one: bool = True
    steps_offset: int = 0
    timestep_spacing: str | None = None
    clip_sample: bool = False
    clip_sample_range: float = 1.0

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "ScheduleConfig":
        if cfg.get("prediction_type", "epsilon") != "epsilon":
            raise ModelFormatError("only epsilon-prediction schedules are supported")
        if cfg.get("thresholding", False) or cfg.get("rescale_betas_zero_snr", False):
            raise ModelFormatError("dynamic thresholding / zero-SNR schedules are not supported")
        for k in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas"):
            if cfg.get(k, False):
                raise ModelFormatError(f"scheduler option {k} is not supported")
        for k, ok in (("interpolation_type", "linear"), ("final_sigmas_type", "zero"), ("timestep_type", "discrete")):
            if cfg.get(k, ok) != ok:
                raise ModelFormatError(f"scheduler option {k}={cfg[k]!r} is not supported")
        tb = cfg.get("trained_betas")
        out = cls(
            num_train_timesteps=int(cfg.get("num_train_timesteps", 1000)),
            beta_start=float(cfg.get("beta_start", 0.0001)),
            beta_end=float(cfg.get("beta_end", 0.02)),
            beta_schedule=str(cfg.get("beta_schedule", "linear")),
            trained_betas=None if tb is None else tuple(float(b) for b in tb),
            set_alpha_to_one=bool(cfg.get("set_alpha_to_one", True)),
            steps_offset=int(cfg.get("steps_offset", 0)),
            timestep_spacing=cfg.get("timestep_spacing"),
            clip_sample=bool(cfg.get("clip_sample", False)),
            clip_sample_range=float(cfg.get("clip_sample_range", 1.0)),
        )
        if out.beta_schedule not in ("linear", "scaled_linear", "squaredcos_cap_v2") and tb is None:
            raise ModelFormatError(f"unsupported beta_schedule {out.beta_schedule!r}")
        if out.timestep_spacing not in (None, "leading", "trailing", "linspace"):
            raise ModelFormatError(f"unsupported timestep_spacing {out.timestep_spacing!r}")
        return out

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ScheduleConfig":
        """``folder/scheduler/scheduler_config.json`` if present, else the DiT defaults."""
        p = Path(folder) / "scheduler" / "scheduler_config.json"
        return cls.from_diffusers(json.loads(p.read_text())) if p.is_file() else cls()

    def alphas_cumprod(self) -> torch.Tensor:
        """[T] float32, computed as diffusers' schedulers do."""
        n = self.num_train_timesteps
        if self.trained_betas is not None:
            betas = torch.tensor(self.trained_betas, dtype=torch.float32)
        elif self.beta_schedule == "linear":
            betas = torch.linspace(self.beta_start, self.beta_end, n, dtype=torch.float32)
        elif self.beta_schedule == "scaled_linear":
            betas = torch.linspace(self.beta_start**0.5, self.beta_end**0.5, n, dtype=torch.float32) ** 2
        else:  # squaredcos_cap_v2 (GLIDE cosine), max beta 0.999
            f = lambda t: math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2  # noqa: E731
            betas = torch.tensor([min(1 - f((i + 1) / n) / f(i / n), 0.999) for i in range(n)], dtype=torch.float32)
        return torch.cumprod(1.0 - betas, dim=0)


def _spaced_timesteps(cfg: ScheduleConfig, n: int, spacing: str, dtype: type) -> np.ndarray:
    T = cfg.num_train_timesteps
    if spacing == "linspace":
        ts = np.linspace(0, T - 1, n, dtype=np.float32 if dtype is np.float32 else np.float64)[::-1].copy()
        return ts if dtype is np.float32 else ts.round().astype(np.int64)
    if spacing == "leading":
        ts = (np.arange(0, n) * (T // n)).round()[::-1].copy().astype(dtype)
        return ts + cfg.steps_offset
    ts = np.round(np.arange(T, 0, -T / n)).astype(dtype)  # trailing
    return ts - 1


def ddim_coefs(cfg: ScheduleConfig, n: int) -> torch.Tensor:
    """[n, 7] float32 per-step coefficients for DDIM eta=0 (row layout _T.._CLIP)."""
    ac = cfg.alphas_cumprod()
    final = torch.tensor(1.0) if cfg.set_alpha_to_one else ac[0]
    ts = _spaced_timesteps(cfg, n, cfg.timestep_spacing or "leading", np.int64)
    rows = []
    for t in ts.tolist():
        prev = t - cfg.num_train_timesteps // n  # diffusers' DDIM uses this for every spacing
        a_t = ac[t]
        a_prev = ac[prev] if prev >= 0 else final
        clip = cfg.clip_sample_range if cfg.clip_sample else math.inf
        sq = [float(v) for v in (a_t**0.5, (1 - a_t) ** 0.5, a_prev**0.5, (1 - a_prev) ** 0.5)]
        rows.append([float(t), 1.0, *sq, clip])
    return torch.tensor(rows, dtype=torch.float32)


def euler_coefs(cfg: ScheduleConfig, n: int) -> tuple[torch.Tensor, float]:
    """([n, 7] float32 per-step coefficients, init_noise_sigma) for Euler (eps, s_churn=0)."""
    ac = cfg.alphas_cumprod()
    spacing = cfg.timestep_spacing or "linspace"
    ts = _spaced_timesteps(cfg, n, spacing, np.float32)
    full = (((1 - ac) / ac) ** 0.5).numpy()  # float32, as diffusers
    sig = np.interp(ts, np.arange(0, len(full)), full)
    sig = torch.from_numpy(np.concatenate([sig, [0.0]]).astype(np.float32))
    init = sig.max()
    init = float(init if spacing in ("linspace", "trailing") else (init**2 + 1) ** 0.5)
    rows = []
    for i, t in enumerate(ts.tolist()):
        s, s_next = sig[i], sig[i + 1]
        rows.append([float(t), float(1 / (s**2 + 1) ** 0.5), 1.0, float(s), 1.0, float(s_next), math.inf])
    return torch.tensor(rows, dtype=torch.float32), init


@dataclass(eq=False)
class ImageState:
    """One image request. Created by ``DiTEngine.new_state``; reuse with ``DiTEngine.reset_state``.

    latents [C, S, S] float32 (device): the current x_t; x0 [C, S, S] float32: the prediction of
    the clean latents made by the last step (zeros before the first). coefs [num_steps, 7] CPU.
    """

    class_label: int
    seed: int
    num_steps: int
    guidance_scale: float
    sampler: str
    latents: torch.Tensor
    x0: torch.Tensor
    coefs: torch.Tensor
    step_index: int = 0
    extra: dict = field(default_factory=dict)  # free slot for the caller (request id, etc.)

    @property
    def done(self) -> bool:
        return self.step_index >= self.num_steps

    @property
    def timesteps(self) -> torch.Tensor:
        """[num_steps] the model timesteps of this request's schedule."""
        return self.coefs[:, _T]


class DiTEngine:
    """A DiT + VAE (+ optional TAESD) bundle that samples many requests step by step."""

    def __init__(
        self,
        dit: DiT,
        vae: KLDecoder,
        preview: TinyDecoder | None = None,
        schedule: ScheduleConfig | None = None,
        guidance_channels: int | None = None,
    ) -> None:
        self.dit = dit
        self.vae = vae
        self.preview_decoder = preview
        self.schedule = schedule or ScheduleConfig()
        c = dit.cfg.in_channels
        self.guidance_channels = c if guidance_channels is None else guidance_channels
        if not 1 <= self.guidance_channels <= c:
            raise ConfigError(f"guidance_channels must be in 1..{c}")
        self.device = dit.patch.weight.device
        self.dtype = dit.patch.weight.dtype
        self._rgb = torch.tensor(SD15_LATENT_RGB, dtype=torch.float32, device=self.device)
        self._coef_cache: dict[tuple[str, int], tuple[torch.Tensor, float]] = {}

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        vae_dtype: torch.dtype | None = None,
        guidance_channels: int | None = None,
    ) -> "DiTEngine":
        """Load transformer/, vae/, optional scheduler/ and preview_decoder/ from a diffusers folder.

        vae_dtype defaults to dtype, except float16 (the SD VAE overflows there) -> float32.
        """
        folder = Path(folder)
        if not folder.is_dir():
            raise ConfigError(f"checkpoint folder {folder} does not exist")
        if vae_dtype is None:
            vae_dtype = torch.float32 if dtype == torch.float16 else dtype
        dit = DiT.from_pretrained(folder, device, dtype)
        vae = KLDecoder.from_pretrained(folder, device, vae_dtype)
        prev = TinyDecoder.from_pretrained(folder, device, vae_dtype) if (folder / "preview_decoder").is_dir() else None
        return cls(dit, vae, prev, ScheduleConfig.from_folder(folder), guidance_channels)

    # ------------------------------------------------------------------ requests

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        c = self.dit.cfg
        return (c.in_channels, c.sample_size, c.sample_size)

    @property
    def image_size(self) -> int:
        """Pixels per side of a decoded image: the kl-f8 VAE upsamples 2x per up block after the first."""
        return self.dit.cfg.sample_size * 2 ** (len(self.vae.cfg.block_out_channels) - 1)

    def _coefs(self, sampler: str, n: int) -> tuple[torch.Tensor, float]:
        key = (sampler, n)
        if key not in self._coef_cache:
            if sampler == "ddim":
                self._coef_cache[key] = (ddim_coefs(self.schedule, n), 1.0)
            else:
                self._coef_cache[key] = euler_coefs(self.schedule, n)
        return self._coef_cache[key]

    def _validate(self, class_label: int, num_steps: int, guidance_scale: float, sampler: str) -> None:
        if sampler not in SAMPLERS:
            raise UnsupportedError(f"sampler must be one of {SAMPLERS}")
        if not 0 <= int(class_label) < self.dit.cfg.num_classes:
            raise ProtocolError(f"class_label must be in 0..{self.dit.cfg.num_classes - 1}")
        if not 1 <= int(num_steps) <= self.schedule.num_train_timesteps:
            raise ProtocolError(f"num_steps must be in 1..{self.schedule.num_train_timesteps}")
        if not (math.isfinite(guidance_scale) and 0 <= guidance_scale <= 100):
            raise ProtocolError("guidance_scale must be a number in [0, 100]")

    def new_state(
        self, class_label: int, seed: int, num_steps: int = 50, guidance_scale: float = 4.0, sampler: str = "ddim"
    ) -> ImageState:
        z = torch.zeros(self.latent_shape, dtype=torch.float32, device=self.device)
        st = ImageState(0, 0, 1, 1.0, "ddim", z, torch.zeros_like(z), torch.zeros(1, 7))
        self.reset_state(st, class_label, seed, num_steps, guidance_scale, sampler)
        return st

    def reset_state(
        self,
        state: ImageState,
        class_label: int,
        seed: int,
        num_steps: int = 50,
        guidance_scale: float = 4.0,
        sampler: str = "ddim",
        noise: torch.Tensor | None = None,
    ) -> None:
        """Re-arm a state for a new request, writing into its existing latent buffers.

        noise: unit-variance initial noise [C, S, S] float32 (CPU); default ``randn`` from ``seed``
        (a clip engine passes its own temporally correlated noise here).
        """
        self._validate(class_label, num_steps, guidance_scale, sampler)
        coefs, init_sigma = self._coefs(sampler, int(num_steps))
        if noise is None:
            gen = torch.Generator("cpu").manual_seed(int(seed))
            noise = torch.randn((1, *self.latent_shape), generator=gen, dtype=torch.float32)[0]
        assert noise.shape == self.latent_shape, f"noise {tuple(noise.shape)}, expected {self.latent_shape}"
        if init_sigma != 1.0:
            noise = noise * init_sigma
        state.latents.copy_(noise)
        state.x0.zero_()
        state.class_label, state.seed = int(class_label), int(seed)
        state.num_steps, state.guidance_scale, state.sampler = int(num_steps), float(guidance_scale), sampler
        state.coefs, state.step_index = coefs, 0
        state.extra.clear()

    # ------------------------------------------------------------------ stepping

    @torch.no_grad()
    def step_batch(self, states: list[ImageState]) -> None:
        """Advance every state by one step with one batched DiT forward. Done states are refused."""
        if not states:
            return
        assert all(not s.done for s in states), "step_batch got a finished state"
        assert all(s.latents.shape == states[0].latents.shape for s in states), "mixed latent shapes"
        cfg = self.dit.cfg
        b, c, gc = len(states), cfg.in_channels, self.guidance_channels
        dev = self.device
        # One host->device copy for all per-request scalars (labels and indices < 2^24: exact in fp32).
        host = torch.stack([s.coefs[s.step_index] for s in states])  # [B, 7]
        guided = [i for i, s in enumerate(states) if s.guidance_scale > 1]
        small = [float(s.class_label) for s in states] + guided + [states[i].guidance_scale for i in guided]
        packed = torch.cat([host.flatten(), torch.tensor(small, dtype=torch.float32)]).to(dev, non_blocking=True)
        ng = len(guided)
        coef = packed[: b * 7].view(b, 7, 1, 1, 1)
        labels = packed[b * 7 : b * 8].long()
        gi = packed[b * 8 : b * 8 + ng].long()
        g = packed[b * 8 + ng :].view(-1, 1, 1, 1)

        x = torch.stack([s.latents for s in states])  # [B, C, S, S] float32
        x_in = x * coef[:, _IN]
        t_in = coef[:, _T, 0, 0, 0]
        y_in = labels
        if guided:
            x_in = torch.cat([x_in, x_in[gi]])
            t_in = torch.cat([t_in, t_in[gi]])
            y_in = torch.cat([labels, torch.full((len(guided),), cfg.num_classes, dtype=torch.long, device=dev)])
        out = self.dit(x_in.to(self.dtype), t_in, y_in).float()
        eps = out[:b, :c]  # learned-sigma channels dropped
        if guided:
            cond, uncond = eps[gi, :gc], out[b:, :gc]
            eps = eps.clone()
            eps[gi, :gc] = uncond + g * (cond - uncond)

        x0 = (x - coef[:, _B] * eps) / coef[:, _A]
        clip = coef[:, _CLIP]
        x0 = torch.maximum(torch.minimum(x0, clip), -clip)
        x_next = coef[:, _P] * x0 + coef[:, _Q] * eps
        for i, s in enumerate(states):
            s.latents.copy_(x_next[i])
            s.x0.copy_(x0[i])
            s.step_index += 1

    def generate(
        self,
        class_labels: list[int],
        seeds: list[int],
        num_steps: int = 50,
        guidance_scale: float = 4.0,
        sampler: str = "ddim",
    ) -> torch.Tensor:
        """Convenience full loop: final latents [B, C, S, S] float32 (decode with ``decode``)."""
        states = [self.new_state(y, s, num_steps, guidance_scale, sampler) for y, s in zip(class_labels, seeds)]
        while not states[0].done:
            self.step_batch(states)
        return torch.stack([s.latents for s in states])

    # ------------------------------------------------------------------ images

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Final latents [B, C, S, S] -> images [B, 3, 8S, 8S] float32 in [0, 1] (full VAE)."""
        return to_unit(self.vae.decode(latents).float())

    @torch.no_grad()
    def preview(self, states: list[ImageState], kind: str = "latent2rgb") -> torch.Tensor:
        """Previews of the states' predicted x0: [B, 3, S, S] ("latent2rgb") or [B, 3, 8S, 8S] ("taesd")."""
        x0 = torch.stack([s.x0 for s in states])
        if kind == "latent2rgb":
            return latent2rgb(x0, self._rgb)
        if kind == "taesd":
            if self.preview_decoder is None:
                raise UnsupportedError("this model has no preview decoder")
            return to_unit(self.preview_decoder.decode(x0).float())
        raise UnsupportedError("preview kind must be 'latent2rgb' or 'taesd'")


def latent2rgb(x0: torch.Tensor, factors: torch.Tensor | None = None) -> torch.Tensor:
    """Diffusion-space latents [B, 4, h, w] -> RGB [B, 3, h, w] float32 in [0, 1] (SD15 factors)."""
    if factors is None:
        factors = torch.tensor(SD15_LATENT_RGB, dtype=torch.float32, device=x0.device)
    rgb = torch.einsum("bchw,cr->brhw", x0.float(), factors)
    return ((rgb + 1) / 2).clamp(0, 1)


def _to_pil(img: torch.Tensor):
    from PIL import Image

    assert img.ndim == 3 and img.shape[0] == 3, "expected one image [3, H, W]"
    if img.dtype != torch.uint8:
        img = (img.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    return Image.fromarray(img.permute(1, 2, 0).contiguous().cpu().numpy())


def to_jpeg(img: torch.Tensor, size: int | tuple[int, int] | None = None, quality: int = 80) -> bytes:
    """One image [3, H, W] (float in [0, 1] or uint8) -> JPEG bytes, resized to size (side or (W, H))."""
    from PIL import Image

    pil = _to_pil(img)
    if size is not None:
        wh = (size, size) if isinstance(size, int) else tuple(size)
        if wh != pil.size:
            pil = pil.resize(wh, Image.BILINEAR)
    buf = io.BytesIO()
    pil.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def to_png(img: torch.Tensor) -> bytes:
    """One image [3, H, W] (float in [0, 1] or uint8) -> PNG bytes (lossless)."""
    buf = io.BytesIO()
    _to_pil(img).save(buf, format="PNG")
    return buf.getvalue()
