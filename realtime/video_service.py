"""Class-conditional video (/v1/video) on the one scheduler: the image service's session, lane and
encoder threads over a clip engine (engines/video.py).

GENERATOR lane ``video.step`` (BACKGROUND, like ``dit.step``): ONE batched denoising step for every
ready clip, whatever step each is at (``VideoEngine.step_batch``). Only the media hooks differ from
images: a request's engine state is a clip of F latent frames; a preview is one JPEG *frame strip*
(the F predicted frames side by side, each ``preview_size`` tall, shrunk so the strip stays within
``MAX_STRIP_WIDTH``); the final is an H.264 MP4 encoded by imageio-ffmpeg's bundled ffmpeg on the
encoder threads — never in the event loop, never on the device worker.

``realtime serve --video-model FOLDER`` picks the engine by the folder's transformer class
(``load_video_engine``). Today that is ``FrameDiTEngine``: an image DiT folder run frame by frame
(plumbing for the path, not a video model; see engines/video.py). Without imageio-ffmpeg the
service loads no model and /v1/video answers ``unsupported`` naming the ``video`` extra.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket

from realtime.image_service import DiTStepLane, ImageJob, ImageService, ImageSession, _to_u8
from realtime.protocol import image as proto

if TYPE_CHECKING:
    from realtime.config import ServerConfig
    from realtime.server import AppState

log = logging.getLogger("realtime.video")

MAX_BATCH = 4  # clips per step: each is F frames of DiT rows (x2 with guidance)


class VideoStepLane(DiTStepLane):
    """``dit.step`` for clips: the same batching and back-pressure, clip-shaped media hooks."""

    name = "video.step"
    final_field = "video"

    def arm(self, st: Any, job: ImageJob) -> None:
        p = job.params
        self.svc.engine.reset_state(st, p.class_label, job.seed, p.steps, p.guidance, p.sampler, p.frames)

    def preview_pixels(self, states: list[Any], kind: str) -> list[torch.Tensor]:
        """Per clip [F, 3, h, w] uint8 on the host (one copy for all clips)."""
        rgb = self.svc.engine.preview(states, kind)
        return list(_to_u8(torch.cat(rgb)).split([len(x) for x in rgb]))

    def final_pixels(self, states: list[Any]) -> list[torch.Tensor]:
        """Per clip [F, 3, H, W] uint8 on the host."""
        rgb = self.svc.engine.decode([st.latents for st in states])
        return list(_to_u8(torch.cat(rgb)).split([len(x) for x in rgb]))

    @staticmethod
    def encode_preview(job: ImageJob, img: torch.Tensor) -> tuple[bytes, dict[str, Any]]:
        from realtime.engines.video import to_strip_jpeg

        return to_strip_jpeg(img, job.params.preview_size), {"frames": len(img)}

    @staticmethod
    def encode_final(job: ImageJob, img: torch.Tensor) -> tuple[bytes, dict[str, Any]]:
        from realtime.engines.video import to_mp4

        return to_mp4(img, job.params.fps), {"frames": len(img), "fps": job.params.fps}


class VideoService(ImageService):
    """/v1/video: class-conditional clips with frame-strip previews and an MP4 final."""

    name = "video"
    kind = "video"
    lane_class = VideoStepLane

    def __init__(self, config: "ServerConfig", max_batch: int = MAX_BATCH) -> None:
        super().__init__(config, max_batch)

    def load(self) -> None:
        from realtime.engines.video import load_video_engine, mp4_unavailable
        from realtime.errors import ConfigError

        if not self.config.video_model:
            raise ConfigError("the video service needs --video-model (a checkpoint folder with transformer/ and vae/)")
        self.unavailable = mp4_unavailable()
        if self.unavailable is not None:
            log.warning("/v1/video disabled: %s", self.unavailable)
            return
        t0 = time.perf_counter()
        eng = load_video_engine(self.config.video_model, device=self.config.generator_device,
                                dtype=getattr(torch, self.config.dtype))
        self.engine = eng
        self.info = proto.ModelInfo(image_size=eng.frame_size, num_classes=eng.num_classes,
                                    has_taesd=eng.has_preview_decoder, max_steps=min(proto.MAX_STEPS, eng.max_steps),
                                    kind="video", max_frames=min(proto.MAX_VIDEO_FRAMES, eng.max_frames))
        self._start_workers()
        log.info("loaded video engine %s (%dpx, up to %d frames) from %s in %.1fs", eng.name, eng.frame_size,
                 eng.max_frames, self.config.video_model, time.perf_counter() - t0)

    def describe(self) -> list[dict[str, Any]]:
        if self.info is None:
            return []
        return [{"id": self.engine.name, "object": "model", "kind": "video", "size": self.info.image_size,
                 "max_frames": self.info.max_frames, "num_classes": self.info.num_classes,
                 "preview_decoder": self.info.has_taesd, "samplers": list(proto.SAMPLERS),
                 "max_steps": self.info.max_steps}]

    def new_job(self, params: proto.ImageParams, session: str = "") -> ImageJob:
        from realtime.engines.video import strip_frame_size

        return super().new_job(replace(params, preview_size=strip_frame_size(params.preview_size, params.frames)),
                               session)

    def routes(self, state: Callable[[], "AppState"]) -> list[BaseRoute]:
        from realtime.server import run_websocket

        async def video_ws(ws: WebSocket) -> None:
            await run_websocket(state(), ws, lambda st, conn: ImageSession(st, conn, self, "video").run())

        return [WebSocketRoute("/v1/video", video_ws)]
