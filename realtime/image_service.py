"""Class-conditional image generation (DiT) on the one scheduler, with progressive previews.

GENERATOR lane ``dit.step`` (worker "generator", jobs of priority BACKGROUND, so any speech job due
within a second wins the worker; image steps fill the gaps; they also pause, for at most
``YIELD_MAX_S``, while speech on the other worker is due within a second): ONE batched denoising step for every
ready request, whatever step index each is at (``DiTEngine.step_batch``). After the step, requests
whose step count hits their ``preview_every`` get a preview (latent2rgb or TAESD, batched per kind);
requests that took their last step are decoded by the full VAE, batched. The lane only does tensor
work and copies uint8 pixels to the host; JPEG/PNG encoding runs on small encoder threads (one FIFO
per request, so its previews and final arrive in order) — never in the event loop, never on the
device worker.

Back-pressure: a request is ready only while its output channel has room for what is already
queued plus being encoded; a slow client therefore pauses its own steps, nobody else's. Cancel
takes effect before the next step (the scheduler reaps cancelled jobs between steps): at most the
step already running finishes.

Routes: WebSocket /v1/image (realtime/protocol/image.py, docs/image.md), POST /v1/images/generations
(OpenAI-style, non-streaming). /v1/video is the same session, lane and encoders over a clip engine
(realtime/video_service.py, which overrides the lane's media hooks); without ``--video-model`` this
service answers it with ``unsupported``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import os
import statistics
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket

from realtime.errors import AuthError, InternalError, OverloadedError, RealtimeError
from realtime.protocol import image as proto
from realtime.protocol import messages as m
from realtime.scheduler import BACKGROUND_SLACK_S, Job, JobState, Lane, OutputChannel, Priority
from realtime.service import Service
from realtime.sessions import StreamSession

if TYPE_CHECKING:
    from realtime.config import ServerConfig
    from realtime.scheduler import Scheduler
    from realtime.server import AppState
    from realtime.sessions import Connection

log = logging.getLogger("realtime.image")

OUTPUT_CAPACITY = 8  # previews produced but not yet sent, per request
ENCODER_THREADS = 2
# Image steps also yield to speech that is due soon on the OTHER worker (the codec/vocoder shares
# the device and the CPU with us), but never for longer than this: a liveness floor for images.
YIELD_MAX_S = 0.25


@dataclass
class Preview:
    step: int
    of: int
    data: bytes  # JPEG (a frame strip for video)
    ms: float
    fields: dict[str, Any] = field(default_factory=dict)  # extra message fields (video: frames)


@dataclass
class Final:
    data: bytes  # PNG (MP4 for video)
    ms: float
    key: str = "image"  # the message field that carries data ("video" for an MP4)
    fields: dict[str, Any] = field(default_factory=dict)  # extra message fields (video: frames, fps)


class _End:
    """Sentinel on the output channel: the final was produced."""


END = _End()


class ImageJob(Job):
    """One image (or clip) request. ``dit`` is its engine state (a pooled ImageState, or ClipState for
    video), taken on the first step."""

    priority = Priority.BACKGROUND

    def __init__(self, params: proto.ImageParams, seed: int, session: str = "") -> None:
        super().__init__()
        self.params = params
        self.seed = seed
        self.session = session
        self.output = OutputChannel(capacity=OUTPUT_CAPACITY)
        self.dit: Any = None
        self.steps = 0  # denoising steps finished
        self.stepped_all = False
        self.pending = 0  # encodes queued on the encoder thread (counted against the channel's room)
        self.step_ms: list[float] = []
        self.previews = 0
        self.started = time.monotonic()
        self.first_preview_ms: float | None = None
        self.total_ms: float | None = None
        self.cancel_at_step: int | None = None  # steps finished when cancel arrived (tests, stats)

    def ms(self) -> float:
        return (time.monotonic() - self.started) * 1000.0

    def notify(self) -> None:
        self.output.close()

    def cancel(self) -> None:
        if self.active and self.cancel_at_step is None:
            self.cancel_at_step = self.steps
        super().cancel()

    def stats(self, cancelled: bool = False) -> dict[str, Any]:
        p50 = statistics.median(self.step_ms) if self.step_ms else None
        return {"steps": self.steps, "previews": self.previews,
                "total_ms": None if self.total_ms is None else round(self.total_ms, 3),
                "first_preview_ms": None if self.first_preview_ms is None else round(self.first_preview_ms, 3),
                "step_ms_p50": None if p50 is None else round(p50, 3), "seed": self.seed,
                "cancelled": cancelled}


def _to_u8(img: torch.Tensor) -> torch.Tensor:
    """[B, 3, H, W] float in [0, 1] on the device → uint8 on the host (4x less to copy than float)."""
    return (img.float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()


class DiTStepLane(Lane):
    """One batched denoising step over every ready request. The media hooks at the end (arm, pixels,
    encoders) are what differs between images and clips; VideoStepLane overrides them."""

    name = "dit.step"
    worker = "generator"
    final_field = "image"

    def __init__(self, svc: "ImageService") -> None:
        super().__init__()
        self.svc = svc
        self.max_batch = svc.max_batch
        self.last_step_at = 0.0
        self._due_at = -1.0
        self._due = False

    def is_ready(self, job: ImageJob) -> bool:  # type: ignore[override]
        if job.stepped_all or job.output.room() - job.pending <= 2:
            return False
        now = time.monotonic()
        return not (self.speech_due(now) and now - self.last_step_at < YIELD_MAX_S)

    def speech_due(self, now: float) -> bool:
        """Is a realtime job on any other lane ready and due within the background slack?

        On our own worker EDF already orders it first; this extends the rule to the other worker,
        which competes with us for the same device (or CPU cores). Cached for 2 ms: is_ready runs
        once per job per pick.
        """
        if now - self._due_at < 0.002:
            return self._due
        due = False
        sched = self.svc.scheduler
        if sched is not None:
            horizon = now + BACKGROUND_SLACK_S
            # other DiT lanes (image next to video) hold only BACKGROUND jobs, and asking them would
            # recurse into their own speech_due
            due = any(j.priority is Priority.REALTIME and j.deadline(now) < horizon
                      for lane in sched.lanes() if not isinstance(lane, DiTStepLane) for j in lane.ready_jobs())
        self._due_at, self._due = now, due
        return due

    def run(self, jobs: list[ImageJob]) -> None:  # type: ignore[override]
        svc, eng = self.svc, self.svc.engine
        assert eng is not None
        t0 = time.perf_counter()
        live: list[tuple[ImageJob, Any]] = []
        for job in jobs:
            if not job.active:  # cancelled since the pick: do not take a state it would never return
                continue
            if job.dit is None:
                st = svc.take_state()
                try:
                    self.arm(st, job)
                except RealtimeError as exc:  # bad input found late fails this request only
                    svc.give_state(st)
                    job.fail(exc)
                    continue
                job.dit = st
            live.append((job, job.dit))
        if not live:
            return
        states = [st for _, st in live]
        self.last_step_at = time.monotonic()
        eng.step_batch(states)
        if svc.sync is not None:
            # One sync per step: the worker must not queue image steps ahead on the device stream,
            # or a speech kernel submitted next would wait behind all of them.
            svc.sync()
        step_ms = (time.perf_counter() - t0) * 1000.0
        want_preview: dict[str, list[tuple[ImageJob, Any]]] = {}
        finals: list[tuple[ImageJob, Any]] = []
        for job, st in live:
            job.steps = st.step_index
            job.step_ms.append(step_ms)
            every = job.params.preview_every
            if st.done:
                job.stepped_all = True
                finals.append((job, st))
            elif every and st.step_index % every == 0:
                want_preview.setdefault(job.params.preview, []).append((job, st))
        for kind, group in want_preview.items():
            pix = self.preview_pixels([st for _, st in group], kind)
            for (job, st), img in zip(group, pix, strict=True):
                step, of = st.step_index, st.num_steps
                svc.encode(job, lambda job=job, img=img, step=step, of=of:
                           self._put_preview(job, *self.encode_preview(job, img), step, of))
        if finals:
            pix = self.final_pixels([st for _, st in finals])
            for (job, _), img in zip(finals, pix, strict=True):
                svc.encode(job, lambda job=job, img=img: self._put_final(job, *self.encode_final(job, img)))

    @staticmethod
    def _put_preview(job: ImageJob, data: bytes, fields: dict[str, Any], step: int, of: int) -> None:
        ms = job.ms()
        if job.first_preview_ms is None:
            job.first_preview_ms = ms
        job.previews += 1
        job.output.put(Preview(step, of, data, ms, fields))

    def _put_final(self, job: ImageJob, data: bytes, fields: dict[str, Any]) -> None:
        job.total_ms = job.ms()
        job.output.put(Final(data, job.total_ms, self.final_field, fields))
        job.output.put(END)
        with job.lock:
            if job.active:
                job.state = JobState.FINISHED

    def release(self, job: Job) -> None:
        st = job.dit  # type: ignore[attr-defined]
        job.dit = None  # type: ignore[attr-defined]
        if st is not None:
            self.svc.give_state(st)

    # ------------------------------------------------------------------ media hooks

    def arm(self, st: Any, job: ImageJob) -> None:
        """Reset a pooled engine state for ``job`` (worker thread; bad input raises RealtimeError)."""
        p = job.params
        self.svc.engine.reset_state(st, p.class_label, job.seed, p.steps, p.guidance, p.sampler)

    def preview_pixels(self, states: list[Any], kind: str) -> list[torch.Tensor]:
        """Per state, its preview as uint8 on the host: [3, h, w] (worker thread, one copy)."""
        return list(_to_u8(self.svc.engine.preview(states, kind)))

    def final_pixels(self, states: list[Any]) -> list[torch.Tensor]:
        """Per finished state, the decoded image as uint8 on the host: [3, H, W] (worker thread)."""
        return list(_to_u8(self.svc.engine.decode(torch.stack([st.latents for st in states]))))

    @staticmethod
    def encode_preview(job: ImageJob, img: torch.Tensor) -> tuple[bytes, dict[str, Any]]:
        """(JPEG, extra message fields), on an encoder thread."""
        from realtime.engines.diffusion import to_jpeg

        return to_jpeg(img, job.params.preview_size), {}

    @staticmethod
    def encode_final(job: ImageJob, img: torch.Tensor) -> tuple[bytes, dict[str, Any]]:
        """(PNG, extra message fields), on an encoder thread."""
        from realtime.engines.diffusion import to_png

        return to_png(img), {}


class ImageService(Service):
    """DiT class-conditional image generation: /v1/image, /v1/images/generations (and /v1/video's
    ``unsupported`` answer when no video service runs)."""

    name = "image"
    kind = "image"
    lane_class: type[DiTStepLane] = DiTStepLane

    def __init__(self, config: "ServerConfig", max_batch: int = 16) -> None:
        self.config = config
        self.max_batch = max_batch
        self.engine: Any = None  # DiTEngine here, a VideoEngine in VideoService
        self.info: proto.ModelInfo | None = None
        self.unavailable: str | None = None  # why no model serves this kind (told to clients)
        self.lane: DiTStepLane | None = None
        self.scheduler: Scheduler | None = None
        self.sync: Callable[[], None] | None = None
        self._free: list[Any] = []
        self._free_lock = threading.Lock()
        self._encoders: list[ThreadPoolExecutor] = []
        self.recent: deque[ImageJob] = deque(maxlen=32)  # for tests and diagnostics

    # ------------------------------------------------------------------ lifecycle

    def load(self) -> None:
        from realtime.engines.diffusion import DiTEngine
        from realtime.errors import ConfigError

        if not self.config.image_model:
            raise ConfigError("the image service needs --image-model (a DiT folder with transformer/ and vae/)")
        dtype = getattr(torch, self.config.dtype)
        t0 = time.perf_counter()
        self.engine = DiTEngine.from_pretrained(self.config.image_model, device=self.config.generator_device,
                                                dtype=dtype)
        eng = self.engine
        self.info = proto.ModelInfo(image_size=eng.image_size, num_classes=eng.dit.cfg.num_classes,
                                    has_taesd=eng.preview_decoder is not None,
                                    max_steps=min(proto.MAX_STEPS, eng.schedule.num_train_timesteps))
        self._start_workers()
        log.info("loaded DiT (%d layers, %dpx) from %s in %.1fs", eng.dit.cfg.num_layers, self.info.image_size,
                 self.config.image_model, time.perf_counter() - t0)

    def _start_workers(self) -> None:
        """After a model loaded: the per-step device sync (CUDA) and the encoder threads."""
        if str(self.config.generator_device).startswith("cuda"):
            self.sync = lambda: torch.cuda.current_stream().synchronize()
        self._encoders = [ThreadPoolExecutor(1, thread_name_prefix=f"{self.kind}-encode-{i}")
                          for i in range(ENCODER_THREADS)]

    def attach(self, scheduler: "Scheduler") -> None:
        self.scheduler = scheduler
        self.lane = scheduler.add_lane(self.lane_class(self))  # type: ignore[assignment]

    def warmup(self) -> None:
        """One 2-step request through the lane's hooks, encoders included (ffmpeg's first start too)."""
        eng, lane, info = self.engine, self.lane, self.info
        if eng is None:
            return
        assert lane is not None and info is not None
        t0 = time.perf_counter()
        preview = "taesd" if info.has_taesd else "latent2rgb"
        job = ImageJob(proto.ImageParams(class_label=0, steps=2, guidance=4.0, seed=0, size=info.image_size,
                                         preview_every=1, preview_size=info.image_size, sampler="ddim",
                                         preview=preview, frames=2, fps=8), seed=0)
        st = self.take_state()
        lane.arm(st, job)
        eng.step_batch([st])
        lane.encode_preview(job, lane.preview_pixels([st], preview)[0])
        lane.encode_final(job, lane.final_pixels([st])[0])
        self.give_state(st)
        log.info("warmed up %s in %.2fs", self.kind, time.perf_counter() - t0)

    def describe(self) -> list[dict[str, Any]]:
        if self.info is None:
            return []
        return [{"id": "dit", "object": "model", "kind": "image", "size": self.info.image_size,
                 "num_classes": self.info.num_classes, "preview_decoder": self.info.has_taesd,
                 "samplers": list(proto.SAMPLERS), "max_steps": self.info.max_steps}]

    # ------------------------------------------------------------------ worker helpers

    def take_state(self) -> Any:
        """A pooled engine state (reset by the caller), or a new one when the pool is empty."""
        with self._free_lock:
            if self._free:
                return self._free.pop()
        assert self.engine is not None
        return self.engine.new_state(0, 0, 1, 1.0, "ddim")

    def give_state(self, st: Any) -> None:
        with self._free_lock:
            self._free.append(st)

    def encode(self, job: ImageJob, fn: Callable[[], None]) -> None:
        """Run ``fn`` (encode + put) on the job's encoder thread, FIFO per job."""
        with job.lock:
            job.pending += 1

        def task() -> None:
            try:
                fn()
            except Exception as exc:  # an encoder bug fails this request, not the server
                log.exception("image encode failed")
                job.fail(exc)
            finally:
                with job.lock:
                    job.pending -= 1
                if self.scheduler is not None:
                    self.scheduler.wake()  # room freed for the next step

        self._encoders[job.id % len(self._encoders)].submit(task)

    # ------------------------------------------------------------------ requests

    def new_job(self, params: proto.ImageParams, session: str = "") -> ImageJob:
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
        job = ImageJob(params, seed, session)
        self.recent.append(job)
        return job

    def submit(self, job: ImageJob) -> None:
        assert self.scheduler is not None and self.lane is not None
        self.scheduler.submit(job, [self.lane])

    def routes(self, state: Callable[[], "AppState"]) -> list[BaseRoute]:
        from realtime.server import authorized, http_error, json_body, run_websocket

        async def image_ws(ws: WebSocket) -> None:
            await run_websocket(state(), ws, lambda st, conn: ImageSession(st, conn, self, "image").run())

        async def video_ws(ws: WebSocket) -> None:  # no video service: start answers 'unsupported'
            await run_websocket(state(), ws, lambda st, conn: ImageSession(st, conn, self, "video").run())

        async def generations(request: Request) -> Response:
            st = state()
            cfg = st.config
            if not authorized(cfg, request.headers, request.query_params):
                return http_error(AuthError("missing or bad API key"), 401)
            assert self.info is not None
            try:
                body = await json_body(request, cfg.max_frame_bytes)
                params, n = proto.parse_generation(body, self.info)
            except RealtimeError as exc:
                return http_error(exc, 400)
            return await self._generate_http(st, params, n)

        routes: list[BaseRoute] = [WebSocketRoute("/v1/image", image_ws),
                                   Route("/v1/images/generations", generations, methods=["POST"])]
        if not self.config.video_model:  # else VideoService owns /v1/video
            routes.append(WebSocketRoute("/v1/video", video_ws))
        return routes

    async def _generate_http(self, st: "AppState", params: proto.ImageParams, n: int) -> Response:
        from dataclasses import replace

        from realtime.server import http_error

        wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        jobs = []
        for i in range(n):
            p = params if params.seed is None else replace(params, seed=params.seed + i)
            job = self.new_job(p)
            job.output.bind(loop, wake)
            jobs.append(job)
        results: dict[int, bytes] = {}
        try:
            try:
                for job in jobs:
                    self.submit(job)
            except OverloadedError as exc:
                return http_error(exc, 503)
            st.metrics.streams.inc()
            while len(results) < n:
                await wake.wait()
                wake.clear()
                for job in jobs:
                    for item in job.output.take():
                        if isinstance(item, Final):
                            results[job.id] = item.data
                    if job.state is JobState.FAILED:
                        st.metrics.errors.inc()
                        if isinstance(job.error, RealtimeError):
                            return http_error(job.error, 400)
                        return http_error(InternalError("image generation failed"), 500)
                self.scheduler.wake()  # type: ignore[union-attr]
        finally:
            for job in jobs:
                if job.active and job.id not in results:
                    self.scheduler.cancel(job)  # type: ignore[union-attr]
        return JSONResponse({"created": int(time.time()),
                             "data": [{"b64_json": base64.b64encode(results[j.id]).decode("ascii"),
                                       "seed": j.seed} for j in jobs]})


class ImageSession(StreamSession):
    """One /v1/image (or /v1/video) connection: one request, previews, final, done."""

    kind = "image"

    def __init__(self, app: "AppState", conn: "Connection", svc: ImageService, kind: str = "image") -> None:
        self.app = app
        self.conn = conn
        self.svc = svc
        self.kind = kind
        # no model of this kind here (e.g. /v1/video on the image service): start answers 'unsupported'
        info = svc.info if svc.kind == kind else None
        self.proto = proto.ImageProtocol(info, kind, unavailable=svc.unavailable if svc.kind == kind else None)
        self.job: ImageJob | None = None
        self.id = uuid.uuid4().hex[:16]
        self.sender: asyncio.Task[None] | None = None

    async def _receive_loop(self) -> None:
        while True:
            msg = await self.conn.recv()
            if msg is None or self.conn.closed:
                return
            event = self.proto.receive(msg)
            if isinstance(event, proto.Start):
                await self._start(event.params)
            elif isinstance(event, proto.Cancel):
                assert self.job is not None
                self.app.scheduler.cancel(self.job)
                if self.sender is not None:
                    self.sender.cancel()
                    await asyncio.gather(self.sender, return_exceptions=True)
                await self.conn.send(m.done(self.job.stats(cancelled=True)))
                await self.conn.close(1000, "cancelled")
                return
            if self.sender is not None and self.sender.done():
                return

    async def _start(self, params: proto.ImageParams) -> None:
        job = self.svc.new_job(params, session=self.id)
        self.wake = asyncio.Event()
        job.output.bind(asyncio.get_running_loop(), self.wake)
        self.svc.submit(job)  # OverloadedError → error + 1013
        self.job = job
        self.app.metrics.streams.inc()
        p = job.params  # the service may have adjusted it (video: the strip's frame size)
        clip = {"frames": p.frames, "fps": p.fps} if self.kind == "video" else {}
        await self.conn.send(proto.ready(self.id, p.steps, p.size, seed=job.seed, preview=p.preview,
                                         preview_size=p.preview_size, **clip))
        self.sender = asyncio.create_task(self._send_loop(), name=f"image-send-{self.id}")

    async def _send_loop(self) -> None:
        job = self.job
        assert job is not None
        while True:
            items = await job.output.drain(self.app.scheduler.wake)  # room freed: the lane may step again
            for item in items:
                if isinstance(item, Preview):
                    await self.conn.send(proto.preview(item.step, item.of, item.data, item.ms, **item.fields))
                elif isinstance(item, Final):
                    await self.conn.send(proto.final(item.data, item.ms, field=item.key, **item.fields))
                elif item is END:
                    self.proto.finished()
                    await self.conn.send(m.done(job.stats()))
                    await self.conn.close(1000, "done")
                    return
                if self.conn.closed:
                    return
            if await self._job_over("image generation failed"):
                return


# ---------------------------------------------------------------------- CLI


def add_cli(subparsers: Any) -> None:
    p = subparsers.add_parser("image", help="generate one class-conditional image (DiT) into a PNG")
    p.add_argument("--class-label", type=int, required=True, help="ImageNet class index 0..999")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--url", default="ws://127.0.0.1:8000/v1/image")
    p.add_argument("--api-key", default=None)
    p.add_argument("--local", action="store_true", help="generate in this process (no server)")
    p.add_argument("--model", default=None, help="with --local: a DiT folder (transformer/, vae/)")
    p.add_argument("--steps", type=int, default=proto.DEFAULT_STEPS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--guidance", type=float, default=proto.DEFAULT_GUIDANCE)
    p.add_argument("--sampler", default="ddim", choices=list(proto.SAMPLERS))
    p.add_argument("--device", default="cpu", help="with --local: cpu, cuda:0")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.set_defaults(fn=_image_cli)


def _image_cli(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    try:
        if args.local:
            data, info = _generate_local(args)
        else:
            data, info = asyncio.run(_generate_remote(args))
    except RealtimeError as exc:
        print(f"realtime image: {exc.message}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError) as exc:
        print(f"realtime image: {exc}", file=sys.stderr)
        return 1
    with open(args.output, "wb") as f:
        f.write(data)
    print(f"wrote {args.output}: class {args.class_label}, {args.steps} steps in "
          f"{time.perf_counter() - t0:.2f} s{info}")
    return 0


def _generate_local(args: argparse.Namespace) -> tuple[bytes, str]:
    from realtime.engines.diffusion import DiTEngine, to_png
    from realtime.errors import ConfigError

    if not args.model:
        raise ConfigError("--local needs --model (a DiT folder with transformer/ and vae/)")
    eng = DiTEngine.from_pretrained(args.model, device=args.device, dtype=getattr(torch, args.dtype))
    lat = eng.generate([args.class_label], [args.seed], args.steps, args.guidance, args.sampler)
    return to_png(eng.decode(lat)[0]), ""


async def _generate_remote(args: argparse.Namespace) -> tuple[bytes, str]:
    import msgpack
    import websockets

    key = args.api_key or os.environ.get("REALTIME_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else None
    start = {"type": "start", "class_label": args.class_label, "steps": args.steps, "seed": args.seed,
             "guidance": args.guidance, "sampler": args.sampler, "preview_every": 0}
    async with websockets.connect(args.url, additional_headers=headers, max_size=64 << 20) as ws:
        await ws.send(msgpack.packb(start, use_bin_type=True))
        image = None
        async for frame in ws:
            msg = msgpack.unpackb(frame, raw=False)
            if msg["type"] == "error":
                raise RuntimeError(f"server error {msg['code']}: {msg['message']}")
            if msg["type"] == "final":
                image = msg["image"]
            if msg["type"] == "done":
                st = msg["stats"]
                if image is None:
                    raise RuntimeError("the server ended without a final image")
                return image, f" (server {st['total_ms']:.0f} ms, step p50 {st['step_ms_p50']:.1f} ms)"
    raise RuntimeError("the connection closed before the final image")
