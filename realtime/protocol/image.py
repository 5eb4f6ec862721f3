"""The /v1/image and /v1/video session protocol as a state machine: messages in, typed events out. No I/O.

One request per connection. States::

    AWAIT_START --start--> GENERATING --(final sent)--> DONE
                               |
                               +--cancel--> CANCELLED
    any state --protocol error--> FAILED

Client → server: ``start`` (see ``parse_start``), ``cancel``. Server → client: ``ready``, ``preview``
(per ``preview_every`` steps), ``final``, ``done``, ``error`` (docs/image.md). /v1/video is the same
session: previews are JPEG frame strips (``preview {image, frames}``), the final is an MP4
(``final {video, frames, fps}``); ``parse_start(..., kind="video")`` checks its extra fields
(``frames`` up to the model's ``max_frames``, ``fps``).

The HTTP endpoint ``POST /v1/images/generations`` (OpenAI-style) is parsed by ``parse_generation``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from realtime.errors import ProtocolError, StateError, UnsupportedError

MAX_STEPS = 250  # a served request; offline generation may use up to the schedule's length
DEFAULT_STEPS = 50
DEFAULT_GUIDANCE = 4.0
MAX_GUIDANCE = 20.0
MIN_PREVIEW_SIZE, MAX_PREVIEW_SIZE = 16, 1024
SAMPLERS = ("ddim", "euler")
PREVIEW_KINDS = ("latent2rgb", "taesd")
MAX_N = 4  # images per HTTP request
MAX_SEED = 2**63 - 1
MIN_VIDEO_FRAMES, MAX_VIDEO_FRAMES, DEFAULT_FRAMES = 2, 256, 8  # a 1-frame clip is an image; a model may allow fewer
MAX_FPS, DEFAULT_FPS = 60, 8


class SessionState(str, Enum):
    AWAIT_START = "await_start"
    GENERATING = "generating"
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass(frozen=True)
class ModelInfo:
    """What the loaded model can do (the protocol validates against it)."""

    image_size: int  # pixels per side of the final image
    num_classes: int = 1000
    has_taesd: bool = False
    max_steps: int = MAX_STEPS
    kind: str = "image"  # "image" | "video"
    max_frames: int = 1  # video: frames per clip this model can make


@dataclass(frozen=True)
class ImageParams:
    class_label: int
    steps: int
    guidance: float
    seed: int | None  # None: the server picks one (reported in ready)
    size: int
    preview_every: int  # 0: no previews (final only)
    preview_size: int
    sampler: str
    preview: str  # "latent2rgb" | "taesd"
    frames: int = 1  # video only
    fps: int = 0  # video only


@dataclass(frozen=True)
class Start:
    params: ImageParams


@dataclass(frozen=True)
class Cancel:
    pass


Event = Start | Cancel


def _field(msg: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = msg.get(name)
    if value is None:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise ProtocolError(f"field '{name}' has the wrong type", code="bad_field")
    return value


def _int_in(msg: dict[str, Any], name: str, lo: int, hi: int, default: int | None) -> int | None:
    v = _field(msg, name, int)
    if v is None:
        return default
    if not lo <= v <= hi:
        raise ProtocolError(f"{name} must be between {lo} and {hi}", code="bad_field")
    return v


def class_label_of(msg: dict[str, Any], info: ModelInfo) -> int:
    """``class_label`` (int), else ``prompt``: DiT is class-conditional, so a prompt must be a label index."""
    label = _field(msg, "class_label", int)
    if label is None:
        prompt = _field(msg, "prompt", str)
        if prompt is None:
            raise ProtocolError("'start' needs 'class_label' (or a 'prompt' holding one)", code="missing_field")
        p = prompt.strip()
        if not (p.isascii() and p.isdigit()):
            raise UnsupportedError("this model is class-conditional: the prompt must be an ImageNet class "
                                   f"index 0..{info.num_classes - 1} (text prompts are not supported)")
        label = int(p)
    if not 0 <= label < info.num_classes:
        raise ProtocolError(f"class_label must be between 0 and {info.num_classes - 1}", code="bad_field")
    return label


def _size_of(value: Any, info: ModelInfo) -> int:
    """``size`` as an int side or a "WxH" string; it must equal the model's image size."""
    if value is None:
        return info.image_size
    if isinstance(value, str):
        w, sep, h = value.lower().partition("x")
        if not (sep and w.isdigit() and h.isdigit()):
            raise ProtocolError("size must be an int or a 'WxH' string", code="bad_field")
        if w != h:
            raise UnsupportedError(f"only square images of {info.image_size}x{info.image_size} are supported")
        value = int(w)
    elif isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError("field 'size' has the wrong type", code="bad_field")
    if value != info.image_size:
        raise UnsupportedError(f"this model makes {info.image_size}x{info.image_size} images; "
                               f"size {int(value)} is not supported")
    return value


def parse_start(msg: dict[str, Any], info: ModelInfo | None, kind: str = "image",
                unavailable: str | None = None) -> ImageParams:
    """Validate a start message. ``info`` None: no model of this kind is loaded (→ unsupported, with
    ``unavailable`` as the reason when the server knows one)."""
    if kind == "video":
        frames = _int_in(msg, "frames", MIN_VIDEO_FRAMES, MAX_VIDEO_FRAMES, DEFAULT_FRAMES)
        fps = _int_in(msg, "fps", 1, MAX_FPS, DEFAULT_FPS)
    else:
        frames, fps = 1, 0
    if info is None:
        raise UnsupportedError(unavailable or f"no {kind} model loaded")
    if info.kind != kind:
        raise UnsupportedError(f"the loaded model makes {info.kind}s, not {kind}s")
    if frames is not None and frames > info.max_frames:  # video: this model makes shorter clips
        if msg.get("frames") is not None:
            raise ProtocolError(f"frames must be between {MIN_VIDEO_FRAMES} and {info.max_frames}", code="bad_field")
        frames = info.max_frames  # the default
    label = class_label_of(msg, info)
    steps = _int_in(msg, "steps", 1, info.max_steps, DEFAULT_STEPS)
    g = _field(msg, "guidance", (int, float))
    guidance = DEFAULT_GUIDANCE if g is None else float(g)
    if not 0.0 <= guidance <= MAX_GUIDANCE:  # also refuses NaN
        raise ProtocolError(f"guidance must be between 0 and {MAX_GUIDANCE}", code="bad_field")
    seed = _int_in(msg, "seed", 0, MAX_SEED, None)
    size = _size_of(msg.get("size"), info)
    preview_every = _int_in(msg, "preview_every", 0, info.max_steps, 1)
    preview_size = _int_in(msg, "preview_size", MIN_PREVIEW_SIZE, MAX_PREVIEW_SIZE, info.image_size)
    sampler = _field(msg, "sampler", str) or "ddim"
    if sampler not in SAMPLERS:
        raise UnsupportedError(f"sampler '{sampler[:20]}' is not supported; use one of {', '.join(SAMPLERS)}")
    preview = _field(msg, "preview", str) or ("taesd" if info.has_taesd else "latent2rgb")
    if preview not in PREVIEW_KINDS:
        raise UnsupportedError(f"preview '{preview[:20]}' is not supported; use latent2rgb or taesd")
    if preview == "taesd" and not info.has_taesd:
        raise UnsupportedError("this model has no preview decoder; use preview 'latent2rgb'")
    return ImageParams(class_label=label, steps=steps, guidance=guidance, seed=seed, size=size,
                       preview_every=preview_every, preview_size=preview_size, sampler=sampler,
                       preview=preview, frames=frames, fps=fps)


def parse_generation(body: dict[str, Any], info: ModelInfo) -> tuple[ImageParams, int]:
    """``POST /v1/images/generations``: {prompt, n, size "WxH", response_format "b64_json"} plus our
    extensions (class_label, steps, guidance, seed, sampler) → (params without previews, n)."""
    fmt = _field(body, "response_format", str) or "b64_json"
    if fmt != "b64_json":
        raise UnsupportedError("response_format must be 'b64_json' (this server hosts no image URLs)")
    n = _int_in(body, "n", 1, MAX_N, 1)
    assert n is not None
    msg = {k: body[k] for k in ("class_label", "prompt", "steps", "guidance", "seed", "size", "sampler")
           if k in body}
    msg["preview_every"] = 0
    msg["preview"] = "latent2rgb"
    return parse_start(msg, info), n


class ImageProtocol:
    """Validates client messages against the session state and turns them into events."""

    def __init__(self, info: ModelInfo | None, kind: str = "image", unavailable: str | None = None) -> None:
        self.state = SessionState.AWAIT_START
        self.info = info
        self.kind = kind
        self.unavailable = unavailable  # why no model is loaded, for the 'unsupported' answer

    def receive(self, msg: dict[str, Any]) -> Event:
        kind = msg.get("type")
        if not isinstance(kind, str):
            raise ProtocolError("a message needs a string 'type'", code="missing_field")
        if self.state in (SessionState.DONE, SessionState.CANCELLED, SessionState.FAILED):
            raise StateError(f"'{kind[:40]}' after the session ended (state {self.state.value})")
        if kind == "start":
            if self.state is not SessionState.AWAIT_START:
                raise StateError(f"'start' sent twice (state {self.state.value})")
            params = parse_start(msg, self.info, self.kind, self.unavailable)
            self.state = SessionState.GENERATING
            return Start(params)
        if kind != "cancel":
            raise ProtocolError(f"unknown message type '{kind[:40]}'", code="unknown_type")
        if self.state is SessionState.AWAIT_START:
            raise StateError(f"'cancel' before 'start' (state {self.state.value})")
        self.state = SessionState.CANCELLED
        return Cancel()

    def finished(self) -> None:
        """The final image was sent."""
        if self.state is SessionState.GENERATING:
            self.state = SessionState.DONE

    def fail(self) -> None:
        self.state = SessionState.FAILED


# ---------------------------------------------------------------- server → client messages


def ready(session: str, steps: int, size: int, **extra: Any) -> dict[str, Any]:
    return {"type": "ready", "session": session, "steps": steps, "size": size, **extra}


def preview(step: int, of: int, data: bytes, ms: float, field: str = "image", **extra: Any) -> dict[str, Any]:
    """``step`` counts finished denoising steps (1..of); ``ms`` since the start was accepted."""
    return {"type": "preview", "step": step, "of": of, field: data, "ms": round(ms, 3), **extra}


def final(data: bytes, ms: float, field: str = "image", **extra: Any) -> dict[str, Any]:
    return {"type": "final", field: data, "ms": round(ms, 3), **extra}
