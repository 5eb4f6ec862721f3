"""A TTS job's output path without a server: the batched emission (one decoder step for many
streams) gives the same chunks, bytes and order as the per-stream path, and wakes each sender once
per step with one cross-thread call per event loop."""

from __future__ import annotations

import numpy as np
import pytest

from realtime.protocol.tts import StartParams
from realtime.tts import AudioChunk, TTSJob, emit_pcm_rows

NATIVE = 24000
FRAME = 1920  # one Mimi frame: 80 ms at 24 kHz


class Loop:
    """Stands in for the asyncio loop: counts cross-thread calls, runs them on demand."""

    def __init__(self) -> None:
        self.calls: list = []

    def call_soon_threadsafe(self, fn) -> None:  # noqa: ANN001
        self.calls.append(fn)

    def run(self) -> None:
        calls, self.calls = self.calls, []
        for fn in calls:
            fn()


class Event:
    def __init__(self) -> None:
        self.sets = 0

    def set(self) -> None:
        self.sets += 1


def _job(fmt: str, rate: int, chunk_ms: int) -> TTSJob:
    params = StartParams(voice=None, format=fmt, sample_rate=rate, chunk_ms=chunk_ms)  # type: ignore[arg-type]
    return TTSJob(params, NATIVE, max(1, rate * chunk_ms // 1000))


def _chunks(job: TTSJob) -> list[tuple[int, bytes, float, float]]:
    return [(c.seq, c.data, c.start_ms, c.duration_ms) for c in job.output.take() if isinstance(c, AudioChunk)]


# (format, rate, chunk_ms): one chunk per frame, several per frame, chunks across frames (carry), resampled
STREAMS = [("pcm_s16le", 24000, 80), ("pcm_f32le", 24000, 80), ("mulaw", 8000, 20), ("alaw", 8000, 80),
           ("pcm_s16le", 16000, 30), ("pcm_s16le", 24000, 50), ("mulaw", 24000, 30), ("pcm_f32le", 48000, 70),
           ("pcm_s16le", 22050, 40)]


def test_batched_emission_equals_per_stream_emission() -> None:
    rng = np.random.default_rng(0)
    frames = [rng.uniform(-1.2, 1.2, (len(STREAMS), FRAME)).astype(np.float32) for _ in range(5)]
    solo = [_job(*s) for s in STREAMS]
    batch = [_job(*s) for s in STREAMS]
    reused = np.empty_like(frames[0])  # like the pinned host buffer the CUDA codec reuses every step
    for pcm in frames:
        for job, row in zip(solo, pcm, strict=True):
            job.emit_pcm(row.copy(), frames=1)
        reused[:] = pcm
        emit_pcm_rows(batch, reused, frames=1)
        reused[:] = np.nan  # nothing may keep a view of it past the call
    for s, b in zip(solo, batch, strict=True):
        s.finish_spurt()
        b.finish_spurt()  # the carry and the resampler's tail: the short last chunk
        assert s.frames == b.frames == len(frames)
        got, want = _chunks(b), _chunks(s)
        assert got == want and len(got) > 0
        assert (b.seq, b.out_samples, b.play_end is not None) == (s.seq, s.out_samples, True)


def test_batched_emission_wakes_each_loop_once() -> None:
    jobs = [_job("pcm_s16le", 24000, 20) for _ in range(6)]  # 4 chunks a frame each
    loops, events = [Loop(), Loop()], [Event() for _ in jobs]
    for i, (job, ev) in enumerate(zip(jobs, events, strict=True)):
        job.output.bind(loops[i % 2], ev)
    emit_pcm_rows(jobs, np.zeros((6, FRAME), dtype=np.float32))
    assert [len(lp.calls) for lp in loops] == [1, 1]  # 24 chunks, 6 senders, 2 loops: 2 calls
    emit_pcm_rows(jobs, np.zeros((6, FRAME), dtype=np.float32))
    assert [len(lp.calls) for lp in loops] == [1, 1]  # a wake-up is on its way: nothing more to send
    for lp in loops:
        lp.run()
    assert [ev.sets for ev in events] == [1] * 6
    emit_pcm_rows(jobs, np.zeros((6, FRAME), dtype=np.float32))
    assert [len(lp.calls) for lp in loops] == [1, 1]


def test_rows_must_match_jobs() -> None:
    with pytest.raises(AssertionError):
        emit_pcm_rows([_job("pcm_s16le", 24000, 80)], np.zeros((2, FRAME), dtype=np.float32))
