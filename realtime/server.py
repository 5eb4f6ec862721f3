"""The starlette app: routes, auth, lifespan (models load and warm up before the port accepts)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import hmac
import json
import logging
import struct
import time
from pathlib import Path
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from realtime.config import ServerConfig
from realtime.errors import AuthError, ProtocolError, RealtimeError, UnsupportedError
from realtime.metrics import Gauge, Metrics
from realtime.codecs.encoded import FORMATS as ENCODED_FORMATS, encoder
from realtime.protocol.tts import StartParams, parse_start
from realtime.scheduler import Scheduler
from realtime.service import Service
from realtime.sessions import Connection, TTSSession
from realtime.tts import END, SPURT_END, AudioChunk, TTSBackend

log = logging.getLogger("realtime.server")

# OpenAI's voice names: accepted on /v1/audio/speech and mapped to our default voice, so the
# official SDKs work unchanged.
OPENAI_VOICES = frozenset("alloy ash ballad coral echo fable onyx nova sage shimmer verse".split())
SPEECH_FORMATS = {"wav": ("pcm_s16le", "audio/wav"), "pcm": ("pcm_s16le", "audio/pcm"),
                  "mulaw": ("mulaw", "audio/basic"), "mp3": ("pcm_s16le", "audio/mpeg"),
                  "opus": ("pcm_s16le", "audio/ogg"), "flac": ("pcm_s16le", "audio/flac"),
                  "aac": ("pcm_s16le", "audio/aac")}


@dataclass
class AppState:
    config: ServerConfig
    scheduler: Scheduler
    tts: TTSBackend
    metrics: Metrics
    services: dict[str, Service] = field(default_factory=dict)
    sessions: set[asyncio.Task[Any]] = field(default_factory=set)
    websockets: set[WebSocket] = field(default_factory=set)
    accepting: bool = True
    created: int = field(default_factory=lambda: int(time.time()))  # /v1/models' "created" (the models' load)


def load_tts(config: ServerConfig) -> TTSBackend:
    import torch

    dtype = getattr(torch, config.dtype)
    if config.tts_model is None or config.tts_model.endswith(".onnx"):
        from realtime.tts_piper import PiperBackend

        return PiperBackend(config.tts_model, config.generator_device, config.codec_device, dtype)
    from realtime.tts_csm import CSMBackend

    return CSMBackend(config.tts_model, config.generator_device, config.codec_device, dtype,
                      n_slots=config.tts_slots, cuda_graphs=config.cuda_graphs)


def authorized(config: ServerConfig, headers: Any, query: Any) -> bool:
    if config.api_key is None:
        return True
    auth = headers.get("authorization", "")
    token = auth[7:] if auth.lower().startswith("bearer ") else query.get("token", "")
    return hmac.compare_digest(token.encode(), config.api_key.encode())


def default_services(config: ServerConfig) -> list[Service]:
    """The services `realtime serve` runs besides TTS, from the config."""
    out: list[Service] = []
    if config.enable_asr:
        from realtime.asr_service import ASRService

        out.append(ASRService(config))
    if config.enable_text:
        from realtime.text_service import TextService

        out.append(TextService(config))
    if config.image_model:
        from realtime.image_service import ImageService

        out.append(ImageService(config))
    if config.video_model:
        from realtime.video_service import VideoService

        out.append(VideoService(config))
    if config.enable_asr and config.enable_text:
        from realtime.agent_service import AgentService

        out.append(AgentService(config))
    return out


def create_app(config: ServerConfig, tts: TTSBackend | None = None,
               services: list[Service] | None = None) -> Starlette:
    """Build the app. ``tts`` may be given (tests, bench); otherwise it loads at startup.
    ``services`` defaults to what the config enables; pass [] for TTS only."""
    config.check_auth()
    holder: dict[str, AppState] = {}
    svcs = default_services(config) if services is None else services

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        t0 = time.perf_counter()
        backend = tts if tts is not None else await asyncio.to_thread(load_tts, config)
        scheduler = Scheduler({"generator": config.generator_device, "codec": config.codec_device},
                              max_jobs=config.max_streams)
        metrics = Metrics()
        state = AppState(config, scheduler, backend, metrics, services={s.name: s for s in svcs})
        backend._registered(scheduler)
        for svc in svcs:
            log.info("loading %s", svc.name)
            await asyncio.to_thread(svc.load)
            svc.attach(scheduler)
        metrics.gauges.append(Gauge("realtime_active_streams", "Jobs in flight",
                                    lambda: {"": scheduler.active}))
        metrics.gauges.append(Gauge("realtime_lane_ready", "Jobs ready per lane (queue depth)",
                                    lambda: {f'{{lane="{ln.name}"}}': len(ln.ready_jobs())
                                             for ln in scheduler.lanes()}))
        if config.warmup:
            if hasattr(backend, "warmup"):
                await asyncio.to_thread(backend.warmup)
            for svc in svcs:
                await asyncio.to_thread(svc.warmup)
        # The models, tokenizers and libraries loaded above are ~10^5 long-lived objects that a full
        # garbage collection would traverse again and again: ~80 ms holding the GIL on the CPU
        # measured, a stall of every stream at once. Frozen, they are out of the collector's way.
        gc.collect()
        gc.freeze()
        metrics.gc.install()  # what collections remain are timed (realtime_gc_pause_seconds)
        scheduler.start()
        holder["state"] = state
        app.state.realtime = state
        log.info("ready in %.1fs: tts=%s on %s/%s", time.perf_counter() - t0, backend.name,
                 config.generator_device, config.codec_device)
        try:
            yield
        finally:
            # Ordered shutdown: stop accepting, tell clients (1012), wait a little, cancel, stop workers.
            state.accepting = False
            for ws in list(state.websockets):
                try:
                    await ws.close(code=1012, reason="server restarting")
                except Exception:
                    pass
            if state.sessions:
                await asyncio.wait(list(state.sessions), timeout=config.shutdown_timeout_s)
            for task in list(state.sessions):
                task.cancel()
            scheduler.stop()
            metrics.gc.remove()

    def st(request_or_ws: Request | WebSocket) -> AppState:
        return holder["state"]

    async def health(request: Request) -> Response:
        state = st(request)
        return JSONResponse({"status": "ok", "active_streams": state.scheduler.active,
                             "models": [state.tts.describe()]})

    async def metrics(request: Request) -> Response:
        state = st(request)
        if not authorized(config, request.headers, request.query_params):
            return http_error(AuthError("missing or bad API key"), 401)
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    async def models(request: Request) -> Response:
        state = st(request)
        if not authorized(config, request.headers, request.query_params):
            return http_error(AuthError("missing or bad API key"), 401)
        data = [state.tts.describe()] + [d for svc in state.services.values() for d in svc.describe()]
        # OpenAI's model object (its SDKs read id, object, created and owned_by; each describe() has the first two)
        data = [{**d, "created": state.created, "owned_by": "realtime"} for d in data]
        return JSONResponse({"object": "list", "data": data})

    async def tts_ws(ws: WebSocket) -> None:
        await run_websocket(st(ws), ws, lambda state, conn: TTSSession(state, conn).run())

    async def speech(request: Request) -> Response:
        state = st(request)
        if not authorized(config, request.headers, request.query_params):
            return http_error(AuthError("missing or bad API key"), 401)
        try:
            body = await json_body(request, config.max_frame_bytes)
            params, text, media = _speech_params(body, state.tts)
            fmt_name = body.get("response_format", "wav")
            sse = body.get("stream_format", "audio") == "sse"
            # mp3, opus, flac, aac: the PCM through an encoder (codecs/encoded.py; it refuses a
            # format this server's libsndfile or ffmpeg lacks, or a rate the format does not take)
            enc = encoder(fmt_name, params.sample_rate) if fmt_name in ENCODED_FORMATS else None
            try:
                job = state.tts.new_job(params)
            except RealtimeError:
                _drop(enc)
                raise
        except RealtimeError as exc:
            return http_error(exc, 400)
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        job.output.bind(loop, wake)
        try:
            state.tts.submit(state.scheduler, job)
        except RealtimeError as exc:
            _drop(enc)
            return http_error(exc, 503)
        job.push_text(text)
        job.stop()
        state.scheduler.wake()

        async def audio() -> AsyncIterator[bytes]:
            try:
                if fmt_name == "wav":
                    yield _wav_header(params.sample_rate)
                while True:
                    items = await job.output.drain(state.scheduler.wake)
                    for item in items:
                        if item is END:
                            if enc is not None:
                                yield enc.close()
                            return
                        if item is SPURT_END:
                            continue
                        assert isinstance(item, AudioChunk)
                        out = item.data if enc is None else enc.push(item.data)
                        if out:
                            yield out
                    if not job.active and not job.ended:
                        return  # failed or cancelled: end the body early
            finally:
                if job.active:
                    state.scheduler.cancel(job)
                _drop(enc)  # (frees the encoder when the body ended early)

        if not sse:
            return StreamingResponse(audio(), media_type=media)

        async def events() -> AsyncIterator[bytes]:
            # OpenAI's stream_format "sse": the same bytes as base64 speech.audio.delta events, then
            # speech.audio.done with the usage (see _speech_usage); an error event where the audio
            # stopped short (the job failed or was cancelled)
            from realtime.protocol.text import sse as event

            async for part in audio():
                yield event({"type": "speech.audio.delta", "audio": base64.b64encode(part).decode()})
            if job.ended:
                yield event({"type": "speech.audio.done", "usage": _speech_usage(job)})
            else:
                yield event({"type": "error", "error": {"message": "speech stopped before its end", "type": "server_error",
                                                       "code": "speech_failed"}})

        return StreamingResponse(events(), media_type="text/event-stream", headers={"X-Audio-Media-Type": media})

    static_dir = Path(__file__).with_name("static")

    async def index(request: Request) -> Response:
        page = static_dir / "index.html"
        if not page.is_file():
            return PlainTextResponse("realtime: no browser client installed", status_code=404)
        return FileResponse(page, media_type="text/html")

    routes = [
        Route("/", index),
        Mount("/static", StaticFiles(directory=static_dir, check_dir=False), name="static"),
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/v1/models", models),
        Route("/v1/audio/speech", speech, methods=["POST"]),
        WebSocketRoute("/v1/tts", tts_ws),
    ]
    for svc in svcs:
        routes.extend(svc.routes(lambda: holder["state"]))
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={404: _not_found, 405: _method_not_allowed})


async def run_websocket(state: AppState, ws: WebSocket,
                        handler: Callable[[AppState, Connection], Awaitable[None]]) -> None:
    """Auth, accept, track for ordered shutdown, then hand the connection to ``handler``."""
    if not authorized(state.config, ws.headers, ws.query_params):
        await ws.close(code=AuthError.close_code, reason="unauthorized")
        return
    if not state.accepting:
        await ws.close(code=1012, reason="server restarting")
        return
    await ws.accept()
    state.websockets.add(ws)
    task = asyncio.current_task()
    assert task is not None
    state.sessions.add(task)
    try:
        await handler(state, Connection(ws, state.config.max_frame_bytes))
    finally:
        state.sessions.discard(task)
        state.websockets.discard(ws)


async def json_body(request: Request, limit: int) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > limit:
        raise ProtocolError(f"body over {limit} bytes", code="too_large")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ProtocolError("body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ProtocolError("body must be a JSON object", code="invalid_json")
    return body


def _drop(enc: Any) -> None:
    """Close an encoder whose output nobody will read (aac's ffmpeg process ends with it)."""
    if enc is not None:
        with contextlib.suppress(RealtimeError):
            enc.close()


def _speech_params(body: dict[str, Any], tts: TTSBackend) -> tuple[StartParams, str, str]:
    text = body.get("input")
    if not isinstance(text, str) or not text.strip():
        raise ProtocolError("'input' must be a non-empty string", code="missing_field")
    fmt_name = body.get("response_format", "wav")
    if fmt_name not in SPEECH_FORMATS:
        raise UnsupportedError(f"response_format '{str(fmt_name)[:20]}' is not supported; "
                               "use wav, pcm, mulaw, mp3, opus, flac or aac")
    fmt, media = SPEECH_FORMATS[fmt_name]
    sf = body.get("stream_format", "audio")
    if sf not in ("audio", "sse"):
        raise UnsupportedError(f"stream_format '{str(sf)[:20]}' is not supported; use audio or sse")
    if body.get("instructions"):  # (gpt-4o-mini-tts's delivery prompt: our voices take none)
        raise UnsupportedError("'instructions' (a spoken style) are not supported by this server's voices")
    voice = body.get("voice")
    if voice in OPENAI_VOICES:
        voice = None
    rate = {"wav": tts.native_rate, "pcm": 24000, "mulaw": 8000, "mp3": 24000, "opus": 24000,
            "flac": tts.native_rate, "aac": 24000}[fmt_name]
    msg = {"type": "start", "format": fmt, "sample_rate": rate, "voice": voice, "speed": body.get("speed"),
           "seed": body.get("seed")}  # (seed: ours, as /v1/tts's: the same audio for the same seed)
    params = parse_start(msg, tts.native_rate)
    if len(text) > 20_000:
        raise ProtocolError("'input' may hold at most 20000 characters", code="too_long")
    return params, text, media


def _speech_usage(job: Any) -> dict[str, int]:
    """A speech reply's usage in OpenAI's fields: input tokens are the positions the model read (the
    voice's phoneme ids for Piper; for CSM the prompts' text tokens and context frames), output
    tokens the frames it made (Piper's latent frames, CSM's frames of codes)."""
    return {"input_tokens": int(job.input_tokens), "output_tokens": int(job.frames),
            "total_tokens": int(job.input_tokens + job.frames)}


def _wav_header(rate: int) -> bytes:
    """A streaming WAV header: sizes set to the maximum, as players expect for unknown lengths."""
    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt " +
            struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16) + b"data" + struct.pack("<I", 0xFFFFFFFF))


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                405: "invalid_request_error", 503: "overloaded_error"}
# The endpoints a server serves only with a model loaded, and what loads it (for a 404's message)
_OPTIONAL = {"/v1/images/generations": "--image-model", "/v1/image": "--image-model", "/v1/video": "--video-model",
             "/v1/audio/transcriptions": "speech recognition (no --no-asr)", "/v1/asr": "speech recognition (no --no-asr)",
             "/v1/chat/completions": "text generation (no --no-text)", "/v1/text": "text generation (no --no-text)",
             "/v1/completions": "text generation (no --no-text)",
             "/v1/realtime": "speech recognition and text generation",
             "/v1/telephony/twilio": "speech recognition and text generation"}


async def _not_found(request: Request, exc: Exception) -> Response:
    """An unknown HTTP path: OpenAI's error shape, saying what serves the path where it is optional."""
    need = _OPTIONAL.get(request.url.path)
    msg = (f"{request.url.path} is not served here: this server was started without {need}" if need
           else f"no endpoint {request.method} {request.url.path}")
    return http_error(ProtocolError(msg, code="not_found"), 404)


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    return http_error(ProtocolError(f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed"), 405)


def http_error(exc: RealtimeError, status: int) -> Response:
    """An HTTP endpoint's error in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, which
    its SDKs read (``code``: ours, e.g. "unsupported"; ``type`` from the status)."""
    kind = _ERROR_TYPES.get(status, "server_error")
    return JSONResponse({"error": {"message": exc.message, "type": kind, "param": None, "code": exc.code}},
                        status_code=status)
