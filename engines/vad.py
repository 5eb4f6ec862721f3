"""Silero VAD (v5/v6 ONNX from the ``silero-vad`` wheel) with per-stream state, batched streams.

The model sees 512-sample windows at 16 kHz, each prefixed by the last 64 samples of the
previous window (576 inputs), and carries an LSTM state [2, 1, 128] per stream. We run the
wheel's ``data/silero_vad.onnx`` through onnxruntime: the graph takes a batch dimension, so
one call scores one window of every stream in the batch. (The ``.safetensors`` in the same
wheel is a different checkpoint and is not used.)

On top of the probabilities, ``SileroVad.feed`` turns a stream's audio into speech start/end
events with the hysteresis of silero's own VADIterator (threshold to enter, threshold - 0.15
held for ``min_silence_ms`` to leave, ``speech_pad_ms`` of padding).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from realtime.errors import ConfigError, UnsupportedError

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


def default_model_path() -> Path:
    try:
        root = resources.files("silero_vad")
    except ModuleNotFoundError as e:
        raise ConfigError("Silero VAD needs the silero-vad package (its data/silero_vad.onnx)") from e
    return Path(str(root.joinpath("data", "silero_vad.onnx")))


class SileroVad:
    """Speech probability per 512-sample window (32 ms) for any number of streams."""

    def __init__(self, path: str | Path | None = None, config: VadConfig = VadConfig(),
                 providers: list[str] | None = None, threads: int = 1) -> None:
        import onnxruntime as ort

        if config.sample_rate != 16000:
            raise UnsupportedError("Silero VAD runs at 16 kHz here")
        self.cfg = config
        p = default_model_path() if path is None else Path(path)
        if not p.exists():
            raise ConfigError(f"VAD model {p} does not exist")
        opts = ort.SessionOptions()
        # The model is tiny: extra threads only add scheduling cost next to the ASR work.
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(p), sess_options=opts,
                                            providers=providers or ["CPUExecutionProvider"])
        self._sr = np.array(16000, dtype=np.int64)

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
        out, rnn_next = self.session.run(None, {"input": x, "state": rnn, "sr": self._sr})
        for i, s in enumerate(states):
            s.rnn[...] = rnn_next[:, i : i + 1]
            s.context[...] = windows[i, -CONTEXT:]
            s.samples_scored += WINDOW
            s.last_prob = float(out[i, 0])
        return out[:, 0].astype(np.float32)

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
