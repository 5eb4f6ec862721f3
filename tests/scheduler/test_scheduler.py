"""The scheduler core without tensors: EDF picking, batching, background work, reaping, threads."""

from __future__ import annotations

import threading
import time

import pytest

from realtime.errors import OverloadedError
from realtime.scheduler import (BACKGROUND_SLACK_S, SPECULATIVE_SLACK_S, Job, JobState, Lane, Priority, Scheduler,
                                pick)


class FakeJob(Job):
    def __init__(self, due: float, priority: Priority = Priority.REALTIME, work: int = 1) -> None:
        super().__init__(now=due)
        self.due = due
        self.priority = priority
        self.work = work
        self.ran = 0

    def deadline(self, now: float) -> float:
        return super().deadline(now) if self.priority is Priority.BACKGROUND else self.due


class FakeLane(Lane):
    def __init__(self, name: str, max_batch: int = 2, worker: str = "generator") -> None:
        super().__init__()
        self.name, self.max_batch, self.worker = name, max_batch, worker
        self.batches: list[list[int]] = []
        self.released: list[int] = []

    def is_ready(self, job: Job) -> bool:
        return job.work > 0  # type: ignore[attr-defined]

    def run(self, jobs: list[Job]) -> None:
        self.batches.append([j.id for j in jobs])
        for j in jobs:
            j.work -= 1  # type: ignore[attr-defined]
            j.ran += 1  # type: ignore[attr-defined]
            if j.work == 0:  # type: ignore[attr-defined]
                j.state = JobState.FINISHED

    def release(self, job: Job) -> None:
        self.released.append(job.id)


def _wait_idle(sched: Scheduler, timeout: float = 5.0) -> None:
    """Until the started scheduler has no active job (or ``timeout`` seconds pass)."""
    deadline = time.monotonic() + timeout
    while sched.active and time.monotonic() < deadline:
        time.sleep(0.01)


def test_pick_serves_the_earliest_deadline_first_and_batches() -> None:
    a, b = FakeLane("a", max_batch=2), FakeLane("b", max_batch=2)
    j1, j2, j3, j4 = FakeJob(5.0), FakeJob(1.0), FakeJob(3.0), FakeJob(2.0)
    for j in (j1, j3):
        a.add(j)
    for j in (j2, j4):
        b.add(j)
    choice = pick([a, b], now=0.0)
    assert choice is not None and choice.lane is b
    assert [j.id for j in choice.jobs] == [j2.id, j4.id]
    j2.work = j4.work = 0
    choice = pick([a, b], now=0.0)
    assert choice is not None and choice.lane is a and [j.id for j in choice.jobs] == [j3.id, j1.id]


def test_inactive_and_unready_jobs_are_skipped() -> None:
    lane = FakeLane("a")
    j1, j2 = FakeJob(1.0), FakeJob(2.0)
    lane.add(j1)
    lane.add(j2)
    j1.cancel()
    choice = pick([lane], now=0.0)
    assert choice is not None and [j.id for j in choice.jobs] == [j2.id]
    j2.work = 0
    assert pick([lane], now=0.0) is None


def test_background_work_fills_gaps_but_yields_to_due_speech() -> None:
    speech, image = FakeLane("speech"), FakeLane("image")
    img = FakeJob(0.0, Priority.BACKGROUND)
    image.add(img)
    far = FakeJob(100.0)  # speech with a deep buffer: due in 100 s
    speech.add(far)
    choice = pick([speech, image], now=0.0)
    assert choice is not None and choice.lane is image
    due = FakeJob(0.5 * BACKGROUND_SLACK_S)  # speech due sooner than the background slack
    speech.add(due)
    choice = pick([speech, image], now=0.0)
    assert choice is not None and choice.lane is speech and choice.jobs[0] is due


def test_speculative_work_yields_to_work_due_soon_and_rides_along_in_batches() -> None:
    asr, text = FakeLane("asr"), FakeLane("text", max_batch=4)
    guess = FakeJob(-5.0)  # the voice agent's preemptive reply: due long ago by its own clock
    guess.speculative = True
    text.add(guess)
    audio = FakeJob(0.5 * SPECULATIVE_SLACK_S)  # the VAD's next audio, due soon
    asr.add(audio)
    choice = pick([asr, text], now=0.0)
    assert choice is not None and choice.lane is asr
    audio.work = 0
    other = FakeJob(2 * SPECULATIVE_SLACK_S)  # another caller's reply, not due yet
    text.add(other)
    choice = pick([asr, text], now=0.0)  # nothing due soon: the guess runs, the other rides along
    assert choice is not None and choice.lane is text and [j.id for j in choice.jobs] == [guess.id, other.id]
    guess.speculative = False  # committed: its own deadline again
    late = FakeJob(-1.0)
    asr.add(late)
    choice = pick([asr, text], now=0.0)
    assert choice is not None and choice.lane is text and choice.jobs[0] is guess


def test_scheduler_runs_jobs_on_worker_threads_and_reaps_them() -> None:
    sched = Scheduler({"generator": "cpu", "codec": "cpu"}, max_jobs=3)
    gen, codec = FakeLane("gen", worker="generator"), FakeLane("codec", worker="codec")
    sched.add_lane(gen)
    sched.add_lane(codec)
    jobs = [FakeJob(time.monotonic(), work=3) for _ in range(3)]
    for j in jobs:
        sched.submit(j, [gen])
    with pytest.raises(OverloadedError):
        sched.submit(FakeJob(0.0), [gen])
    sched.start()
    try:
        _wait_idle(sched)
        assert sched.active == 0
        assert all(j.ran == 3 and j.state is JobState.FINISHED for j in jobs)
        assert sorted(gen.released) == sorted(j.id for j in jobs)
        assert all(len(b) <= gen.max_batch for b in gen.batches)
    finally:
        sched.stop()


def test_a_cancelled_job_is_dropped_within_one_step() -> None:
    sched = Scheduler({"generator": "cpu"})
    gate = threading.Event()

    class SlowLane(FakeLane):
        def run(self, jobs: list[Job]) -> None:
            gate.wait(2)
            super().run(jobs)

    lane = sched.add_lane(SlowLane("slow", max_batch=1))
    job = FakeJob(0.0, work=1000)
    sched.submit(job, [lane])
    sched.start()
    try:
        time.sleep(0.05)
        sched.cancel(job)
        gate.set()
        t0 = time.monotonic()
        while sched.active and time.monotonic() - t0 < 2:
            time.sleep(0.005)
        assert sched.active == 0 and lane.released == [job.id]
        assert job.ran <= 1  # at most the step that was already running
    finally:
        gate.set()
        sched.stop()


def test_a_failing_lane_fails_its_jobs_not_the_worker() -> None:
    sched = Scheduler({"generator": "cpu"})

    class Boom(FakeLane):
        def run(self, jobs: list[Job]) -> None:
            raise RuntimeError("engine bug")

    boom = sched.add_lane(Boom("boom"))
    ok = sched.add_lane(FakeLane("ok"))
    bad_job, good_job = FakeJob(0.0), FakeJob(1.0)
    sched.submit(bad_job, [boom])
    sched.submit(good_job, [ok])
    sched.start()
    try:
        t0 = time.monotonic()
        while sched.active and time.monotonic() - t0 < 3:
            time.sleep(0.01)
        assert bad_job.state is JobState.FAILED and isinstance(bad_job.error, RuntimeError)
        assert good_job.state is JobState.FINISHED
    finally:
        sched.stop()


def test_output_channel_wakes_producers_only_when_it_refused_one() -> None:
    import asyncio

    from realtime.scheduler import OutputChannel

    async def run() -> list[str]:
        woke: list[str] = []
        ch = OutputChannel(capacity=4, wake_on_refusal=True)
        ch.bind(asyncio.get_running_loop(), asyncio.Event())
        ch.put("a")
        await ch.drain(lambda: woke.append("a"))  # room was never short: no wake
        for x in "bcd":
            ch.put(x)
        assert not ch.has_room(1)  # a producer is held back ...
        assert await ch.drain(lambda: woke.append("d")) == ["b", "c", "d"]  # ... so this take wakes it
        assert ch.has_room(1)
        ch.put("e")
        await ch.drain(lambda: woke.append("e"))
        every = OutputChannel(capacity=4)  # the default: wake after every non-empty take
        every.bind(asyncio.get_running_loop(), asyncio.Event())
        every.put("f")
        await every.drain(lambda: woke.append("f"))
        return woke

    assert asyncio.run(run()) == ["d", "f"]


def test_output_channel_puts_share_one_cross_thread_wake_up() -> None:
    from realtime.scheduler import OutputChannel

    class Loop:
        calls: list = []

        def call_soon_threadsafe(self, fn) -> None:  # noqa: ANN001
            self.calls.append(fn)

    class Event:
        sets = 0

        def set(self) -> None:
            Event.sets += 1

    ch, loop = OutputChannel(), Loop()
    ch.bind(loop, Event())
    for i in range(5):
        ch.put(i)
    assert len(loop.calls) == 1  # one wake-up on its way covers every item put before it runs
    loop.calls.pop()()
    assert Event.sets == 1
    ch.put(5)
    ch.close()
    assert len(loop.calls) == 1 and ch.take() == list(range(6))


def test_reap_frees_an_ended_job_at_once_and_only_once() -> None:
    sched = Scheduler({"generator": "cpu"})
    lane = sched.add_lane(FakeLane("gen"))
    job = FakeJob(0.0, work=5)
    sched.submit(job, [lane])
    sched.reap(job)  # still running: stays
    assert sched.active == 1 and lane.released == []
    job.state = JobState.FINISHED
    sched.reap(job)  # no worker step needed: the session calls this before it says "done"
    assert sched.active == 0 and lane.released == [job.id] and job not in lane.jobs
    sched.reap(job)
    sched._reap()
    assert lane.released == [job.id]


def test_a_lane_wakes_only_the_worker_it_names() -> None:
    sched = Scheduler({"generator": "cpu", "codec": "cpu"})
    gen = sched.add_lane(FakeLane("gen", worker="generator"))
    gen.wake("codec")
    assert sched.workers["codec"]._pending and not sched.workers["generator"]._pending
    gen.wake()
    assert sched.workers["generator"]._pending


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_workers_accept_a_bare_or_indexed_device(device: str) -> None:
    """`--generator-device cuda` (no index) runs on the current device; it once killed the workers."""
    sched = Scheduler({"generator": device, "codec": device})
    lane = FakeLane("gen", worker="generator")
    sched.add_lane(lane)
    job = FakeJob(time.monotonic(), work=2)
    sched.submit(job, [lane])
    sched.start()
    try:
        _wait_idle(sched)
        assert job.ran == 2 and job.state is JobState.FINISHED
    finally:
        sched.stop()


def test_a_lane_failing_while_picking_fails_its_jobs_not_the_worker() -> None:
    """An exception in a lane's is_ready (a lane bug) once killed the worker thread and hung the
    server; now that lane's jobs fail and the worker goes on serving the other lanes."""

    class BrokenLane(FakeLane):
        def is_ready(self, job: Job) -> bool:
            raise RuntimeError("lane bug")

    sched = Scheduler({"generator": "cpu"})
    broken, good = BrokenLane("broken"), FakeLane("good")
    sched.add_lane(broken)
    sched.add_lane(good)
    bad_job, ok_job = FakeJob(time.monotonic()), FakeJob(time.monotonic(), work=2)
    sched.submit(bad_job, [broken])
    sched.submit(ok_job, [good])
    sched.start()
    try:
        _wait_idle(sched)
        assert bad_job.state is JobState.FAILED and isinstance(bad_job.error, RuntimeError)
        assert ok_job.ran == 2 and ok_job.state is JobState.FINISHED
        assert sched.workers["generator"].thread.is_alive()
    finally:
        sched.stop()
