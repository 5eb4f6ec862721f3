"""Whisper's log-mel front end in torch (n_fft 400, hop 160, Slaney mel filters, 80 or 128 mels).

Equal to openai/whisper's ``log_mel_spectrogram`` and transformers' ``WhisperFeatureExtractor``:
a centred STFT with a periodic Hann window (reflect padding), the last frame dropped, power
spectrum, Slaney-normalised triangular mel filters on the Slaney mel scale (0-8 kHz), then
``log10(clamp(x, 1e-10))``, a floor 8 decades under each sample's maximum, and ``(x + 4) / 4``.
The filterbank is computed here (float64, then cast), no librosa needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from realtime.errors import ConfigError


@dataclass(frozen=True)
class MelConfig:
    sample_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160
    n_mels: int = 80
    chunk_seconds: int = 30  # Whisper always sees a 30 s window: 3000 frames

    @property
    def n_samples(self) -> int:
        return self.chunk_seconds * self.sample_rate

    @property
    def n_frames(self) -> int:
        return self.n_samples // self.hop_length


# Slaney's mel scale (Auditory Toolbox): linear below 1 kHz, logarithmic above.
_F_SP = 200.0 / 3.0
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOGSTEP = math.log(6.4) / 27.0


def hz_to_mel(f: Tensor) -> Tensor:
    lin = f / _F_SP
    log = _MIN_LOG_MEL + torch.log(torch.clamp(f, min=_MIN_LOG_HZ) / _MIN_LOG_HZ) / _LOGSTEP
    return torch.where(f >= _MIN_LOG_HZ, log, lin)


def mel_to_hz(m: Tensor) -> Tensor:
    lin = m * _F_SP
    log = _MIN_LOG_HZ * torch.exp(_LOGSTEP * (m - _MIN_LOG_MEL))
    return torch.where(m >= _MIN_LOG_MEL, log, lin)


def mel_filters(n_mels: int, n_fft: int = 400, sample_rate: int = 16000,
                f_min: float = 0.0, f_max: float | None = None) -> Tensor:
    """Slaney-normalised triangular filterbank. Returns float64 [n_mels, n_fft // 2 + 1]."""
    if n_mels <= 0 or n_fft <= 0:
        raise ConfigError(f"bad mel filterbank size n_mels={n_mels} n_fft={n_fft}")
    f_max = sample_rate / 2 if f_max is None else f_max
    fft_freqs = torch.linspace(0.0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    mel_pts = torch.linspace(float(hz_to_mel(torch.tensor(f_min, dtype=torch.float64))),
                             float(hz_to_mel(torch.tensor(f_max, dtype=torch.float64))),
                             n_mels + 2, dtype=torch.float64)
    hz_pts = mel_to_hz(mel_pts)  # [M + 2] filter edges in Hz
    widths = hz_pts[1:] - hz_pts[:-1]  # [M + 1]
    rising = (fft_freqs[None, :] - hz_pts[:-2, None]) / widths[:-1, None]  # [M, F]
    falling = (hz_pts[2:, None] - fft_freqs[None, :]) / widths[1:, None]
    fb = torch.clamp(torch.minimum(rising, falling), min=0.0)
    # Slaney norm: each filter has unit area, so wide high-frequency filters are not louder.
    return fb * (2.0 / (hz_pts[2:] - hz_pts[:-2]))[:, None]


def pad_or_trim(audio: Tensor, n_samples: int) -> Tensor:
    """[B, N] -> [B, n_samples]: zero-pad on the right or cut."""
    n = audio.shape[-1]
    if n > n_samples:
        return audio[..., :n_samples]
    if n < n_samples:
        return nn.functional.pad(audio, (0, n_samples - n))
    return audio


class LogMel(nn.Module):
    """Audio [B, N] float 16 kHz -> log-mel [B, n_mels, N // hop] (float32 throughout).

    Call ``pad_or_trim`` first to get Whisper's fixed 3000 frames.
    """

    def __init__(self, cfg: MelConfig = MelConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.register_buffer("window", torch.hann_window(cfg.n_fft, dtype=torch.float32), persistent=False)
        fb = mel_filters(cfg.n_mels, cfg.n_fft, cfg.sample_rate, 0.0, 8000.0)
        self.register_buffer("filters", fb.to(torch.float32), persistent=False)

    def forward(self, audio: Tensor) -> Tensor:
        assert audio.dim() == 2, "audio must be [B, N]"
        # STFT in float32 even when the model runs in bf16: the log and the max-8 floor need it.
        x = audio.to(device=self.window.device, dtype=torch.float32)
        spec = torch.stft(x, self.cfg.n_fft, self.cfg.hop_length, window=self.window,
                          center=True, pad_mode="reflect", return_complex=True)
        power = spec[..., :-1].abs().pow(2).contiguous()  # [B, F, T]; Whisper drops the last frame
        mel = self.filters @ power  # [B, M, T]
        log_spec = torch.clamp(mel, min=1e-10).log10()
        peak = log_spec.amax(dim=(1, 2), keepdim=True)  # per sample, as the batched references do
        log_spec = torch.maximum(log_spec, peak - 8.0)
        return (log_spec + 4.0) / 4.0
