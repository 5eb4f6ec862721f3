"""The one scheduler: jobs from every session, lanes of engine steps, device workers.

Vocabulary (docs/architecture.md has the picture):

- A **Job** is one request in flight (a TTS stream, an ASR stream, a chat completion, an image).
  It has a state and a ``deadline()``: the monotonic time by which it needs its next output. For
  speech that is the moment the client's player runs dry; for a job that has produced nothing yet
  it is its arrival time (so first audio is served first); for background work it is far out.
- A **Lane** is one kind of step an engine offers, bound to a worker: "piper.generate",
  "piper.vocode", "csm.frame", "mimi.decode", "whisper.decode", "llama.decode", "dit.step". A lane
  knows which of its jobs are ready and runs one batched step for a list of them.
- A **Worker** owns one device stream (a thread; on CUDA also a torch stream). Each turn it asks
  the policy for the most urgent (lane, batch) among its lanes and runs it. Two workers connected
  by a job's bounded frame buffer make a pipeline: the codec of frame n overlaps the generator of
  frame n+1.

``pick`` is pure Python and unit-tested without threads or tensors.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from realtime.errors import RealtimeError

log = logging.getLogger("realtime.scheduler")

BACKGROUND_SLACK_S = 1.0  # background work (image steps) yields to any job due sooner than this
# A speculative job (the voice agent's reply started before the turn has surely ended) yields to any
# job due sooner than this: it runs in the gaps and never delays real work (the VAD that will end
# the turn, other callers' speech).
SPECULATIVE_SLACK_S = 0.25
# A worker with nothing ready looks again after this long even if nobody woke it: work that becomes
# ready by the clock alone (speech held MAX_AHEAD_S ahead of its player) resumes on this tick, so
# many streams refill in one batch instead of one step per stream; it also covers a lost wake-up.
IDLE_RECHECK_S = 0.05


class JobState(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


class Priority(int, Enum):
    REALTIME = 0  # speech in/out: has a playback deadline
    INTERACTIVE = 1  # text decode: someone is waiting for tokens
    BACKGROUND = 2  # image/video steps: fill the gaps


_ids = itertools.count(1)


class Job:
    """Base class of a request in flight. Subclasses add their queues and per-slot state."""

    priority: Priority = Priority.REALTIME

    def __init__(self, now: float | None = None) -> None:
        self.id = next(_ids)
        self.state = JobState.QUEUED
        self.created = time.monotonic() if now is None else now
        self.lock = threading.Lock()  # guards the subclass's queues between the loop and workers
        self.error: BaseException | None = None
        self.speculative = False  # see SPECULATIVE_SLACK_S; cleared when the work is wanted after all

    @property
    def active(self) -> bool:
        state = self.state  # asked for every job on every pick: no tuple, two identity checks
        return state is JobState.RUNNING or state is JobState.QUEUED

    def deadline(self, now: float) -> float:
        """Monotonic seconds by which this job needs its next step (smaller = more urgent)."""
        if self.priority is Priority.BACKGROUND:
            return now + BACKGROUND_SLACK_S
        return self.created

    def cancel(self) -> None:
        if self.active:
            self.state = JobState.CANCELLED
            self.notify()

    def fail(self, exc: BaseException) -> None:
        if self.active:
            self.error = exc
            self.state = JobState.FAILED
            self.notify()

    def notify(self) -> None:
        """Wake whoever consumes this job's output (the job ended). Subclasses override."""


class Lane(ABC):
    """One batched step kind of one engine, run by one worker."""

    name: str = "lane"
    worker: str = "generator"  # which worker (device stream) runs it
    max_batch: int = 1

    def __init__(self) -> None:
        self.jobs: set[Job] = set()
        self.steps = 0
        self.busy_s = 0.0
        self.scheduler: Scheduler | None = None  # set by Scheduler.add_lane

    def wake(self, worker: str | None = None) -> None:
        """Tell ``worker`` (every worker when None) that this lane's step made work for it, e.g. the
        generator lane after a step: the codec worker decodes the new frames now, not on its next
        idle recheck."""
        if self.scheduler is not None:
            self.scheduler.wake(worker)

    def add(self, job: Job) -> None:
        self.jobs.add(job)

    def discard(self, job: Job) -> None:
        self.jobs.discard(job)

    @abstractmethod
    def is_ready(self, job: Job) -> bool:
        """Does ``job`` have work for this lane now? Called under no lock; must be cheap."""

    @abstractmethod
    def run(self, jobs: list[Job]) -> None:
        """One step for ``jobs`` (1..max_batch, most urgent first). Runs in the worker thread."""

    def release(self, job: Job) -> None:
        """Free what the job held in this lane (return its cache slot to the free list).

        Called once per job, from whichever thread reaps it: bookkeeping only, no tensor work
        (a slot's tensors are reset when the next job takes it, in the lane's own worker).
        """

    def ready_jobs(self) -> list[Job]:
        return [j for j in list(self.jobs) if j.active and self.is_ready(j)]


@dataclass
class Choice:
    lane: Lane
    jobs: list[Job]


def due(job: Job, now: float) -> float:
    """The deadline ``pick`` ranks ``job`` by: its own, later for a speculative job."""
    d = job.deadline(now)
    return max(d, now + SPECULATIVE_SLACK_S) if job.speculative else d


def pick(lanes: Sequence[Lane], now: float) -> Choice | None:
    """Earliest-deadline-first over lanes: the lane holding the most urgent ready job wins, and runs
    a batch of its ready jobs, most urgent first, up to its max batch."""
    best: tuple[float, int, Lane, list[Job]] | None = None
    for order, lane in enumerate(lanes):
        try:
            ready = lane.ready_jobs()
            if not ready:
                continue
            ready.sort(key=lambda j: (due(j, now), j.id))
            key = (due(ready[0], now), order)
        except Exception as exc:  # a lane bug in is_ready/deadline fails that lane's jobs, not the worker
            log.exception("lane %s failed while picking", lane.name)
            for job in list(lane.jobs):
                job.fail(exc)
            continue
        if best is None or key < best[:2]:
            best = (key[0], key[1], lane, ready)
    if best is None:
        return None
    _, _, lane, ready = best
    return Choice(lane, ready[: lane.max_batch])


@dataclass
class WorkerStats:
    steps: int = 0
    busy_s: float = 0.0
    last_step_s: float = 0.0
    errors: int = 0


class Worker:
    """A thread that owns one device stream and runs the lanes bound to it."""

    def __init__(self, name: str, device: str, on_step: Callable[[], None] | None = None) -> None:
        self.name = name
        self.device = device
        self.lanes: list[Lane] = []
        self.cond = threading.Condition()
        self.stopping = False
        self.thread: threading.Thread | None = None
        self.stats = WorkerStats()
        self.on_step = on_step
        self.stream = None  # torch.cuda.Stream on CUDA, set in start()
        self._pending = False

    def start(self) -> None:
        if self.device.startswith("cuda"):
            import torch

            self.stream = torch.cuda.Stream(device=self.device)
        self.thread = threading.Thread(target=self._loop, name=f"worker-{self.name}", daemon=True)
        self.thread.start()

    def wake(self) -> None:
        with self.cond:
            self._pending = True
            self.cond.notify()

    def stop(self, timeout: float = 5.0) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join(timeout)

    def _loop(self) -> None:
        if self.stream is not None:
            import torch

            dev = torch.device(self.device)
            if dev.index is not None:  # a bare "cuda" means the current device (set_device refuses it)
                torch.cuda.set_device(dev)
            ctx = torch.cuda.stream(self.stream)
            ctx.__enter__()
        while True:
            if self.on_step is not None:
                self.on_step()  # reap ended jobs first: a disconnected client frees its slot now
            with self.cond:
                if self.stopping:
                    return
                choice = pick(self.lanes, time.monotonic())
                if choice is None:
                    self._pending = False
                    # Sleep until woken (new work) or until clock-paced work may be ready.
                    self.cond.wait_for(lambda: self._pending or self.stopping, timeout=IDLE_RECHECK_S)
                    continue
            self._run(choice)
            # Let the other threads have the GIL between steps: a worker with back-to-back steps
            # would otherwise hold it for up to the switch interval (5 ms) while the codec or the
            # event loop waits to deliver a first chunk (host TTFA p50 4.5 -> 2 ms, p95 8.5 -> 3.5).
            time.sleep(0)

    def _run(self, choice: Choice) -> None:
        t0 = time.perf_counter()
        for job in choice.jobs:
            if job.state is JobState.QUEUED:
                job.state = JobState.RUNNING
        try:
            choice.lane.run(choice.jobs)
        except RealtimeError as exc:  # bad input discovered by the engine (a prompt too long)
            for job in choice.jobs:
                job.fail(exc)
        except Exception as exc:  # an engine bug fails the jobs in this batch, not the server
            log.exception("lane %s failed on %d job(s)", choice.lane.name, len(choice.jobs))
            self.stats.errors += 1
            for job in choice.jobs:
                job.fail(exc)
        dt = time.perf_counter() - t0
        self.stats.steps += 1
        self.stats.busy_s += dt
        self.stats.last_step_s = dt
        choice.lane.steps += 1
        choice.lane.busy_s += dt


class Scheduler:
    """Owns the workers, the lanes and every job in flight. Thread-safe entry points for sessions."""

    def __init__(self, devices: dict[str, str] | None = None, max_jobs: int = 256) -> None:
        # worker name → device; the TTS pipeline uses "generator" and "codec"
        self.devices = devices or {"generator": "cpu", "codec": "cpu"}
        self.max_jobs = max_jobs
        self.workers = {name: Worker(name, dev, on_step=self._reap) for name, dev in self.devices.items()}
        self.jobs: dict[int, tuple[Job, tuple[Lane, ...]]] = {}
        self.lock = threading.Lock()
        self.started = False
        self.on_finished: list[Callable[[Job], None]] = []

    def add_lane(self, lane: Lane) -> Lane:
        if lane.worker not in self.workers:
            raise KeyError(f"lane {lane.name} wants worker {lane.worker!r}; have {list(self.workers)}")
        self.workers[lane.worker].lanes.append(lane)
        lane.scheduler = self
        return lane

    def lanes(self) -> Iterable[Lane]:
        for w in self.workers.values():
            yield from w.lanes

    def start(self) -> None:
        if not self.started:
            cpu_workers = sum(w.device == "cpu" for w in self.workers.values())
            if cpu_workers > 1:
                # Each worker thread runs torch ops; with every op using all cores, two workers
                # oversubscribe the CPU and both slow down. Split the cores between them.
                import os

                import torch

                torch.set_num_threads(max(1, (os.cpu_count() or 1) // cpu_workers))
            for w in self.workers.values():
                w.start()
            self.started = True

    def stop(self) -> None:
        for w in self.workers.values():
            w.stop()
        self.started = False

    @property
    def active(self) -> int:
        return len(self.jobs)

    def submit(self, job: Job, lanes: Sequence[Lane]) -> Job:
        """Register ``job`` with the lanes it will pass through. Raises when the server is full."""
        from realtime.errors import OverloadedError

        with self.lock:
            if len(self.jobs) >= self.max_jobs:
                raise OverloadedError("the server is at capacity; try again shortly")
            self.jobs[job.id] = (job, tuple(lanes))
            for lane in lanes:
                lane.add(job)
        self.wake()
        return job

    def wake(self, worker: str | None = None) -> None:
        """Something changed (text arrived, a buffer drained): let the workers (or just the one
        named ``worker``) look again."""
        if worker is not None:
            self.workers[worker].wake()
            return
        for w in self.workers.values():
            w.wake()

    def cancel(self, job: Job) -> None:
        """Stop a job at once; its lanes drop it before their next step."""
        job.cancel()
        self.wake()

    def reap(self, job: Job) -> None:
        """Drop ``job`` now if it has ended (its lanes release its slot): a session calls this before
        it tells its client the stream is done, so a client that reconnects at once finds the slot
        free. Any thread."""
        with self.lock:
            entry = self.jobs.pop(job.id, None) if not job.active else None
        if entry is not None:
            self._retire([entry])

    def _reap(self) -> None:
        """Drop finished/cancelled/failed jobs from their lanes (after every step)."""
        with self.lock:
            done = [(j, lanes) for j, lanes in self.jobs.values() if not j.active]
            for job, lanes in done:
                del self.jobs[job.id]
        self._retire(done)

    def _retire(self, done: list[tuple[Job, tuple[Lane, ...]]]) -> None:
        for job, lanes in done:
            for lane in lanes:
                lane.discard(job)
                try:
                    lane.release(job)
                except Exception:  # release must never take a worker down
                    log.exception("release failed in %s", lane.name)
            for cb in self.on_finished:
                cb(job)

    def stats(self) -> dict[str, object]:
        return {
            "active_jobs": self.active,
            "workers": {n: {"device": w.device, "steps": w.stats.steps, "busy_s": round(w.stats.busy_s, 3),
                            "errors": w.stats.errors} for n, w in self.workers.items()},
            "lanes": {lane.name: {"jobs": len(lane.jobs), "ready": len(lane.ready_jobs()), "steps": lane.steps}
                      for lane in self.lanes()},
        }


@dataclass
class OutputChannel:
    """Bounded hand-off of items from a worker thread to one asyncio consumer.

    The worker side never blocks: lanes check ``room()`` (or ``has_room()``) in ``is_ready`` before
    producing, which is the back-pressure that keeps the channel bounded. The asyncio side awaits
    ``drain``. A put wakes the consumer's loop with a cross-thread call unless one is already on its
    way; ``signal_all`` wakes many channels' consumers with one call per loop, for a lane that fed a
    whole batch of streams in one step.
    """

    capacity: int = 256
    items: list[object] = field(default_factory=list)
    closed: bool = False
    # True: drain's on_take (the scheduler's wake) runs only after has_room() refused a producer,
    # i.e. only when a producer is held back by this channel. False: after every non-empty take
    # (for producers that check room() themselves).
    wake_on_refusal: bool = False

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._loop = None
        self._event = None
        self._refused = False
        self._scheduled = False  # a wake-up of the consumer is on its way to the loop

    def bind(self, loop, event) -> None:  # noqa: ANN001 - asyncio objects, kept untyped to stay loop-agnostic
        self._loop, self._event = loop, event

    def room(self) -> int:
        with self._lock:
            return self.capacity - len(self.items)

    def has_room(self, reserve: int) -> bool:
        """More than ``reserve`` free places? A refusal is remembered: the consumer's next take then
        wakes the producers (see ``wake_on_refusal``)."""
        with self._lock:
            ok = self.capacity - len(self.items) > reserve
            if not ok:
                self._refused = True
        return ok

    def put(self, item: object, signal: bool = True) -> None:
        """Add ``item``; ``signal=False`` leaves waking the consumer to a later ``signal_all``."""
        with self._lock:
            assert len(self.items) < self.capacity + 64, "lane ignored back-pressure"
            self.items.append(item)
        if signal:
            self._signal()

    def close(self) -> None:
        self.closed = True
        self._signal()

    def _needs_signal(self) -> bool:
        """Claim the consumer's wake-up: False when one is already on its way to the loop (it has
        not run yet, so the consumer will take this item too)."""
        if self._loop is None or self._event is None or self._scheduled:
            return False
        self._scheduled = True
        return True

    def _wake_consumer(self) -> None:  # on the loop
        self._scheduled = False
        self._event.set()  # type: ignore[attr-defined]

    def _signal(self) -> None:
        if self._needs_signal():
            try:
                self._loop.call_soon_threadsafe(self._wake_consumer)  # type: ignore[attr-defined]
            except RuntimeError:  # loop closed: the session is gone
                pass

    def take(self) -> list[object]:
        return self._take()[0]

    def _take(self) -> tuple[list[object], bool]:
        with self._lock:
            items, self.items = self.items, []
            refused, self._refused = self._refused, False
        return items, refused

    async def drain(self, on_take: Callable[[], None] | None = None) -> list[object]:
        """Await the bound event, then take every item. ``on_take`` runs when something was taken
        and a producer may have been held back by a full channel (the scheduler's wake: that
        producer may step again)."""
        assert self._event is not None, "bind() the channel to an event loop first"
        await self._event.wait()
        self._event.clear()
        items, refused = self._take()
        if items and on_take is not None and (refused or not self.wake_on_refusal):
            on_take()
        return items


def _wake_consumers(channels: list[OutputChannel]) -> None:  # on the loop
    for ch in channels:
        ch._wake_consumer()


def signal_all(channels: Iterable[OutputChannel]) -> None:
    """Wake the consumers of ``channels`` (items were put with ``signal=False``): one cross-thread
    call per event loop instead of one per channel."""
    by_loop: dict[Any, list[OutputChannel]] = {}
    for ch in channels:
        if ch._needs_signal():
            by_loop.setdefault(ch._loop, []).append(ch)
    for loop, chs in by_loop.items():
        try:
            loop.call_soon_threadsafe(functools.partial(_wake_consumers, chs))
        except RuntimeError:  # loop closed: those sessions are gone
            pass
