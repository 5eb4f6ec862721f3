"""In-process synthesis (``realtime say --local``): the same backend and scheduler, no network."""

from __future__ import annotations

import threading

import numpy as np

from realtime.codecs.resample import unpack_pcm
from realtime.config import ServerConfig
from realtime.protocol.tts import StartParams
from realtime.scheduler import JobState, Scheduler
from realtime.tts import END, SPURT_END, AudioChunk, TTSBackend


def synthesize_local(text: str, backend: TTSBackend, sample_rate: int | None = None,
                     config: ServerConfig | None = None, timeout: float = 600.0, **params: object) -> np.ndarray:
    cfg = config or ServerConfig()
    scheduler = Scheduler({"generator": cfg.generator_device, "codec": cfg.codec_device})
    rate = sample_rate or backend.native_rate
    start = StartParams(voice=None, format="pcm_f32le", sample_rate=rate, chunk_ms=None, **params)  # type: ignore[arg-type]
    job = backend.new_job(start)
    done = threading.Event()

    class _Signal:
        def set(self) -> None:
            done.set()

    class _Loop:
        def call_soon_threadsafe(self, fn: object) -> None:
            fn()  # type: ignore[operator]

    job.output.bind(_Loop(), _Signal())
    backend.submit(scheduler, job)
    scheduler.start()
    parts: list[np.ndarray] = []
    try:
        job.push_text(text)
        job.stop()
        scheduler.wake()
        while True:
            if not done.wait(timeout):
                raise TimeoutError("synthesis timed out")
            done.clear()
            items = job.output.take()
            scheduler.wake()
            for item in items:
                if item is END:
                    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)
                if item is SPURT_END:
                    continue
                assert isinstance(item, AudioChunk)
                parts.append(unpack_pcm(item.data, "pcm_f32le"))
            if job.state is JobState.FAILED:
                raise RuntimeError("synthesis failed") from job.error
    finally:
        scheduler.stop()
