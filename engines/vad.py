"""Silero VAD (v5/v6 ONNX from the ``silero-vad`` wheel) with per-stream state, batched streams.

The model sees 512-sample windows at 16 kHz, each prefixed by the last 64 samples of the
previous window (576 inputs), and carries an LSTM state [2, 1, 128] per stream. ``SileroNet``
is our torch port of the 16 kHz network (STFT as a fixed conv basis, four conv+ReLU blocks,
an LSTM cell, a 1x1 conv + sigmoid); its weights are read from the wheel's
``data/silero_vad.jit`` (the same checkpoint as ``data/silero_vad.onnx``, which the tests use
as the reference through onnxruntime). The ``.safetensors`` in that wheel is a different
checkpoint and is not used. One call scores one window of every stream in the batch, on
CPU or GPU.

On top of the probabilities, ``SileroVad.feed`` turns a stream's audio into speech start/end
events with the hysteresis of silero's own VADIterator (threshold to enter, threshold - 0.15
held for ``min_silence_ms`` to leave, ``speech_pad_ms`` of padding).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from realtime.errors import ConfigError, ModelFormatError, UnsupportedError

WINDOW = 512
CONTEXT = 64
STATE_SHAPE = (2, 1, 128)


@dataclass(frozen=True)
class VadConfig:
    sample_rate: int = 16000
    threshold: float = 0.5
    neg_threshold_delta: float = 0.15  # leave speech only below threshold - delta
    min_silence_ms: int = 100
    speech_pad_ms: int = 30


@dataclass(frozen=True)
class VadEvent:
    kind: str  # "start" | "end"
    sample: int  # position in the stream (samples at 16 kHz), padding applied

    @property
    def ms(self) -> int:
        return self.sample * 1000 // 16000


@dataclass
class VadState:
    """One stream's VAD state: LSTM state, 64-sample context, unscored tail, trigger logic."""

    rnn: np.ndarray = field(default_factory=lambda: np.zeros(STATE_SHAPE, np.float32))
    context: np.ndarray = field(default_factory=lambda: np.zeros(CONTEXT, np.float32))
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    samples_scored: int = 0  # samples consumed by full windows
    triggered: bool = False
    temp_end: int = 0
    last_prob: float = 0.0

    def reset(self) -> None:
        self.rnn[...] = 0.0
        self.context[...] = 0.0
        self.pending = np.zeros(0, np.float32)
        self.samples_scored = 0
        self.triggered = False
        self.temp_end = 0
        self.last_prob = 0.0


def default_model_path(kind: str = "jit") -> Path:
    """The wheel's 16 kHz model: ``silero_vad.jit`` (our weights) or ``.onnx`` (reference)."""
    try:
        root = resources.files("silero_vad")
    except ModuleNotFoundError as e:
        raise ConfigError("Silero VAD needs the silero-vad package (its data/ folder)") from e
    return Path(str(root.joinpath("data", f"silero_vad.{kind}")))


class SileroNet(nn.Module):
    """Silero VAD v5 at 16 kHz: x [B, 576] (64 context + 512 new), state [2, B, 128] (h, c)
    -> speech probability [B], next state [2, B, 128]."""

    def __init__(self) -> None:
        super().__init__()
        # STFT as a conv: 129 real + 129 imaginary basis rows of length 256, hop 128.
        self.register_buffer("basis", torch.zeros(258, 1, 256))
        chans = [(129, 128, 1), (128, 64, 2), (64, 64, 2), (64, 128, 1)]
        self.convs = nn.ModuleList(nn.Conv1d(i, o, 3, stride=s, padding=1) for i, o, s in chans)
        self.rnn = nn.LSTMCell(128, 128)
        self.head = nn.Conv1d(128, 1, 1)

    def forward(self, x: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        x = F.pad(x, (0, 64), mode="reflect")[:, None]  # [B, 1, 640]
        spec = F.conv1d(x, self.basis, stride=128)  # [B, 258, 4]
        mag = torch.sqrt(spec[:, :129] ** 2 + spec[:, 129:] ** 2)
        h = mag
        for conv in self.convs:
            h = F.relu(conv(h))  # time 4 -> 4 -> 2 -> 1 -> 1
        h, c = self.rnn(h[:, :, 0], (state[0], state[1]))
        p = torch.sigmoid(self.head(F.relu(h)[:, :, None]))  # [B, 1, 1]
        return p[:, 0].mean(-1), torch.stack([h, c])

    @classmethod
    def from_jit(cls, path: str | Path) -> "SileroNet":
        """Weights of the 16 kHz sub-model of silero's TorchScript file."""
        try:
            # Only the weights are read (the TorchScript code is not run); the wheel's ONNX
            # graph stores them as inline constants, so the .jit archive is the clean source.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                sd = torch.jit.load(str(path), map_location="cpu")._model.state_dict()
        except (RuntimeError, AttributeError, OSError) as e:
            raise ModelFormatError(f"cannot read Silero VAD weights from {path}: {e}") from e
        ours = {"basis": sd["stft.forward_basis_buffer"]}
        for i in range(4):
            ours[f"convs.{i}.weight"] = sd[f"encoder.{i}.reparam_conv.weight"]
            ours[f"convs.{i}.bias"] = sd[f"encoder.{i}.reparam_conv.bias"]
        for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            ours[f"rnn.{k}"] = sd[f"decoder.rnn.{k}"]
        ours["head.weight"] = sd["decoder.decoder.2.weight"]
        ours["head.bias"] = sd["decoder.decoder.2.bias"]
        net = cls()
        net.load_state_dict(ours, strict=True)
        return net.eval()


class SileroVad:
    """Speech probability per 512-sample window (32 ms) for any number of streams."""

    def __init__(self, path: str | Path | None = None, config: VadConfig = VadConfig(),
                 device: str | torch.device = "cpu") -> None:
        if config.sample_rate != 16000:
            raise UnsupportedError("Silero VAD runs at 16 kHz here")
        self.cfg = config
        p = default_model_path("jit") if path is None else Path(path)
        if not p.exists():
            raise ConfigError(f"VAD model {p} does not exist")
        self.device = torch.device(device)
        self.net = SileroNet.from_jit(p).to(self.device)

    def new_state(self) -> VadState:
        return VadState()

    def window_probs(self, states: list[VadState], windows: np.ndarray) -> np.ndarray:
        """Score one window per stream: windows [B, 512] float32 -> probabilities [B].

        Updates each state's LSTM state and context; does not touch the trigger logic.
        """
        windows = np.asarray(windows, dtype=np.float32)
        b = len(states)
        assert windows.shape == (b, WINDOW), f"need [{b}, {WINDOW}] windows, got {windows.shape}"
        x = np.concatenate([np.stack([s.context for s in states]), windows], axis=1)  # [B, 576]
        rnn = np.concatenate([s.rnn for s in states], axis=1)  # [2, B, 128]
        with torch.inference_mode():
            prob, rnn_next = self.net(torch.from_numpy(x).to(self.device),
                                      torch.from_numpy(rnn).to(self.device))
        # The trigger logic is host-side, so the probabilities come back every window anyway.
        prob = prob.float().cpu().numpy()
        rnn_next = rnn_next.float().cpu().numpy()
        for i, s in enumerate(states):
            s.rnn[...] = rnn_next[:, i : i + 1]
            s.context[...] = windows[i, -CONTEXT:]
            s.samples_scored += WINDOW
            s.last_prob = float(prob[i])
        return prob

    def probs(self, state: VadState, audio: np.ndarray) -> np.ndarray:
        """Append audio to one stream and score every complete window -> probabilities [W]."""
        return self.feed_many([state], [audio])[0][0]

    def feed(self, state: VadState, audio: np.ndarray) -> list[VadEvent]:
        """Append audio to one stream -> speech start/end events completed by it."""
        return self.feed_many([state], [audio])[1][0]

    def feed_many(self, states: list[VadState], audios: list[np.ndarray]
                  ) -> tuple[list[np.ndarray], list[list[VadEvent]]]:
        """Append audio to several streams, scoring their windows in batched model calls.

        Returns per stream the window probabilities and the start/end events.
        """
        assert len(states) == len(audios)
        bufs = []
        for s, a in zip(states, audios):
            a = np.asarray(a, dtype=np.float32).reshape(-1)
            bufs.append(np.concatenate([s.pending, a]) if s.pending.size else a)
        n_win = [len(b) // WINDOW for b in bufs]
        probs: list[list[float]] = [[] for _ in states]
        events: list[list[VadEvent]] = [[] for _ in states]
        for w in range(max(n_win, default=0)):
            live = [i for i, n in enumerate(n_win) if n > w]
            win = np.stack([bufs[i][w * WINDOW : (w + 1) * WINDOW] for i in live])
            p = self.window_probs([states[i] for i in live], win)
            for j, i in enumerate(live):
                probs[i].append(float(p[j]))
                ev = self._step(states[i], float(p[j]))
                if ev is not None:
                    events[i].append(ev)
        for i, s in enumerate(states):
            s.pending = bufs[i][n_win[i] * WINDOW :].copy()
        return [np.asarray(p, np.float32) for p in probs], events

    def _step(self, s: VadState, prob: float) -> VadEvent | None:
        """VADIterator's hysteresis for the window that ends at ``s.samples_scored``."""
        c = self.cfg
        pad = c.sample_rate * c.speech_pad_ms // 1000
        min_sil = c.sample_rate * c.min_silence_ms / 1000
        cur = s.samples_scored
        if prob >= c.threshold and s.temp_end:
            s.temp_end = 0
        if prob >= c.threshold and not s.triggered:
            s.triggered = True
            return VadEvent("start", max(0, cur - pad - WINDOW))
        if prob < c.threshold - c.neg_threshold_delta and s.triggered:
            if not s.temp_end:
                s.temp_end = cur
            if cur - s.temp_end < min_sil:
                return None
            end = s.temp_end + pad - WINDOW
            s.temp_end = 0
            s.triggered = False
            return VadEvent("end", end)
        return None

    def flush(self, state: VadState) -> list[VadEvent]:
        """End of stream: close an open speech segment at the last scored sample."""
        if state.triggered:
            state.triggered = False
            state.temp_end = 0
            return [VadEvent("end", state.samples_scored + len(state.pending))]
        return []
