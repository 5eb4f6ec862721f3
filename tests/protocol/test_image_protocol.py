"""The /v1/image and /v1/video protocol state machine, sans-I/O."""

from __future__ import annotations

import pytest

from realtime.errors import ProtocolError, StateError, UnsupportedError
from realtime.protocol.image import (
    Cancel,
    ImageProtocol,
    ModelInfo,
    SessionState,
    Start,
    parse_generation,
    parse_start,
)

INFO = ModelInfo(image_size=256, num_classes=1000, has_taesd=False, max_steps=250)


def start(**kw):  # noqa: ANN201
    return {"type": "start", "class_label": 207, **kw}


def test_defaults_and_fields() -> None:
    p = parse_start(start(), INFO)
    assert (p.class_label, p.steps, p.guidance, p.seed, p.size) == (207, 50, 4.0, None, 256)
    assert (p.preview_every, p.preview_size, p.sampler, p.preview) == (1, 256, "ddim", "latent2rgb")
    p = parse_start(start(steps=10, guidance=1, seed=7, size="256x256", preview_every=3, preview_size=64,
                          sampler="euler"), INFO)
    assert (p.steps, p.guidance, p.seed, p.preview_every, p.preview_size, p.sampler) == (10, 1.0, 7, 3, 64, "euler")
    assert parse_start(start(), ModelInfo(256, has_taesd=True)).preview == "taesd"


def test_prompt_must_be_a_class_index() -> None:
    assert parse_start({"type": "start", "prompt": " 88 "}, INFO).class_label == 88
    with pytest.raises(UnsupportedError) as e:
        parse_start({"type": "start", "prompt": "a photo of a cat"}, INFO)
    assert e.value.close_code == 1003 and e.value.code == "unsupported"
    with pytest.raises(ProtocolError) as e:
        parse_start({"type": "start"}, INFO)
    assert e.value.code == "missing_field"


@pytest.mark.parametrize("label", [-1, 1000, 5000])
def test_bad_class_label(label: int) -> None:
    with pytest.raises(ProtocolError) as e:
        parse_start(start(class_label=label), INFO)
    assert e.value.code == "bad_field" and e.value.close_code == 1008
    with pytest.raises(ProtocolError):
        parse_start({"type": "start", "prompt": str(label)}, INFO)


@pytest.mark.parametrize("bad", [{"class_label": "7"}, {"class_label": True}, {"steps": 2.5},
                                 {"guidance": "x"}, {"size": [256]}, {"size": "big"}])
def test_wrong_types(bad: dict) -> None:
    with pytest.raises(ProtocolError) as e:
        parse_start({**start(), **bad}, INFO)
    assert e.value.code == "bad_field"


@pytest.mark.parametrize("steps", [0, -3, 251, 10_000])
def test_steps_out_of_range(steps: int) -> None:
    with pytest.raises(ProtocolError) as e:
        parse_start(start(steps=steps), INFO)
    assert e.value.code == "bad_field"
    assert parse_start(start(steps=250), INFO).steps == 250


@pytest.mark.parametrize("kw", [dict(guidance=-1), dict(guidance=21), dict(guidance=float("nan")),
                                dict(preview_every=-1), dict(preview_size=8), dict(preview_size=4096),
                                dict(seed=-1)])
def test_other_ranges(kw: dict) -> None:
    with pytest.raises(ProtocolError) as e:
        parse_start(start(**kw), INFO)
    assert e.value.code == "bad_field"


@pytest.mark.parametrize("size", [512, "512x512", "256x128"])
def test_wrong_size_is_unsupported(size) -> None:  # noqa: ANN001
    with pytest.raises(UnsupportedError) as e:
        parse_start(start(size=size), INFO)
    assert e.value.close_code == 1003


def test_unsupported_sampler_and_preview() -> None:
    with pytest.raises(UnsupportedError):
        parse_start(start(sampler="dpm++"), INFO)
    with pytest.raises(UnsupportedError):
        parse_start(start(preview="taesd"), INFO)  # this model has no preview decoder
    with pytest.raises(UnsupportedError):
        parse_start(start(preview="vae"), INFO)


def test_unknown_type_and_missing_type() -> None:
    p = ImageProtocol(INFO)
    with pytest.raises(ProtocolError) as e:
        p.receive({"type": "paint"})
    assert e.value.code == "unknown_type"
    with pytest.raises(ProtocolError) as e:
        p.receive({"class_label": 1})
    assert e.value.code == "missing_field"


def test_state_machine_cancel() -> None:
    p = ImageProtocol(INFO)
    with pytest.raises(StateError):
        p.receive({"type": "cancel"})  # nothing to cancel yet
    ev = p.receive(start(steps=5))
    assert isinstance(ev, Start) and ev.params.steps == 5 and p.state is SessionState.GENERATING
    with pytest.raises(StateError):
        p.receive(start())  # one request per connection
    assert isinstance(p.receive({"type": "cancel"}), Cancel)
    assert p.state is SessionState.CANCELLED
    with pytest.raises(StateError) as e:
        p.receive({"type": "cancel"})
    assert e.value.code == "bad_state"


def test_state_machine_done_and_fail() -> None:
    p = ImageProtocol(INFO)
    p.receive(start())
    p.finished()
    assert p.state is SessionState.DONE
    with pytest.raises(StateError):
        p.receive({"type": "cancel"})
    q = ImageProtocol(INFO)
    with pytest.raises(ProtocolError):
        q.receive(start(steps=0))
    assert q.state is SessionState.AWAIT_START  # a refused start changes nothing; the session fails it
    q.fail()
    assert q.state is SessionState.FAILED


def test_video_without_model_is_unsupported() -> None:
    p = ImageProtocol(None, kind="video")
    with pytest.raises(UnsupportedError) as e:
        p.receive({"type": "start", "class_label": 1, "frames": 16, "fps": 8})
    assert e.value.message == "no video model loaded"
    with pytest.raises(ProtocolError) as e:  # video fields are still checked first
        parse_start({"type": "start", "frames": 0}, None, kind="video")
    assert e.value.code == "bad_field"
    with pytest.raises(UnsupportedError):  # an image model does not make videos
        parse_start(start(), INFO, kind="video")


def test_video_fields_against_the_model() -> None:
    video = ModelInfo(image_size=256, kind="video", max_frames=32)
    p = parse_start(start(), video, kind="video")
    assert (p.frames, p.fps, p.size) == (8, 8, 256)  # defaults
    p = parse_start(start(frames=32, fps=24), video, kind="video")
    assert (p.frames, p.fps) == (32, 24)
    for bad in (dict(frames=1), dict(frames=33), dict(frames=257), dict(fps=61), dict(frames=2.5)):
        with pytest.raises(ProtocolError) as e:
            parse_start(start(**bad), video, kind="video")
        assert e.value.code == "bad_field", bad
    short = ModelInfo(image_size=256, kind="video", max_frames=4)
    assert parse_start(start(), short, kind="video").frames == 4  # the default shrinks to what the model makes
    with pytest.raises(UnsupportedError):  # a video model does not make images
        parse_start(start(), video)
    p = ImageProtocol(None, kind="video", unavailable="video output needs imageio-ffmpeg: pip install x")
    with pytest.raises(UnsupportedError) as e:
        p.receive(start())
    assert e.value.message.startswith("video output needs imageio-ffmpeg")


def test_generation_body() -> None:
    p, n = parse_generation({"prompt": "3", "n": 2, "size": "256x256", "response_format": "b64_json"}, INFO)
    assert (p.class_label, n, p.preview_every) == (3, 2, 0)
    for bad in ({"prompt": "3", "n": 5}, {"prompt": "3", "n": 0}):
        with pytest.raises(ProtocolError):
            parse_generation(bad, INFO)
    with pytest.raises(UnsupportedError):
        parse_generation({"prompt": "3", "response_format": "url"}, INFO)
    with pytest.raises(UnsupportedError):
        parse_generation({"prompt": "a cat"}, INFO)
    with pytest.raises(UnsupportedError):
        parse_generation({"prompt": "3", "size": "1024x1024"}, INFO)
