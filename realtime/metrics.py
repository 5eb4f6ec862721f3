"""Prometheus text-format metrics, without a client library: counters, gauges and histograms."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Sequence


class Histogram:
    def __init__(self, name: str, help: str, buckets: Sequence[float]) -> None:
        self.name, self.help = name, help
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self.lock:
            self.sum += value
            for i, b in enumerate(self.buckets):
                if value <= b:
                    self.counts[i] += 1
                    break
            else:
                self.counts[-1] += 1

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        with self.lock:
            acc = 0
            for b, c in zip(self.buckets, self.counts, strict=False):
                acc += c
                out.append(f'{self.name}_bucket{{le="{b:g}"}} {acc}')
            acc += self.counts[-1]
            out.append(f'{self.name}_bucket{{le="+Inf"}} {acc}')
            out.append(f"{self.name}_sum {self.sum:.6f}")
            out.append(f"{self.name}_count {acc}")
        return out


class Counter:
    def __init__(self, name: str, help: str) -> None:
        self.name, self.help = name, help
        self.value = 0.0
        self.lock = threading.Lock()

    def inc(self, v: float = 1.0) -> None:
        with self.lock:
            self.value += v

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter", f"{self.name} {self.value:g}"]


class Gauge:
    """A gauge read at scrape time from a callback returning {labels: value}."""

    def __init__(self, name: str, help: str, read: Callable[[], dict[str, float]]) -> None:
        self.name, self.help, self.read = name, help, read

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge"]
        for labels, v in self.read().items():
            out.append(f"{self.name}{labels} {v:g}")
        return out


class GCPauses:
    """This process's garbage-collection pauses (via ``gc.callbacks``) into a histogram. A collection
    holds the GIL: every stream's thread waits for it, so a long one shows up as a gap in all of them."""

    def __init__(self, hist: Histogram) -> None:
        self.hist = hist
        self.max_s = 0.0  # the longest pause (since ``start_window``)
        self._t0: float | None = None
        self._window_from = 0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            dt = time.perf_counter() - self._t0
            self._t0 = None
            self.hist.observe(dt)
            self.max_s = max(self.max_s, dt)

    def start_window(self) -> None:
        """Begin a measurement window (see ``window``)."""
        self._window_from = sum(self.hist.counts)
        self.max_s = 0.0

    def window(self) -> dict:
        """Collections and the longest pause since ``start_window`` (what a benchmark level reports)."""
        return {"gc_collections": sum(self.hist.counts) - self._window_from, "gc_max_pause_ms": self.max_s * 1e3}

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


class Metrics:
    """The service's metrics. One instance per app."""

    def __init__(self) -> None:
        ms = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
        self.ttfa = Histogram("realtime_tts_ttfa_seconds", "Time from first text to first audio chunk sent", ms)
        self.rtf = Histogram("realtime_tts_rtf", "Compute time per second of audio, per stream",
                             (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0))
        self.underruns = Counter("realtime_tts_underruns_total", "Playback gaps seen by the simulated player")
        self.underrun_s = Counter("realtime_tts_underrun_seconds_total", "Total length of playback gaps")
        self.streams = Counter("realtime_streams_total", "Streams started")
        self.errors = Counter("realtime_errors_total", "Streams ended with an error sent to the client")
        self.audio_s = Counter("realtime_tts_audio_seconds_total", "Seconds of audio sent")
        self.asr_final = Histogram("realtime_asr_final_latency_seconds",
                                   "End of speech to final transcript", ms)
        self.text_ttft = Histogram("realtime_text_ttft_seconds", "Prompt to first token", ms)
        self.gc_pause = Histogram("realtime_gc_pause_seconds", "Garbage-collection pauses of the server process",
                                  (0.0005, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2))
        self.gc = GCPauses(self.gc_pause)
        self.gauges: list[Gauge] = []

    def render(self) -> str:
        lines: list[str] = []
        for m in (self.ttfa, self.rtf, self.underruns, self.underrun_s, self.streams, self.errors,
                  self.audio_s, self.asr_final, self.text_ttft, self.gc_pause, *self.gauges):
            lines.extend(m.render())
        return "\n".join(lines) + "\n"
