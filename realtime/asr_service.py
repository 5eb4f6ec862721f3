"""Streaming speech recognition on the one scheduler: WebSocket /v1/asr, POST /v1/audio/transcriptions.

Per stream (an ``ASRJob``) audio flows through two lanes on the generator worker:

- ``vad``: every stream with audio waiting gets its new audio scored by Silero VAD, the windows
  of all those streams batched per model call. Speech start opens an *utterance*; speech end (or
  a client ``finalize``) closes it. Audio goes into one bounded per-stream buffer.
- ``asr.decode``: every stream whose utterance is due for a re-decode (partials, on a cadence of
  stream time) or whose utterance has ended (a final) gets the audio of its current segment
  decoded by Whisper — mel, encoder and greedy decoder batched across streams in one call. The
  LocalAgreement-2 policy (``realtime.engines.asr_policy``) turns hypotheses into partials and
  finals; segments near Whisper's 30 s window are cut at the last agreed word.

Deadlines (EDF across every lane of the server, TTS included): a final is due when its end of
speech was heard, one second early so that finals beat partials and new audio; so is the decode
at the onset of silence (when the VAD then confirms the end, that hypothesis is the final and no
decode is left); new audio is due when it arrived; a partial is due when the stream's audio made
the next re-decode due, spaced by the last step's duration so that under load partials thin out.
Steps that carry finals carry no plain partials. docs/asr.md has the full picture.

Everything is bounded: audio waiting for the VAD (``max_inbox_s``, the session stops reading
the socket when it is full: TCP back-pressure), the utterance buffer (``max_buffer_s``: the VAD
lane waits until a cut frees room), ended utterances waiting for their final, output messages.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import os
import sys
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from realtime.codecs.resample import StreamResampler, resample, unpack_pcm
from realtime.config import ServerConfig
from realtime.engines.asr_policy import AsrEvent, LocalAgreementPolicy, PolicyConfig
from realtime.errors import InternalError, ProtocolError, RealtimeError, UnsupportedError
from realtime.protocol import messages as m
from realtime.protocol.asr import ASRParams, ASRProtocol, Audio, Finalize, Start, Stop, parse_start
from realtime.scheduler import Job, JobState, Lane, OutputChannel, Priority, Scheduler
from realtime.service import Service
from realtime.sessions import StreamSession

if TYPE_CHECKING:
    from realtime.engines.vad import SileroVad, VadEvent
    from realtime.engines.whisper import Whisper
    from realtime.server import AppState
    from realtime.sessions import Connection

log = logging.getLogger("realtime.asr")

RATE = 16000


@dataclass(frozen=True)
class AsrConfig:
    decode_every_ms: int = 500  # partial re-decode cadence (stream time)
    min_decode_ms: int = 300
    segment_ms: int = 29000  # longest audio given to one decode (Whisper sees 30 s)
    vad_threshold: float = 0.5
    min_silence_ms: int = 500  # silence that ends an utterance (shorter: pauses inside sentences split it)
    speech_pad_ms: int = 150  # audio kept around the VAD's speech edges
    max_buffer_s: float = 35.0  # utterance audio held per stream
    max_inbox_s: float = 30.0  # audio received but not yet through the VAD, per live stream
    vad_step_s: float = 2.0  # audio per stream per VAD step (a file upload must not hog the worker)
    max_pending_utterances: int = 4  # ended utterances waiting for their final
    idle_keep_ms: int = 1000  # audio kept before speech starts (the VAD start is padded back)
    final_boost_s: float = 1.0  # finals are this much more urgent than anything else
    # Partials are best effort: after a decode step of d seconds a stream's next partial waits at
    # least partial_gap * d, so re-decodes take at most ~1/(1+gap) of the worker under load.
    partial_gap: float = 2.0
    max_batch: int = 8  # streams per decode call
    output_capacity: int = 256
    max_file_s: float = 600.0  # longest upload to /v1/audio/transcriptions


class EndOfStream:
    """Sentinel on the output channel: every final after 'stop' is out."""


END = EndOfStream()
_FINALIZE = object()  # marker in the inbox: close the open utterance at this point of the stream


@dataclass
class Utterance:
    """One VAD speech segment of a stream, in 16 kHz stream samples."""

    start: int
    policy: LocalAgreementPolicy
    end: int | None = None  # set at the VAD end (or finalize): the final is now due
    ended_at: float | None = None  # monotonic time the end-of-speech audio arrived

    @property
    def seg_start(self) -> int:
        return self.policy.segment_start_ms * RATE // 1000


class ASRJob(Job):
    """One recognition stream (a /v1/asr session or one uploaded file)."""

    priority = Priority.REALTIME

    def __init__(self, params: ASRParams, cfg: AsrConfig, vad_state: Any, live: bool = True,
                 session: str = "", max_inbox_s: float | None = None) -> None:
        super().__init__()
        self.params = params
        self.cfg = cfg
        self.live = live  # a real-time stream (latency is measured) vs an uploaded file
        # params.words: each final carries "words": [{word, start_ms, end_ms}] (stream time), from
        # an alignment pass over the final's audio that only these jobs pay for.
        self.words = params.words
        self.last_word_end = 0.0  # seconds, stream time: the alignment's pause reference
        self.session = session
        self.policy_cfg = PolicyConfig(decode_every_ms=cfg.decode_every_ms, min_decode_ms=cfg.min_decode_ms,
                                       max_segment_ms=cfg.segment_ms + 1000, cut_margin_ms=1000)
        self.vad_state = vad_state
        self.output = OutputChannel(capacity=cfg.output_capacity)
        # audio received, not yet through the VAD: float32 16 kHz arrays and _FINALIZE markers
        self.inbox: deque[Any] = deque()
        self.inbox_samples = 0
        self.max_inbox = int((cfg.max_inbox_s if max_inbox_s is None else max_inbox_s) * RATE)
        self.inbox_since: float | None = None  # arrival of the oldest waiting audio
        self.samples_in = 0  # 16 kHz samples received
        self.arrivals: deque[tuple[int, float]] = deque(maxlen=8192)  # (end sample, arrival time)
        # the utterance buffer: stream samples [buf_start, buf_start + buf_len)
        self.buf = np.zeros(int(cfg.max_buffer_s * RATE), np.float32)
        self.buf_start = 0
        self.buf_len = 0
        self.utts: deque[Utterance] = deque()  # ended ones first, at most one open (the last)
        self.partial_due_at: float | None = None
        self.next_partial_at = 0.0  # monotonic; set by the decode lane from its step time
        self.early = False  # the due decode is the one at the onset of silence (a likely final)
        self.stopping = False
        self.ended = False
        self.finals = 0
        self.latencies: list[float] = []  # end of speech -> final, seconds
        self.compute_s = 0.0
        self.on_final: Callable[[float], None] | None = None
        # A client (``preview`` in its start; the voice agent always) may ask for a preview of the
        # likely final: the hypothesis of the decode made when silence began ({"type":
        # "final_preview"}), then {"type": "speech_resumed"} if the speaker goes on before the VAD
        # ends the utterance.
        self.preview = params.preview
        self.preview_sent = False

    def notify(self) -> None:
        self.output.close()

    # ---- event-loop side ----
    def inbox_full(self) -> bool:
        return self.inbox_samples >= self.max_inbox

    def push_audio(self, x: np.ndarray) -> None:
        if not len(x):
            return
        now = time.monotonic()
        with self.lock:
            self.inbox.append(np.asarray(x, np.float32))
            self.inbox_samples += len(x)
            self.samples_in += len(x)
            self.arrivals.append((self.samples_in, now))
            if self.inbox_since is None:
                self.inbox_since = now

    def push_finalize(self) -> None:
        with self.lock:
            self.inbox.append(_FINALIZE)
            if self.inbox_since is None:
                self.inbox_since = time.monotonic()

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
        self.push_finalize()

    # ---- scheduling ----
    def final_due(self) -> bool:
        try:
            return self.utts[0].end is not None
        except IndexError:
            return False

    def deadline(self, now: float) -> float:
        if not self.live:
            return now + 0.5  # an uploaded file yields to every live stream due within 0.5 s
        utts = self.utts
        if utts and utts[0].end is not None and utts[0].ended_at is not None:
            return utts[0].ended_at - self.cfg.final_boost_s
        if self.early and self.partial_due_at is not None:
            return self.partial_due_at - self.cfg.final_boost_s
        due = [t for t in (self.inbox_since, self.partial_due_at) if t is not None]
        return min(due) if due else now + 1.0

    # ---- worker side (lanes; under self.lock where it touches shared queues) ----
    def arrival_of(self, sample: int) -> float:
        """When the audio up to stream sample ``sample`` had arrived (monotonic)."""
        for end, t in self.arrivals:
            if end >= sample:
                return t
        return self.arrivals[-1][1] if self.arrivals else time.monotonic()

    def take_inbox(self, room: int) -> tuple[np.ndarray, bool]:
        """Up to ``room`` samples of waiting audio, and whether a finalize marker follows them."""
        parts: list[np.ndarray] = []
        got = 0
        finalize = False
        with self.lock:
            while self.inbox:
                head = self.inbox[0]
                if head is _FINALIZE:  # the audio before it is taken; the marker ends this take
                    self.inbox.popleft()
                    finalize = True
                    break
                if got >= room:
                    break
                n = min(len(head), room - got)
                parts.append(head[:n])
                got += n
                if n == len(head):
                    self.inbox.popleft()
                else:
                    self.inbox[0] = head[n:]
            self.inbox_samples -= got
            self.inbox_since = time.monotonic() if self.inbox else None
        audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        return audio, finalize

    @property
    def buf_end(self) -> int:
        return self.buf_start + self.buf_len

    def append(self, x: np.ndarray) -> None:
        n = len(x)
        assert self.buf_len + n <= len(self.buf), "VAD lane ignored the buffer bound"
        self.buf[self.buf_len:self.buf_len + n] = x
        self.buf_len += n

    def audio(self, start: int, end: int) -> np.ndarray:
        s = max(start, self.buf_start) - self.buf_start
        e = min(end, self.buf_end) - self.buf_start
        return self.buf[s:max(s, e)]

    def trim(self) -> None:
        """Drop buffered audio no utterance needs any more (memmove of what is kept)."""
        keep = self.utts[0].seg_start if self.utts else self.buf_end - self.cfg.idle_keep_ms * RATE // 1000
        drop = min(max(0, keep - self.buf_start), self.buf_len)
        if drop:
            self.buf[: self.buf_len - drop] = self.buf[drop:self.buf_len]
            self.buf_len -= drop
            self.buf_start += drop

    def open_utt(self) -> Utterance | None:
        return self.utts[-1] if self.utts and self.utts[-1].end is None else None

    def update_partial_due(self) -> None:
        u = self.utts[0] if self.utts else None
        if u is None or u.end is not None:
            self.partial_due_at = None
            self.early = False
            return
        t_ms = min(self.buf_end, u.seg_start + self.cfg.segment_ms * RATE // 1000) * 1000 // RATE
        seg_ms = t_ms - u.policy.segment_start_ms
        st = self.vad_state
        if (self.live and st.triggered and st.temp_end and u.policy.last_decode_ms * RATE // 1000 < st.temp_end
                and seg_ms >= self.cfg.min_decode_ms and t_ms * RATE // 1000 >= st.temp_end):
            # Silence has begun: decode everything up to here now, urgently. If the VAD then ends
            # the utterance (after its silence hangover) this hypothesis is the final, so the
            # final costs no decode after the end of speech is confirmed.
            if not self.early:
                self.early = True
                self.partial_due_at = time.monotonic()
            return
        # Without interim results a re-decode only serves to cut an utterance longer than 30 s.
        due = u.policy.should_decode(t_ms) and (self.params.interim or seg_ms >= self.cfg.segment_ms)
        if not due:
            self.partial_due_at = None
        elif self.partial_due_at is None:
            self.partial_due_at = max(time.monotonic(), self.next_partial_at)

    def maybe_finish(self) -> None:
        with self.lock:
            if self.ended or not self.stopping or self.inbox or self.utts:
                return
            self.ended = True
        self.output.put(END)
        self.state = JobState.FINISHED

    def emit(self, ev: AsrEvent, utt: Utterance, at_end: bool, words: list[dict[str, Any]] | None = None) -> None:
        """A policy event -> an output message; ``at_end``: the final of an ended utterance;
        ``words``: a final's word timestamps, sent with it."""
        if ev.kind == "final":
            self.finals += 1
            msg: dict[str, Any] = {"type": "final", "text": ev.text, "start_ms": ev.start_ms, "end_ms": ev.end_ms}
            if words is not None:
                msg["words"] = words
            if at_end and utt.ended_at is not None:
                lat = time.monotonic() - utt.ended_at
                if self.live:
                    self.latencies.append(lat)
                    if self.on_final is not None:
                        self.on_final(lat)
            self.output.put(msg)
        elif self.params.interim:
            self.output.put({"type": "partial", "text": ev.text, "start_ms": ev.start_ms, "end_ms": ev.end_ms})

    def stats(self) -> dict[str, Any]:
        audio_s = self.samples_in / RATE
        lat = sorted(self.latencies)
        return {"audio_ms": round(audio_s * 1000, 3), "finals": self.finals,
                "rtf": round(self.compute_s / audio_s, 4) if audio_s > 0 else None,
                "final_latency_ms_p50": round(lat[len(lat) // 2] * 1000, 3) if lat else None}


class VadLane(Lane):
    name = "vad"
    worker = "generator"
    max_batch = 64

    def __init__(self, vad: "SileroVad", cfg: AsrConfig) -> None:
        super().__init__()
        self.vad = vad
        self.cfg = cfg

    def is_ready(self, job: Job) -> bool:
        assert isinstance(job, ASRJob)
        try:  # also read from the metrics endpoint's thread while the worker pops: no check-then-index
            head = job.inbox[0]
        except IndexError:
            return False
        if job.output.room() <= 8 or len(job.utts) > job.cfg.max_pending_utterances:
            return False
        return job.buf_len < len(job.buf) or head is _FINALIZE

    def run(self, jobs: list[Job]) -> None:
        t0 = time.perf_counter()
        batch: list[tuple[ASRJob, np.ndarray, bool]] = []
        for job in jobs:
            assert isinstance(job, ASRJob)
            audio, fin = job.take_inbox(min(len(job.buf) - job.buf_len, int(self.cfg.vad_step_s * RATE)))
            job.append(audio)
            batch.append((job, audio, fin))
        _, events = self.vad.feed_many([j.vad_state for j, _, _ in batch], [a for _, a, _ in batch])
        for (job, _, fin), evs in zip(batch, events, strict=True):
            if fin:
                evs = evs + self.vad.flush(job.vad_state)
            for ev in evs:
                self._event(job, ev)
            st = job.vad_state
            if job.preview_sent and st.triggered and not st.temp_end:
                job.preview_sent = False  # speech again: the previewed hypothesis is not the final
                job.output.put({"type": "speech_resumed"})
            with job.lock:
                job.trim()
                job.update_partial_due()
        dt = (time.perf_counter() - t0) / max(1, len(batch))
        for job, _, _ in batch:
            job.compute_s += dt
            job.maybe_finish()

    def _event(self, job: ASRJob, ev: "VadEvent") -> None:
        pad = self.cfg.speech_pad_ms * RATE // 1000
        with job.lock:
            if ev.kind == "start":
                if job.open_utt() is not None:
                    return
                start = max(job.buf_start, ev.sample - pad)
                pol = LocalAgreementPolicy(job.policy_cfg)
                pol.start(start * 1000 // RATE)
                job.utts.append(Utterance(start, pol))
                msg = {"type": "speech_started", "at_ms": start * 1000 // RATE}
            else:
                u = job.open_utt()
                if u is None:
                    return
                job.preview_sent = False
                end = min(job.buf_end, max(ev.sample + pad, u.start + 1))
                u.end = end
                u.ended_at = job.arrival_of(min(end, job.samples_in))
                msg = {"type": "speech_stopped", "at_ms": end * 1000 // RATE}
        job.output.put(msg)


@dataclass
class _Row:
    job: ASRJob
    utt: Utterance
    kind: str  # "partial" (may cut), "final" (decode then end) or "reuse" (end on the last partial)
    t: int  # end sample of the decoded audio
    audio: np.ndarray = field(repr=False)
    urgent: bool = True  # finals (and decodes at the onset of silence); plain partials are not
    early: bool = False  # the decode at the onset of silence of an open utterance


class DecodeLane(Lane):
    name = "asr.decode"
    worker = "generator"

    def __init__(self, whisper: "Whisper", cfg: AsrConfig) -> None:
        super().__init__()
        self.whisper = whisper
        self.cfg = cfg
        self.max_batch = cfg.max_batch
        self.cache = whisper.new_cache(cfg.max_batch)  # preallocated, reused by every step
        import torch

        self._audio = torch.zeros(cfg.max_batch, 30 * RATE)  # host staging, rows written per step
        # (start, end) monotonic times of the recent steps that decoded audio: how long a final
        # waited, counted in steps (the tests), not only in seconds of a shared CPU
        self.history: deque[tuple[float, float]] = deque(maxlen=256)

    def is_ready(self, job: Job) -> bool:
        assert isinstance(job, ASRJob)
        if job.output.room() <= 8:
            return False
        due = job.partial_due_at
        return job.final_due() or (due is not None and due <= time.monotonic())

    def run(self, jobs: list[Job]) -> None:
        import torch

        t0 = time.perf_counter()
        seg = self.cfg.segment_ms * RATE // 1000
        pad = self.cfg.speech_pad_ms * RATE // 1000
        rows: list[_Row] = []
        reuse: list[_Row] = []
        for job in jobs:
            assert isinstance(job, ASRJob)
            with job.lock:
                if not job.utts:
                    job.partial_due_at = None
                    continue
                # Every ended utterance of the stream that fits one decode goes into this batch
                # (a stream sent faster than real time has several); the open or a too-long one
                # only when it is at the head (its cut decodes are sequential).
                for k, u in enumerate(list(job.utts)):
                    if len(rows) >= self.max_batch or (k and u.end is None):
                        break
                    s = u.seg_start
                    if u.end is not None and u.policy.last_decode_ms * RATE // 1000 >= u.end - pad and \
                            u.policy.last_decode_ms > u.policy.segment_start_ms:
                        # The last partial already decoded all the speech (the VAD waits for
                        # silence after it): its hypothesis is the final, no second decode.
                        reuse.append(_Row(job, u, "reuse", u.end, np.zeros(0, np.float32)))
                    elif u.end is not None and u.end - s <= seg:
                        rows.append(_Row(job, u, "final", u.end, job.audio(s, u.end).copy()))
                    elif k == 0:
                        t = min(u.end if u.end is not None else job.buf_end, s + seg)
                        rows.append(_Row(job, u, "partial", t, job.audio(s, t).copy(),
                                         urgent=u.end is not None or job.early,
                                         early=u.end is None and job.early))
                        break
                    else:
                        break
        for r in reuse:
            self._apply(r, None)
            r.job.maybe_finish()
        if any(r.urgent for r in rows):
            # A step that carries finals is kept short: plain partials wait for the next step.
            rows = [r for r in rows if r.urgent]
        if not rows:
            return
        x = self._audio[: len(rows)]
        x.zero_()
        for i, r in enumerate(rows):
            x[i, : len(r.audio)] = torch.from_numpy(r.audio)
        w = self.whisper
        enc = w.encode(w.log_mel(x))
        longest = max(len(r.audio) for r in rows) / RATE
        max_tokens = int(min(224, 16 + 8 * longest))  # bounds a looping decode; speech is ~4 tokens/s
        texts: list[str] = [""] * len(rows)
        groups: dict[tuple[str | None, str], list[int]] = {}  # rows by (language, task)
        for i, r in enumerate(rows):
            p = r.job.params
            groups.setdefault((p.language, p.task) if w.is_multilingual else (None, "transcribe"), []).append(i)
        for (lang, task), idx in groups.items():
            prompts = [self._prompt(rows[i].job, rows[i].utt) for i in idx]
            sel = enc if len(idx) == len(rows) else enc[torch.tensor(idx, device=enc.device)]
            ids = w.decode_greedy(sel, language=lang, task=task, max_tokens=max_tokens,
                                  prompt_ids=prompts if any(prompts) else None, cache=self.cache)
            for i, row_ids in zip(idx, ids, strict=True):
                texts[i] = w.decode_text(row_ids).strip() if len(rows[i].audio) else ""
        step = time.perf_counter() - t0
        end = time.monotonic()
        self.history.append((end - step, end))
        log.debug("decode step: %s in %.3f s", [(r.job.id, r.kind, r.urgent, len(r.audio) // 16) for r in rows], step)
        dt = step / len(rows)
        gap_until = end + self.cfg.partial_gap * step
        for r, text in zip(rows, texts, strict=True):
            r.job.next_partial_at = gap_until
            self._apply(r, text.split())
            r.job.compute_s += dt
            r.job.maybe_finish()

    def _prompt(self, job: ASRJob, u: Utterance) -> list[int]:
        """The tokens before a decode's start: the start's ``prompt``, then (after a cut) the words
        already final in this utterance (decode_greedy keeps the last 223, as Whisper does)."""
        ctx = u.policy.context[-40:]
        text = " ".join(([job.params.prompt] if job.params.prompt else []) + ctx)
        if not text:
            return []
        return self.whisper.tokenizer.encode(" " + text, add_special_tokens=False).ids

    def _words(self, job: ASRJob, ev: AsrEvent) -> list[dict[str, Any]]:
        """A final's words with their times in the stream (ms): an alignment pass of its text
        over its audio [start_ms, end_ms), which the buffer still holds (it is trimmed after)."""
        from realtime.engines.whisper_align import word_timestamps

        w = self.whisper
        with job.lock:
            audio = job.audio(ev.start_ms * RATE // 1000, ev.end_ms * RATE // 1000).copy()
        ids = w.tokenizer.encode(" " + ev.text, add_special_tokens=False).ids
        found = word_timestamps(w, audio, ids, offset_s=ev.start_ms / 1000, last_speech_s=job.last_word_end,
                                language=job.params.language, cache=self.cache)
        if found:
            job.last_word_end = found[-1].end
        # (the alignment's times are whole 10 ms steps)
        return [{"word": x.word.strip(), "start_ms": round(x.start * 1000), "end_ms": round(x.end * 1000)}
                for x in found]

    def _apply(self, r: _Row, words: list[str] | None) -> None:
        job, u = r.job, r.utt
        job.early = False
        t_ms = r.t * 1000 // RATE
        if r.kind in ("final", "reuse"):
            events = u.policy.end(words, t_ms)  # words None: committed + the last partial's tail
        else:
            events = u.policy.on_hypothesis(words, t_ms)
        for ev in events:
            timed = None
            if job.words and ev.kind == "final":
                try:
                    timed = self._words(job, ev)
                except Exception as exc:  # an alignment bug fails this request, not the batch's other streams
                    log.exception("word timestamps failed")
                    job.fail(exc)
                    return
            job.emit(ev, u, r.kind != "partial", timed)
        if r.early and job.preview and u.policy.active:
            # what the final will say if the VAD now ends the utterance (a "reuse" final)
            job.preview_sent = True
            job.output.put({"type": "final_preview", "text": u.policy.hypothesis_text, "end_ms": t_ms})
        with job.lock:
            if r.kind != "partial":
                assert u in job.utts
                job.utts.remove(u)
            job.trim()
            job.partial_due_at = None
            job.update_partial_due()


def _languages(whisper: "Whisper") -> tuple[str, ...]:
    return tuple(sorted(whisper.tokens.languages)) if whisper.is_multilingual else ("en",)


class ASRService(Service):
    name = "asr"

    def __init__(self, config: ServerConfig, asr: AsrConfig | None = None) -> None:
        self.config = config
        self.cfg = asr or AsrConfig()
        self.whisper: Whisper | None = None
        self.vad: SileroVad | None = None
        self.vad_lane: VadLane | None = None
        self.decode_lane: DecodeLane | None = None
        self.languages: tuple[str, ...] = ("en",)

    # ---- lifecycle ----
    def load(self) -> None:
        import torch

        from realtime.engines.vad import SileroVad, VadConfig
        from realtime.engines.whisper import Whisper

        dtype = getattr(torch, self.config.dtype)
        self.whisper = Whisper.from_pretrained(self.config.asr_model, device=self.config.generator_device,
                                               dtype=dtype, cpu_native=not self.config.asr_exact)
        native = " (encoder and vocabulary products in bfloat16; --asr-exact: float32)"
        log.info("Whisper %s on %s%s", self.whisper.name, self.config.generator_device,
                 native if self.whisper.cpu_native else "")
        c = self.cfg
        self.vad = SileroVad(config=VadConfig(threshold=c.vad_threshold, min_silence_ms=c.min_silence_ms,
                                              speech_pad_ms=30), device=self.config.generator_device)
        self.languages = _languages(self.whisper)

    def attach(self, scheduler: Scheduler) -> None:
        assert self.whisper is not None and self.vad is not None, "load() first"
        self.vad_lane = scheduler.add_lane(VadLane(self.vad, self.cfg))
        self.decode_lane = scheduler.add_lane(DecodeLane(self.whisper, self.cfg))

    def warmup(self) -> None:
        import torch

        assert self.whisper is not None
        w = self.whisper
        cache = self.decode_lane.cache if self.decode_lane is not None else None
        w.decode_greedy(w.encode(w.log_mel(torch.zeros(1, RATE))), max_tokens=4, cache=cache)

    def describe(self) -> list[dict[str, Any]]:
        name = self.whisper.name if self.whisper is not None else (self.config.asr_model or "tiny.en")
        multilingual = self.whisper is not None and self.whisper.is_multilingual
        return [{"id": name, "object": "model", "kind": "asr", "sample_rate": RATE,
                 "languages": list(self.languages),
                 "tasks": ["transcribe", "translate"] if multilingual else ["transcribe"]}]

    # ---- jobs ----
    def new_job(self, params: ASRParams, live: bool = True, session: str = "",
                max_inbox_s: float | None = None) -> ASRJob:
        assert self.vad is not None
        return ASRJob(params, self.cfg, self.vad.new_state(), live=live, session=session, max_inbox_s=max_inbox_s)

    def submit(self, scheduler: Scheduler, job: ASRJob) -> None:
        assert self.vad_lane is not None and self.decode_lane is not None
        scheduler.submit(job, [self.vad_lane, self.decode_lane])

    # ---- routes ----
    def routes(self, state: Callable[[], "AppState"]) -> list:
        from starlette.routing import Route, WebSocketRoute

        from realtime.server import run_websocket

        async def asr_ws(ws) -> None:  # noqa: ANN001 - starlette WebSocket
            await run_websocket(state(), ws, lambda st, conn: ASRSession(st, conn, self).run())

        async def transcriptions(request) -> Any:  # noqa: ANN001 - starlette Request
            return await self._audio_file(state(), request, "transcribe")

        async def translations(request) -> Any:  # noqa: ANN001 - starlette Request
            return await self._audio_file(state(), request, "translate")

        return [WebSocketRoute("/v1/asr", asr_ws),
                Route("/v1/audio/transcriptions", transcriptions, methods=["POST"]),
                Route("/v1/audio/translations", translations, methods=["POST"])]

    async def _audio_file(self, st: "AppState", request: Any, task: str) -> Any:
        """OpenAI's /v1/audio/transcriptions (``task`` transcribe) and /v1/audio/translations
        (translate: English text, from a multilingual model; no word timestamps)."""
        from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse

        from realtime.server import authorized, http_error
        from realtime.errors import AuthError

        if not authorized(st.config, request.headers, request.query_params):
            return http_error(AuthError("missing or bad API key"), 401)
        limit = 32 << 20
        try:
            if int(request.headers.get("content-length") or 0) > limit:
                raise ProtocolError(f"upload over {limit} bytes", code="too_large")
            try:
                form = await request.form(max_files=1, max_fields=16)
            except Exception as exc:  # starlette raises its own error types for malformed bodies
                if isinstance(exc, RealtimeError):
                    raise
                raise ProtocolError("body must be multipart/form-data with a 'file' part",
                                    code="bad_request") from None
            upload = form.get("file")
            if upload is None or isinstance(upload, str):
                raise ProtocolError("multipart field 'file' (the audio) is required", code="missing_field")
            data = await upload.read()
            fmt = str(form.get("response_format") or "json")
            if fmt not in TRANSCRIPTION_FORMATS:
                raise UnsupportedError(f"response_format '{fmt[:20]}' is not supported; use "
                                       f"{', '.join(TRANSCRIPTION_FORMATS)}")
            grains = set(form.getlist("timestamp_granularities[]") + form.getlist("timestamp_granularities"))
            unknown = sorted(grains - {"segment", "word"})
            if unknown:
                raise UnsupportedError(f"timestamp granularity '{unknown[0][:20]}' is not supported; "
                                       "use segment or word")
            if "word" in grains and fmt != "verbose_json":
                raise UnsupportedError("word timestamps need response_format 'verbose_json' "
                                       f"(not '{fmt}'), as in OpenAI's API")
            if "word" in grains and task == "translate":
                raise UnsupportedError("translations have no word timestamps (the words are not the audio's)")
            stream = str(form.get("stream") or "false").lower()
            if stream not in ("true", "false"):
                raise ProtocolError("'stream' must be true or false", code="bad_field")
            if stream == "true" and (fmt not in ("json", "text") or grains):
                raise UnsupportedError("a streamed transcript is text: response_format json or text, "
                                       "no timestamp granularities")
            lang = form.get("language")
            params = parse_start({"type": "start", "language": lang or None, "task": task,
                                  "prompt": form.get("prompt") or None}, self.languages)
            audio = decode_audio_file(data, self.cfg.max_file_s)
        except RealtimeError as exc:
            return http_error(exc, 400)
        params = ASRParams(language=params.language, interim=False, words="word" in grains, task=task,
                           prompt=params.prompt)
        job = self.new_job(params, live=False, max_inbox_s=self.cfg.max_file_s + 1)
        wake = asyncio.Event()
        job.output.bind(asyncio.get_running_loop(), wake)
        job.push_audio(audio)
        job.stop()
        try:
            self.submit(st.scheduler, job)
        except RealtimeError as exc:
            return http_error(exc, 503)
        if stream == "true":
            return StreamingResponse(self._transcript_events(st, job), media_type="text/event-stream")
        finals = [f async for f in self._finals(st, job)]
        if job.state is JobState.FAILED:
            err = job.error if isinstance(job.error, RealtimeError) else InternalError("transcription failed")
            return http_error(err, 500 if isinstance(err, InternalError) else 400)
        text = " ".join(f["text"] for f in finals)
        if fmt == "text":
            return PlainTextResponse(text + "\n")
        if fmt == "json":
            return JSONResponse({"text": text})
        if fmt in ("srt", "vtt"):
            return PlainTextResponse(subtitles(finals, fmt), media_type="text/vtt" if fmt == "vtt" else "text/plain")
        # (language: the text's: the one asked for, else en; a translation's is en)
        lang_out = (params.language or "en") if task == "transcribe" else "en"
        body: dict[str, Any] = {"task": task, "language": lang_out, "duration": round(len(audio) / RATE, 3),
                                "text": text}
        # As OpenAI: segments unless only words are asked for, words when they are.
        if grains != {"word"}:
            body["segments"] = [{"id": i, "start": f["start_ms"] / 1000, "end": f["end_ms"] / 1000, "text": f["text"]}
                                for i, f in enumerate(finals)]
        if "word" in grains:
            body["words"] = [{"word": x["word"], "start": x["start_ms"] / 1000, "end": x["end_ms"] / 1000}
                             for f in finals for x in f["words"]]
        return JSONResponse(body)


    @staticmethod
    async def _finals(st: "AppState", job: ASRJob) -> AsyncIterator[dict[str, Any]]:
        """A file job's finals as they come, until it ends; a consumer that stops early (a client
        gone) cancels the job."""
        try:
            while True:
                items = await job.output.drain(st.scheduler.wake)
                ended = not job.active
                if ended:  # (it ended after that take: all it put before, END included, is there now)
                    items += job.output.take()
                for item in items:
                    if isinstance(item, dict) and item["type"] == "final":
                        yield item
                if ended or any(i is END for i in items):
                    return
        finally:
            if job.active:
                st.scheduler.cancel(job)

    async def _transcript_events(self, st: "AppState", job: ASRJob) -> AsyncIterator[bytes]:
        """``stream=true``: OpenAI's streamed transcript as server-sent events, a
        ``transcript.text.delta`` a final (as each utterance ends), then ``transcript.text.done``
        with the whole text, or an ``error`` event where the job failed."""
        from realtime.protocol.text import sse

        texts: list[str] = []
        async for f in self._finals(st, job):
            yield sse({"type": "transcript.text.delta", "delta": (" " if texts else "") + f["text"]})
            texts.append(f["text"])
        if job.state is JobState.FAILED:
            err = job.error if isinstance(job.error, RealtimeError) else InternalError("transcription failed")
            kind = "server_error" if isinstance(err, InternalError) else "invalid_request_error"
            yield sse({"type": "error", "error": {"message": err.message, "type": kind, "code": err.code}})
            return
        yield sse({"type": "transcript.text.done", "text": " ".join(texts)})


TRANSCRIPTION_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")


def subtitles(finals: list[dict[str, Any]], fmt: str) -> str:
    """The final segments as SubRip (``srt``: numbered cues, ``00:00:01,500``) or WebVTT (``vtt``:
    a ``WEBVTT`` header, ``00:00:01.500``)."""

    def stamp(ms: int) -> str:
        h, rest = divmod(max(int(ms), 0), 3_600_000)
        m, rest = divmod(rest, 60_000)
        sec, milli = divmod(rest, 1000)
        return f"{h:02d}:{m:02d}:{sec:02d}{',' if fmt == 'srt' else '.'}{milli:03d}"

    cues = []
    for i, f in enumerate(finals, 1):
        timing = f"{stamp(f['start_ms'])} --> {stamp(f['end_ms'])}"
        cues.append(f"{i}\n{timing}\n{f['text'].strip()}\n" if fmt == "srt" else f"{timing}\n{f['text'].strip()}\n")
    return ("" if fmt == "srt" else "WEBVTT\n\n") + "\n".join(cues)


def decode_audio_file(data: bytes, max_s: float) -> np.ndarray:
    """WAV/FLAC/OGG/MP3 bytes (what libsndfile reads) -> mono float32 at 16 kHz."""
    import soundfile as sf

    try:
        x, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception:  # soundfile raises LibsndfileError/RuntimeError/TypeError on garbage
        raise UnsupportedError("cannot decode the audio file; send WAV, FLAC, OGG (Vorbis/Opus) or MP3") from None
    if len(x) > max_s * rate:
        raise ProtocolError(f"audio longer than {max_s:.0f} s", code="too_long")
    mono = x.mean(axis=1).astype(np.float32)
    return mono if rate == RATE else resample(mono, int(rate), RATE)


class ASRSession(StreamSession):
    """One /v1/asr connection: frames in, protocol events, job queues, results out."""

    kind = "asr"

    def __init__(self, app: "AppState", conn: "Connection", service: ASRService) -> None:
        self.app = app
        self.conn = conn
        self.svc = service
        self.proto = ASRProtocol(service.languages)
        self.job: ASRJob | None = None
        self.resampler: StreamResampler | None = None
        self.id = uuid.uuid4().hex[:16]
        self.sender: asyncio.Task[None] | None = None

    async def _receive_loop(self) -> None:
        while True:
            msg = await self.conn.recv()
            if msg is None or self.conn.closed:
                return
            event = self.proto.receive(msg)
            if isinstance(event, Start):
                await self._start(event.params)
                continue
            job = self.job
            assert job is not None and self.resampler is not None
            if isinstance(event, Audio):
                try:
                    x = unpack_pcm(event.data, job.params.format)
                except ValueError as exc:
                    raise ProtocolError(str(exc), code="bad_audio") from None
                # Back-pressure: stop reading the socket while the VAD has max_inbox_s waiting.
                while job.inbox_full() and job.active:
                    await asyncio.sleep(0.01)
                job.push_audio(self.resampler.process(x))
            elif isinstance(event, Finalize):
                job.push_finalize()
            elif isinstance(event, Stop):
                job.push_audio(self.resampler.flush())
                job.stop()
            self.app.scheduler.wake()
            if self.sender is not None and self.sender.done():
                return

    async def _start(self, params: ASRParams) -> None:
        job = self.svc.new_job(params, live=True, session=self.id)
        job.on_final = self.app.metrics.asr_final.observe
        self.wake = asyncio.Event()
        job.output.bind(asyncio.get_running_loop(), self.wake)
        self.resampler = StreamResampler(params.sample_rate, RATE)
        self.svc.submit(self.app.scheduler, job)
        self.job = job
        self.app.metrics.streams.inc()
        name = self.svc.whisper.name if self.svc.whisper is not None else "whisper"
        await self.conn.send({"type": "ready", "session": self.id, "sample_rate": params.sample_rate,
                              "format": params.format, "model": name})
        self.sender = asyncio.create_task(self._send_loop(), name=f"asr-send-{self.id}")

    async def _send_loop(self) -> None:
        job = self.job
        assert job is not None
        while True:
            items = await job.output.drain(self.app.scheduler.wake)  # room in the channel: lanes go on
            for item in items:
                if item is END:
                    self.proto.finished()
                    await self.conn.send(m.done(job.stats()))
                    await self.conn.close(1000, "done")
                    return
                await self.conn.send(item)
                if self.conn.closed:
                    return
            if await self._job_over("recognition failed"):
                return


# ---------------------------------------------------------------------------------------------
# CLI: realtime transcribe FILE [--url URL | --local] [--language]


def add_cli(subparsers: Any) -> None:
    p = subparsers.add_parser("transcribe", help="transcribe an audio file (WAV, FLAC, OGG, MP3)")
    p.add_argument("file")
    p.add_argument("--format", default="text", choices=("text", "srt", "vtt", "words"),
                   help="text: a line a segment; srt / vtt: subtitles (with --local, one cue for the whole file); "
                   "words: a line a word, 'start<TAB>end<TAB>word' in seconds (with --local: files up to 30 s)")
    p.add_argument("--url", default="ws://127.0.0.1:8000/v1/asr", help="the server's /v1/asr WebSocket")
    p.add_argument("--local", action="store_true", help="recognise in this process (no server)")
    p.add_argument("--model", default=None, help="with --local: a Whisper folder (default: embedded tiny.en)")
    p.add_argument("--language", default=None)
    p.add_argument("--prompt", default=None, help="text before the speech (names, spellings, a style)")
    p.add_argument("--translate", action="store_true", help="English text from speech in another language "
                   "(a multilingual model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--device", default="cpu", help="with --local: cpu, cuda:0")
    p.add_argument("--exact", action="store_true", help="with --local on a CPU: float32 throughout (else bf16 "
                   "encoder products where the CPU has them)")
    p.set_defaults(fn=_transcribe_cli)


def _transcribe_cli(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    try:
        with open(args.file, "rb") as f:
            audio = decode_audio_file(f.read(), 3600.0)
    except (OSError, RealtimeError) as exc:
        print(f"realtime transcribe: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 2
    if args.local:
        from realtime.engines.whisper import Whisper

        if args.format == "words" and len(audio) > 30 * RATE:
            print("realtime transcribe: --local --format words takes files up to 30 s (a server takes any)",
                  file=sys.stderr)
            return 2
        w = Whisper.from_pretrained(args.model, device=args.device, cpu_native=not args.exact)
        if args.translate and not w.is_multilingual:
            print("realtime transcribe: --translate needs a multilingual model (--model DIR); tiny.en is English-only",
                  file=sys.stderr)
            return 2
        text = w.transcribe(audio, language=args.language, prompt=args.prompt,
                            task="translate" if args.translate else "transcribe")
        if args.format == "text":
            print(text)
        elif args.format == "words":
            from realtime.engines.whisper_align import word_timestamps

            ids = w.tokenizer.encode(" " + text, add_special_tokens=False).ids
            for x in word_timestamps(w, audio, ids, language=args.language):
                print(f"{x.start:.2f}\t{x.end:.2f}\t{x.word.strip()}")
        else:
            print(subtitles([{"start_ms": 0, "end_ms": len(audio) * 1000 // RATE, "text": text}], args.format), end="")
        return 0
    try:
        finals, stats = asyncio.run(stream_file(args.url, audio, language=args.language,
                                                api_key=args.api_key or os.environ.get("REALTIME_API_KEY"),
                                                words=args.format == "words", prompt=args.prompt,
                                                task="translate" if args.translate else None))
    except (OSError, RuntimeError) as exc:
        print(f"realtime transcribe: {exc}", file=sys.stderr)
        return 1
    if args.format == "text":
        for f in finals:
            print(f["text"])
    elif args.format == "words":
        for x in (x for f in finals for x in f["words"]):
            print(f"{x['start_ms'] / 1000:.2f}\t{x['end_ms'] / 1000:.2f}\t{x['word']}")
    else:
        print(subtitles(finals, args.format), end="")
    print(f"{len(audio) / RATE:.2f} s of audio in {time.perf_counter() - t0:.2f} s, "
          f"server rtf {stats.get('rtf')}", file=sys.stderr)
    return 0


async def stream_file(url: str, audio: np.ndarray, language: str | None = None, api_key: str | None = None,
                      chunk_s: float = 0.5, pace: float | None = None, words: bool = False,
                      prompt: str | None = None, task: str | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Stream 16 kHz float audio to /v1/asr (as fast as the server reads, or at ``pace`` x real time)
    and return the finals and the done stats (``words``: the finals carry their words' times;
    ``prompt``, ``task``: the start's). Raises RuntimeError on a server error."""
    import msgpack
    import websockets

    from realtime.codecs.resample import pack_pcm

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with websockets.connect(url, additional_headers=headers, max_size=1 << 22) as ws:
        asked = {"language": language, "words": words, "prompt": prompt, "task": task}
        start = {"type": "start", "sample_rate": RATE, "format": "pcm_s16le", "interim": False,
                 **{k: v for k, v in asked.items() if v}}
        await ws.send(msgpack.packb(start))
        ready = msgpack.unpackb(await ws.recv())
        if ready.get("type") != "ready":
            raise RuntimeError(f"server: {ready.get('message', ready)}")

        async def send() -> None:
            n = int(chunk_s * RATE)
            t0 = time.monotonic()
            for i in range(0, len(audio), n):
                await ws.send(msgpack.packb({"type": "audio", "audio": pack_pcm(audio[i:i + n], "pcm_s16le")}))
                if pace:
                    await asyncio.sleep(max(0.0, t0 + (i + n) / RATE / pace - time.monotonic()))
            await ws.send(msgpack.packb({"type": "stop"}))

        sender = asyncio.create_task(send())
        finals: list[dict[str, Any]] = []
        stats: dict[str, Any] = {}
        try:
            async for frame in ws:
                msg = msgpack.unpackb(frame) if isinstance(frame, bytes) else json.loads(frame)
                if msg["type"] == "final":
                    finals.append(msg)
                elif msg["type"] == "done":
                    stats = msg["stats"]
                elif msg["type"] == "error":
                    raise RuntimeError(f"server: {msg['code']}: {msg['message']}")
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
    return finals, stats
