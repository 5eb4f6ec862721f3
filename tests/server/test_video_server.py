"""/v1/video on a real uvicorn server: frame-strip previews, an H.264 MP4 final close to the engine
offline, cancel, bad input, and the answer without imageio-ffmpeg (tiny random DiT, 64 px frames)."""

from __future__ import annotations

import asyncio
import io
import sys
import time

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from realtime.config import ServerConfig
from realtime.engines.video import MAX_STRIP_WIDTH, from_mp4, load_video_engine
from realtime.image_service import ImageService
from realtime.server import create_app
from realtime.video_service import VideoService

from liveserver import serve, session
from test_image_server import _FakeSpeechLane, check_cancel_within_one_step

pytest.importorskip("imageio_ffmpeg")

SIZE = 64  # the ckpt fixture (conftest.py)
# H.264 at crf 10 on these random-weight (noise-like) frames: luma stays within ~1.6 levels on
# average, RGB within ~13 (4:2:0 chroma subsampling of noise); another seed's clip is ~38 away.
MAX_MEAN_RGB_DIFF, MAX_MEAN_LUMA_DIFF = 16.0, 4.0


@pytest.fixture(scope="module")
def live(ckpt, piper_backend):  # noqa: ANN001, ANN201
    cfg = ServerConfig(warmup=True, image_model=str(ckpt), video_model=str(ckpt))
    svc = VideoService(cfg)
    app = create_app(cfg, tts=piper_backend, services=[ImageService(cfg), svc])
    with serve(app) as srv:
        srv.svc = svc
        yield srv


def offline_frames(folder, label: int, seed: int, frames: int, steps: int, g: float) -> np.ndarray:  # noqa: ANN001
    eng = load_video_engine(folder)
    rgb = eng.decode([eng.generate(label, seed, frames, steps, g, "ddim")])[0]
    return (rgb * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()  # [F, H, W, 3]


def luma(x: np.ndarray) -> np.ndarray:
    return x[..., :3].astype(float) @ np.array([0.299, 0.587, 0.114])


def jpeg(data: bytes) -> np.ndarray:
    im = Image.open(io.BytesIO(data))
    assert im.format == "JPEG"
    return np.asarray(im.convert("RGB"))


async def test_strips_then_mp4_close_to_offline(live, ckpt) -> None:  # noqa: ANN001
    start = {"type": "start", "class_label": 3, "steps": 6, "seed": 11, "frames": 4, "fps": 12,
             "preview_every": 2, "preview_size": 32, "preview": "latent2rgb"}
    msgs, code = await session(f"{live.ws}/v1/video", start)
    assert code == 1000
    assert [m["type"] for m in msgs] == ["ready", "preview", "preview", "final", "done"], msgs
    ready = msgs[0]
    assert (ready["frames"], ready["fps"], ready["size"], ready["seed"], ready["preview_size"]) == (4, 12, SIZE, 11, 32)
    assert [(m["step"], m["of"], m["frames"]) for m in msgs[1:3]] == [(2, 6, 4), (4, 6, 4)]
    for p in msgs[1:3]:
        assert jpeg(p["image"]).shape == (32, 4 * 32, 3)  # F frames of preview_size side by side
    final = msgs[3]
    assert (final["frames"], final["fps"]) == (4, 12) and msgs[2]["ms"] <= final["ms"]
    got, fps = from_mp4(final["video"])
    assert fps == 12 and got.shape == (4, 3, SIZE, SIZE)
    got = got.permute(0, 2, 3, 1).numpy()
    want = offline_frames(ckpt, 3, 11, 4, 6, 4.0)
    assert np.abs(got.astype(int) - want).mean() < MAX_MEAN_RGB_DIFF
    assert np.abs(luma(got) - luma(want)).mean() < MAX_MEAN_LUMA_DIFF
    for f in range(4):  # in order: each decoded frame is nearest its own offline frame
        dist = [np.abs(luma(got[f]) - luma(want[k])).mean() for k in range(4)]
        assert int(np.argmin(dist)) == f, dist
    st = msgs[-1]["stats"]
    assert st["steps"] == 6 and st["previews"] == 2 and not st["cancelled"] and st["seed"] == 11


async def test_json_frames_defaults_and_taesd(live) -> None:  # noqa: ANN001
    msgs, code = await session(f"{live.ws}/v1/video", {"type": "start", "prompt": "917", "steps": 2, "seed": 1},
                               json_frames=True)
    assert code == 1000 and [m["type"] for m in msgs] == ["ready", "preview", "final", "done"]
    assert (msgs[0]["frames"], msgs[0]["fps"], msgs[0]["preview"]) == (8, 8, "taesd")  # defaults
    assert jpeg(msgs[1]["image"]).shape == (SIZE, 8 * SIZE, 3)
    frames, fps = from_mp4(msgs[2]["video"])  # base64 in JSON, bytes again here
    assert frames.shape == (8, 3, SIZE, SIZE) and fps == 8


async def test_long_strip_is_downscaled(live) -> None:  # noqa: ANN001
    start = {"type": "start", "class_label": 1, "steps": 2, "frames": 32, "preview_size": 128}
    msgs, code = await session(f"{live.ws}/v1/video", start)
    side = MAX_STRIP_WIDTH // 32
    assert code == 1000 and msgs[0]["preview_size"] == side
    assert jpeg(msgs[1]["image"]).shape == (side, 32 * side, 3) and msgs[1]["frames"] == 32
    assert from_mp4(msgs[2]["video"])[0].shape == (32, 3, SIZE, SIZE)


async def test_cancel_stops_within_one_step(live) -> None:  # noqa: ANN001
    start = {"type": "start", "class_label": 1, "frames": 4, "preview_size": 16}
    await check_cancel_within_one_step(live, "/v1/video", start)


async def test_bad_requests_close_with_codes(live) -> None:  # noqa: ANN001
    base = {"type": "start", "class_label": 1, "steps": 2}
    cases = [({**base, "frames": 1}, "bad_field", 1008),  # a clip has at least 2 frames
             ({**base, "frames": 33}, "bad_field", 1008),  # more than this engine makes
             ({**base, "frames": "8"}, "bad_field", 1008),
             ({**base, "fps": 0}, "bad_field", 1008),
             ({**base, "size": 2 * SIZE}, "unsupported", 1003),
             ({**base, "size": f"{SIZE}x{SIZE // 2}"}, "unsupported", 1003),
             ({**base, "class_label": 1000}, "bad_field", 1008)]
    for start, err, close in cases:
        msgs, code = await session(f"{live.ws}/v1/video", start)
        assert [m["type"] for m in msgs] == ["error"] and msgs[0]["code"] == err, (start, msgs)
        assert code == close


async def test_image_and_video_share_the_worker(live) -> None:  # noqa: ANN001
    """Both lanes on the one generator worker: concurrent requests both finish; models are listed."""
    img, vid = await asyncio.gather(
        session(f"{live.ws}/v1/image", {"type": "start", "class_label": 3, "steps": 8, "preview_size": 16}),
        session(f"{live.ws}/v1/video", {"type": "start", "class_label": 3, "steps": 8, "frames": 3,
                                         "preview_size": 16}))
    assert [m["type"] for m in img[0]][-2:] == ["final", "done"] and "image" in img[0][-2]
    assert [m["type"] for m in vid[0]][-2:] == ["final", "done"] and "video" in vid[0][-2]
    async with httpx.AsyncClient(base_url=live.http, timeout=30) as c:
        models = (await c.get("/v1/models")).json()["data"]
    video = [d for d in models if d.get("kind") == "video"]
    assert video and video[0]["id"] == "dit-frames" and video[0]["max_frames"] == 32 and video[0]["size"] == SIZE


async def test_without_imageio_ffmpeg_answers_unsupported(ckpt, piper_backend, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # as if the extra were not installed
    cfg = ServerConfig(warmup=True, video_model=str(ckpt))
    svc = VideoService(cfg)
    with serve(create_app(cfg, tts=piper_backend, services=[svc])) as srv:
        msgs, code = await session(f"{srv.ws}/v1/video", {"type": "start", "class_label": 1})
    assert svc.engine is None  # no weights loaded for a path that cannot answer
    assert [m["type"] for m in msgs] == ["error"] and msgs[0]["code"] == "unsupported" and code == 1003
    assert "imageio-ffmpeg" in msgs[0]["message"] and "realtime[video]" in msgs[0]["message"]


def test_two_dit_lanes_do_not_ask_each_other() -> None:
    """With image and video lanes both up, each lane's speech check skips the other (both hold only
    BACKGROUND jobs; asking would recurse forever) and still sees speech on a third lane."""
    from realtime.image_service import DiTStepLane, ImageJob
    from realtime.protocol.image import ImageParams
    from realtime.scheduler import Job
    from realtime.video_service import VideoStepLane

    sched = type("Sched", (), {})()
    svc = type("S", (), {"max_batch": 4, "scheduler": sched})()
    image, video, speech = DiTStepLane(svc), VideoStepLane(svc), _FakeSpeechLane()  # type: ignore[arg-type]
    sched.lanes = lambda: [image, video, speech]
    for lane in (image, video):
        lane.add(ImageJob(ImageParams(1, 10, 4.0, 0, SIZE, 1, SIZE, "ddim", "latent2rgb"), seed=0))
    assert len(image.ready_jobs()) == 1 and len(video.ready_jobs()) == 1
    speech.add(Job())  # due now
    image._due_at = video._due_at = -1.0
    assert image.speech_due(time.monotonic()) and video.speech_due(time.monotonic())
