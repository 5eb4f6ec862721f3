"""Text-to-speech jobs and the backend interface every TTS engine implements for the scheduler.

A ``TTSJob`` is one /v1/tts stream (or one /v1/audio/speech request). Text goes in through
``push_text``; the backend's lanes turn it into native-rate PCM and hand it to ``emit_pcm``, which
resamples to the client's rate, cuts chunks of ``frame_samples``, packs them in the client's format
and puts them on the bounded output channel. The session's sender drains that channel.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from realtime.codecs.resample import StreamResampler, pack_pcm, pack_pcm_rows
from realtime.errors import ProtocolError, UnsupportedError
from realtime.protocol.segmenter import Segmenter
from realtime.protocol.tts import StartParams
from realtime.scheduler import Job, JobState, Lane, OutputChannel, Priority, Scheduler, signal_all

MAX_PENDING_CHARS = 100_000  # text accepted but not yet spoken, per stream
MAX_AHEAD_S = 8.0  # audio produced ahead of the (simulated) player, per stream
OUTPUT_CAPACITY = 512  # chunks produced but not yet sent, per stream
OUTPUT_RESERVE = 8  # a lane produces for a stream only while its channel has more room than this
_NO_SAMPLES = np.zeros(0, dtype=np.float32)


@dataclass
class AudioChunk:
    seq: int
    data: bytes
    start_ms: float
    duration_ms: float


class EndOfStream:
    """Sentinel on the output channel: everything asked for has been produced."""


class SpurtEnd:
    """Sentinel: all text so far is spoken; the client's player may now run dry without an underrun."""


END = EndOfStream()
SPURT_END = SpurtEnd()


class TTSJob(Job):
    """One stream of speech. Engine lanes keep their per-stream state in ``engine_state``."""

    priority = Priority.REALTIME

    def __init__(self, params: StartParams, native_rate: int, chunk_samples: int, session: str = "") -> None:
        super().__init__()
        self.params = params
        self.session = session
        self.native_rate = native_rate
        self.chunk_samples = chunk_samples  # at the output rate
        self.segmenter = Segmenter()
        self.segments: deque[str] = deque()
        self.pending_chars = 0
        self.stopping = False  # client sent stop: finish what is queued, then END
        # Lanes check has_room(), so the sender's takes wake the scheduler only when a lane was
        # actually held back by a full channel, not once per chunk sent.
        self.output = OutputChannel(capacity=OUTPUT_CAPACITY, wake_on_refusal=True)
        self.resampler = StreamResampler(native_rate, params.sample_rate)
        self._carry = _NO_SAMPLES
        self.seq = 0
        self.out_samples = 0
        self.engine_state: Any = None
        self.frames = 0  # engine frames generated (latent frames / codec frames)
        self.input_tokens = 0  # positions the model read for it: phoneme ids (Piper), prompt tokens and frames (CSM)
        self.compute_s = 0.0  # share of worker step time spent on this job
        # producer-side model of the client's player, for the deadline
        self.spurt_start: float | None = None
        self.play_end: float | None = None
        self.first_text_at: float | None = None
        self.ended = False
        self._spurt_open = False

    def notify(self) -> None:
        self.output.close()

    def count_input(self, n: int) -> None:
        """n more input positions the model read (a worker thread's; read once the job has ended)."""
        self.input_tokens += n

    # ---- called from the session (event loop thread) ----
    def push_text(self, text: str) -> None:
        self._queue(self.segmenter.push(text))

    def flush(self) -> None:
        self._queue(self.segmenter.flush())

    def stop(self) -> None:
        """Speak what was sent (including an unterminated tail), then end."""
        with self.lock:
            self.stopping = True
        self.flush()
        self.finish_spurt()  # nothing left in flight: end now (a no-op while audio is being made)

    def _queue(self, segments: list[str]) -> None:
        if not segments:
            return
        with self.lock:
            total = self.pending_chars + sum(len(s) for s in segments)
            if total > MAX_PENDING_CHARS:
                raise ProtocolError(f"more than {MAX_PENDING_CHARS} characters waiting to be spoken",
                                    code="too_much_text")
            now = time.monotonic()
            if self.first_text_at is None:
                self.first_text_at = now
            if not self.segments and not self.has_engine_work():
                self.spurt_start = now  # a new talk spurt: its first audio is due now
            self.segments.extend(segments)
            self.pending_chars = total

    # ---- called from lanes (worker threads) ----
    def take_segment(self) -> str | None:
        """Pop the next segment and count it in ``engine_state.inflight`` in one locked step, so the
        stream never looks idle between the two; the lane lowers ``inflight`` when its work is visible."""
        with self.lock:
            if not self.segments:
                return None
            seg = self.segments.popleft()
            self.pending_chars -= len(seg)
            self.engine_state.inflight += 1
            return seg

    def has_text(self) -> bool:
        return bool(self.segments)

    def has_engine_work(self) -> bool:
        """Overridden per backend through engine_state; True while audio is still being made."""
        st = self.engine_state
        return bool(st is not None and getattr(st, "busy", lambda: False)())

    def ahead_s(self, now: float) -> float:
        return 0.0 if self.play_end is None else max(0.0, self.play_end - now)

    def can_produce(self, now: float) -> bool:
        # The clock first: a paced stream (far ahead of its player) is the common "no", and the
        # channel's lock and refusal bookkeeping are for streams that would otherwise produce.
        return self.active and self.ahead_s(now) < MAX_AHEAD_S and self.output.has_room(OUTPUT_RESERVE)

    def deadline(self, now: float) -> float:
        if self.play_end is not None and self.play_end > now:
            return self.play_end
        return self.spurt_start if self.spurt_start is not None else self.created

    def emit_pcm(self, pcm: np.ndarray, frames: int = 0, signal: bool = True) -> None:
        """Native-rate float32 PCM [N] from the engine → chunks on the output channel (``signal``:
        wake the sender now; False leaves it to the caller's ``signal_all``). ``emit_pcm_rows``
        does this for a batch of streams at once."""
        self.frames += frames
        y = self.resampler.process(pcm)
        self._chunk(y, final=False, signal=signal)

    def finish_spurt(self) -> None:
        """The engine has spoken every queued segment; ends the stream if stop was requested.

        Safe to call from any thread and more than once: only the first call that finds no work
        left acts.
        """
        with self.lock:
            if self.ended or self.segments or self.has_engine_work():
                return
            final = self.stopping
            self.ended = final
            spurt_open, self._spurt_open = self._spurt_open, False
            self.spurt_start = None
        if spurt_open or final:
            # The client must hear the whole spurt now, not when more text comes: drain the
            # resampler and send the short last chunk. A new spurt starts from fresh state.
            self._chunk(self.resampler.flush(), final=True)
            self.resampler = StreamResampler(self.native_rate, self.params.sample_rate)
        if final:
            self.state = JobState.FINISHED  # before END is seen: the session reaps the job on END
            self.output.put(END)
        elif spurt_open:
            self.output.put(SPURT_END)

    def _chunk(self, y: np.ndarray, final: bool, signal: bool = True) -> None:
        pieces = self._cut(y, final)
        self._put_chunks([pack_pcm(p, self.params.format) for p in pieces], [len(p) for p in pieces], signal)

    def _cut(self, y: np.ndarray, final: bool) -> list[np.ndarray]:
        """The carry plus ``y`` cut into chunks of ``chunk_samples`` (and, when ``final``, the short
        rest); what is left waits in the carry for the next call."""
        buf = np.concatenate([self._carry, y]) if len(self._carry) else y
        n = self.chunk_samples
        full = len(buf) // n * n
        pieces = [buf[i:i + n] for i in range(0, full, n)]
        rest = buf[full:]
        if final and len(rest):
            pieces.append(rest)
            rest = _NO_SAMPLES
        # A copy: ``y`` may be a view of the engine's reused output buffer.
        self._carry = rest.copy() if len(rest) else _NO_SAMPLES
        return pieces

    def _put_chunks(self, data: list[bytes], samples: list[int], signal: bool) -> None:
        """Packed chunks (``samples`` each, at the output rate) → the output channel, in order."""
        rate = self.params.sample_rate
        now = time.monotonic()
        for d, n in zip(data, samples, strict=True):
            dur = n / rate
            self.output.put(AudioChunk(self.seq, d, self.out_samples * 1000.0 / rate, dur * 1000.0), signal=signal)
            self.seq += 1
            self.out_samples += n
            self.play_end = max(self.play_end or now, now) + dur
            self._spurt_open = True

    def audio_s(self) -> float:
        return self.out_samples / self.params.sample_rate


def emit_pcm_rows(jobs: Sequence[TTSJob], pcm: np.ndarray, frames: int = 1) -> None:
    """``jobs[i].emit_pcm(pcm[i], frames)`` for every row of native-rate float32 PCM [B, N] (one
    batched decoder step), with the per-chunk work batched: chunks of one format and length are
    clipped, scaled and packed in one numpy op for all streams, and the senders are woken with one
    cross-thread call per event loop. Same chunks, bytes and order as the per-stream calls."""
    assert pcm.ndim == 2 and len(pcm) == len(jobs), f"pcm {pcm.shape} for {len(jobs)} jobs"
    cuts: list[list[np.ndarray]] = []
    groups: dict[tuple[str, int], list[np.ndarray]] = {}
    for job, row in zip(jobs, pcm, strict=True):
        job.frames += frames
        pieces = job._cut(job.resampler.process(row), final=False)
        cuts.append(pieces)
        fmt = job.params.format
        for p in pieces:
            groups.setdefault((fmt, len(p)), []).append(p)
    packed = {key: iter(pack_pcm_rows(np.stack(ps), key[0])) for key, ps in groups.items()}
    for job, pieces in zip(jobs, cuts, strict=True):
        fmt = job.params.format
        job._put_chunks([next(packed[(fmt, len(p))]) for p in pieces], [len(p) for p in pieces], signal=False)
    signal_all(job.output for job in jobs)


class TTSBackend(ABC):
    """What a TTS engine offers the server: its lanes and how to make a job for it."""

    name: str
    native_rate: int
    default_chunk_ms: int
    voices: tuple[str, ...] = ()

    @abstractmethod
    def lanes(self) -> list[Lane]:
        """The lanes a job passes through, in pipeline order (registered with the scheduler once)."""

    def describe(self) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "kind": "tts", "sample_rate": self.native_rate,
                "voices": list(self.voices)}

    def check(self, params: StartParams) -> None:
        """Reject start parameters this backend cannot honour (voice, reference audio)."""
        if params.voice is not None and self.voices and params.voice not in self.voices:
            raise UnsupportedError(f"unknown voice '{params.voice[:40]}'; available: {', '.join(self.voices)}")

    def prepare(self, job: TTSJob) -> None:
        """Per-job setup in the event-loop thread (cheap: validation, state objects)."""

    def new_job(self, params: StartParams, session: str = "") -> TTSJob:
        self.check(params)
        chunk_ms = params.chunk_ms or self.default_chunk_ms
        chunk_samples = max(1, params.sample_rate * chunk_ms // 1000)
        job = TTSJob(params, self.native_rate, chunk_samples, session)
        self.prepare(job)
        return job

    def submit(self, scheduler: Scheduler, job: TTSJob) -> TTSJob:
        scheduler.submit(job, self._registered(scheduler))
        return job

    def _registered(self, scheduler: Scheduler) -> list[Lane]:
        """This backend's lanes in ``scheduler``, added on first use (one set per scheduler)."""
        per = self.__dict__.setdefault("_lanes_by_scheduler", {})
        if id(scheduler) not in per:
            per[id(scheduler)] = (scheduler, [scheduler.add_lane(lane) for lane in self.lanes()])
        return per[id(scheduler)][1]
