"""The OpenAI Realtime API subset served on /v1/realtime, without I/O: client events in (validated,
typed), server events out (plain dicts in the GA schema of ``openai.types.realtime``).

Supported client events: ``session.update``, ``input_audio_buffer.append`` / ``commit`` /
``clear``, ``conversation.item.create`` (text messages), ``conversation.item.truncate``,
``conversation.item.delete`` (an item the conversation still holds; the model no longer sees it),
``conversation.item.retrieve`` (such an item, with its text or transcript),
``response.create``, ``response.cancel``. Any other (valid JSON) event is answered with an
``error`` event by the session and the connection stays open.

Audio formats (``session.audio.{input,output}.format``): ``audio/pcm`` (16-bit little-endian at
24 kHz), ``audio/pcmu`` (G.711 μ-law, 8 kHz), ``audio/pcma`` (G.711 A-law, 8 kHz). The beta
field names (top-level ``input_audio_format: "pcm16" | "g711_ulaw" | "g711_alaw"``,
``turn_detection``, ``voice``) are accepted too, since many deployed clients still send them.
"""

from __future__ import annotations

import base64
import binascii
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any

from realtime.errors import ProtocolError, RealtimeError, UnsupportedError
from realtime.protocol.asr import MAX_PROMPT_CHARS

# wire format name -> (our sample format, sample rate)
AUDIO_FORMATS: dict[str, tuple[str, int]] = {
    "audio/pcm": ("pcm_s16le", 24000),
    "audio/pcmu": ("mulaw", 8000),
    "audio/pcma": ("alaw", 8000),
}
BETA_FORMATS = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}
MAX_INSTRUCTIONS = 8000
MAX_ITEM_TEXT = 8000
MAX_OUTPUT_TOKENS = 4096

CLIENT_EVENTS = ("session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
                 "input_audio_buffer.clear", "conversation.item.create", "conversation.item.truncate",
                 "conversation.item.delete", "conversation.item.retrieve", "response.create", "response.cancel")
# Part of the API, not served here: answered with an 'unsupported' error, not 'unknown event'.
KNOWN_UNSUPPORTED = ("output_audio_buffer.clear",
                     "transcription_session.update", "session.close")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


# ---- session configuration ---------------------------------------------------------------------

@dataclass(frozen=True)
class TurnDetection:
    """server_vad settings. ``threshold`` / ``silence_duration_ms`` / ``prefix_padding_ms`` are
    validated and echoed; the agent applies what its VAD supports (see docs/agent.md)."""

    type: str = "server_vad"
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, "threshold": self.threshold, "prefix_padding_ms": self.prefix_padding_ms,
                "silence_duration_ms": self.silence_duration_ms, "create_response": self.create_response,
                "interrupt_response": self.interrupt_response, "idle_timeout_ms": None}


@dataclass(frozen=True)
class SessionConfig:
    model: str = "realtime-agent"
    instructions: str | None = None  # None: the agent's default system prompt
    voice: str | None = None  # None: the TTS backend's default voice
    input_format: str = "audio/pcm"
    output_format: str = "audio/pcm"
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    max_output_tokens: int | None = None
    transcription_model: str | None = "whisper"
    transcription_prompt: str | None = None  # text before the user's speech in every decode (names, spellings)
    transcription_language: str | None = None  # the user's language (None: the model's default or detection)

    @property
    def input_codec(self) -> tuple[str, int]:
        return AUDIO_FORMATS[self.input_format]

    @property
    def output_codec(self) -> tuple[str, int]:
        return AUDIO_FORMATS[self.output_format]


def _fmt_wire(name: str) -> dict[str, Any]:
    return {"type": name, "rate": 24000} if name == "audio/pcm" else {"type": name}


def session_object(cfg: SessionConfig, session_id: str, voice_default: str) -> dict[str, Any]:
    """The ``session`` object of session.created / session.updated."""
    return {
        "type": "realtime", "object": "realtime.session", "id": session_id, "model": cfg.model,
        "output_modalities": ["audio"], "instructions": cfg.instructions or "",
        "max_output_tokens": cfg.max_output_tokens if cfg.max_output_tokens is not None else "inf",
        "tools": [], "tool_choice": "none",
        "audio": {
            "input": {"format": _fmt_wire(cfg.input_format), "noise_reduction": None,
                      "transcription": ({"model": cfg.transcription_model, "prompt": cfg.transcription_prompt or "",
                                         "language": cfg.transcription_language}
                                        if cfg.transcription_model is not None else None),
                      "turn_detection": cfg.turn_detection.to_wire() if cfg.turn_detection else None},
            "output": {"format": _fmt_wire(cfg.output_format), "voice": cfg.voice or voice_default, "speed": 1.0},
        },
    }


def _language(value: Any, languages: Collection[str] | None) -> str | None:
    """transcription.language: a code the model takes (``languages``), or absent / blank: none."""
    if value is None or value == "":
        return None
    param = "session.audio.input.transcription.language"
    if not isinstance(value, str):
        raise _bad("'language' must be a string", "invalid_type", param)
    code = value.strip().lower()
    if languages is not None and code not in languages:
        raise UnsupportedError(f"transcription language '{code[:12]}' is not supported by this model; use "
                               f"{', '.join(sorted(languages)[:12])}")
    return code


def _prompt(value: Any) -> str | None:
    """transcription.prompt: text (at most MAX_PROMPT_CHARS, as /v1/asr's), blank or absent: none."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise _bad("'prompt' must be a string", "invalid_type", "session.audio.input.transcription.prompt")
    if len(value) > MAX_PROMPT_CHARS:
        raise _bad(f"'prompt' may hold at most {MAX_PROMPT_CHARS} characters", "invalid_value",
                   "session.audio.input.transcription.prompt")
    return value.strip() or None


def _bad(message: str, code: str = "invalid_value", param: str | None = None) -> ProtocolError:
    exc = ProtocolError(message, code=code)
    exc.param = param  # type: ignore[attr-defined]
    return exc


def _get(obj: dict[str, Any], name: str, kind: type | tuple[type, ...], path: str) -> Any:
    if name not in obj or obj[name] is None:
        return None
    v = obj[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(v, bool) and bool not in kinds:
        raise _bad(f"'{path}.{name}' has the wrong type", "invalid_type", f"{path}.{name}")
    if not isinstance(v, kinds):
        raise _bad(f"'{path}.{name}' has the wrong type", "invalid_type", f"{path}.{name}")
    return v


def _format(value: Any, param: str) -> str:
    if isinstance(value, str):  # beta: "pcm16"; some clients send the GA type as a bare string
        name = BETA_FORMATS.get(value, value)
        rate = None
    elif isinstance(value, dict):
        name = value.get("type", "audio/pcm")
        rate = value.get("rate")
    else:
        raise _bad(f"'{param}' must be an audio format object", "invalid_type", param)
    if name not in AUDIO_FORMATS:
        raise UnsupportedError(f"audio format '{str(name)[:30]}' is not supported; use audio/pcm (24 kHz), "
                               "audio/pcmu or audio/pcma")
    if rate is not None and (isinstance(rate, bool) or rate != AUDIO_FORMATS[name][1]):
        raise UnsupportedError(f"{name} is served at {AUDIO_FORMATS[name][1]} Hz only")
    return name


def _turn_detection(value: Any, current: TurnDetection | None, param: str) -> TurnDetection | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad(f"'{param}' must be an object or null", "invalid_type", param)
    kind = value.get("type", "server_vad")
    if kind != "server_vad":
        raise UnsupportedError(f"turn_detection type '{str(kind)[:20]}' is not supported; use server_vad or null")
    td = current or TurnDetection()
    thr = _get(value, "threshold", (int, float), param)
    if thr is not None and not 0.0 <= thr <= 1.0:
        raise _bad("threshold must be between 0.0 and 1.0", param=f"{param}.threshold")
    pre = _get(value, "prefix_padding_ms", int, param)
    if pre is not None and not 0 <= pre <= 5000:
        raise _bad("prefix_padding_ms must be between 0 and 5000", param=f"{param}.prefix_padding_ms")
    sil = _get(value, "silence_duration_ms", int, param)
    if sil is not None and not 0 <= sil <= 10000:
        raise _bad("silence_duration_ms must be between 0 and 10000", param=f"{param}.silence_duration_ms")
    create = _get(value, "create_response", bool, param)
    interrupt = _get(value, "interrupt_response", bool, param)
    return replace(td, threshold=float(td.threshold if thr is None else thr),
                   prefix_padding_ms=td.prefix_padding_ms if pre is None else pre,
                   silence_duration_ms=td.silence_duration_ms if sil is None else sil,
                   create_response=td.create_response if create is None else create,
                   interrupt_response=td.interrupt_response if interrupt is None else interrupt)


def _max_tokens(value: Any, param: str) -> int | None:
    if value is None or value == "inf":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_OUTPUT_TOKENS:
        raise _bad(f"'{param}' must be an integer between 1 and {MAX_OUTPUT_TOKENS} or 'inf'", param=param)
    return value


def _voice(value: Any, param: str) -> str | None:
    if isinstance(value, dict):
        value = value.get("id")
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > 64:
        raise _bad(f"'{param}' must be a voice name", "invalid_type", param)
    return value


def apply_session_update(cfg: SessionConfig, session: Any, *, voice_locked: bool = False,
                         languages: Collection[str] | None = None) -> SessionConfig:
    """``session.update``'s ``session`` object applied to ``cfg`` (fields absent: unchanged).
    ``languages``: the codes the transcription model takes (None: any)."""
    if not isinstance(session, dict):
        raise _bad("'session' must be an object", "invalid_type", "session")
    kind = session.get("type", "realtime")
    if kind != "realtime":
        raise UnsupportedError(f"session type '{str(kind)[:20]}' is not supported here; use 'realtime'")
    mods = session.get("output_modalities", session.get("modalities"))
    if mods is not None:
        if not isinstance(mods, list) or not mods or any(m not in ("audio", "text") for m in mods):
            raise _bad("'session.output_modalities' must be a list of 'audio' / 'text'", param="session.output_modalities")
        if "audio" not in mods:
            raise UnsupportedError("text-only output is not supported on /v1/realtime; use /v1/text")
    if session.get("tools"):
        raise UnsupportedError("tools (function calling) are not supported by this agent")
    out = cfg
    model = _get(session, "model", str, "session")
    if model is not None:
        out = replace(out, model=model[:64])
    instr = _get(session, "instructions", str, "session")
    if instr is not None:
        if len(instr) > MAX_INSTRUCTIONS:
            raise _bad(f"instructions may hold at most {MAX_INSTRUCTIONS} characters", "too_long",
                       "session.instructions")
        out = replace(out, instructions=instr)
    if "max_output_tokens" in session or "max_response_output_tokens" in session:
        v = session.get("max_output_tokens", session.get("max_response_output_tokens"))
        out = replace(out, max_output_tokens=_max_tokens(v, "session.max_output_tokens"))
    audio = _get(session, "audio", dict, "session") or {}
    inp = _get(audio, "input", dict, "session.audio") or {}
    outp = _get(audio, "output", dict, "session.audio") or {}
    # beta names first, GA names override
    fmt_in = session.get("input_audio_format", inp.get("format"))
    if "format" in inp:
        fmt_in = inp["format"]
    if fmt_in is not None:
        out = replace(out, input_format=_format(fmt_in, "session.audio.input.format"))
    fmt_out = outp["format"] if "format" in outp else session.get("output_audio_format")
    if fmt_out is not None:
        out = replace(out, output_format=_format(fmt_out, "session.audio.output.format"))
    has_voice = "voice" in outp or "voice" in session
    if has_voice:
        voice = _voice(outp["voice"] if "voice" in outp else session["voice"], "session.audio.output.voice")
        if voice_locked and voice != cfg.voice:
            raise ProtocolError("the voice cannot change once the agent has spoken", code="voice_locked")
        out = replace(out, voice=voice)
    if "turn_detection" in inp or "turn_detection" in session:
        td = inp["turn_detection"] if "turn_detection" in inp else session["turn_detection"]
        out = replace(out, turn_detection=_turn_detection(td, cfg.turn_detection,
                                                          "session.audio.input.turn_detection"))
    if "transcription" in inp or "input_audio_transcription" in session:
        tr = inp["transcription"] if "transcription" in inp else session["input_audio_transcription"]
        if tr is not None and not isinstance(tr, dict):
            raise _bad("'transcription' must be an object or null", "invalid_type", "session.audio.input.transcription")
        out = replace(out, transcription_model=None if tr is None else str(tr.get("model") or "whisper")[:64],
                      transcription_prompt=None if tr is None else _prompt(tr.get("prompt")),
                      transcription_language=None if tr is None else _language(tr.get("language"), languages))
    return out


# ---- client events ------------------------------------------------------------------------------

@dataclass(frozen=True)
class SessionUpdate:
    session: dict[str, Any]


@dataclass(frozen=True)
class AudioAppend:
    audio: bytes


@dataclass(frozen=True)
class AudioCommit:
    pass


@dataclass(frozen=True)
class AudioClear:
    pass


@dataclass(frozen=True)
class ItemCreate:
    role: str  # "user" | "assistant" | "system"
    text: str
    item_id: str | None
    previous_item_id: str | None


@dataclass(frozen=True)
class ItemTruncate:
    item_id: str
    content_index: int
    audio_end_ms: int


@dataclass(frozen=True)
class ItemDelete:
    item_id: str


@dataclass(frozen=True)
class ItemRetrieve:
    item_id: str


@dataclass(frozen=True)
class ResponseCreate:
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    conversation: str = "auto"  # "none": out of band, the reply is not added to the history
    extra_input: tuple[dict[str, str], ...] = ()  # response.input text messages (out-of-band prompts)


@dataclass(frozen=True)
class ResponseCancel:
    response_id: str | None


ClientEvent = (SessionUpdate | AudioAppend | AudioCommit | AudioClear | ItemCreate | ItemTruncate | ItemDelete
               | ItemRetrieve | ResponseCreate | ResponseCancel)


def _item_text(item: dict[str, Any], param: str) -> tuple[str, str]:
    if item.get("type", "message") != "message":
        raise UnsupportedError(f"conversation items of type '{str(item.get('type'))[:30]}' are not supported; "
                               "send a message")
    role = item.get("role")
    if role not in ("user", "assistant", "system"):
        raise _bad("item.role must be user, assistant or system", param=f"{param}.role")
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise _bad("item.content must be a non-empty list", "invalid_type", f"{param}.content")
    parts = []
    for p in content:
        if not isinstance(p, dict):
            raise _bad("content parts must be objects", "invalid_type", f"{param}.content")
        kind = p.get("type")
        if kind in ("input_text", "output_text", "text"):
            text = p.get("text")
        elif kind in ("output_audio", "input_audio") and isinstance(p.get("transcript"), str) and "audio" not in p:
            text = p.get("transcript")
        else:
            raise UnsupportedError(f"content parts of type '{str(kind)[:30]}' are not supported; send text")
        if not isinstance(text, str):
            raise _bad("a text content part needs 'text'", "invalid_type", f"{param}.content")
        parts.append(text)
    text = "".join(parts)
    if len(text) > MAX_ITEM_TEXT:
        raise _bad(f"an item may hold at most {MAX_ITEM_TEXT} characters", "too_long", f"{param}.content")
    return role, text


def parse_client_event(msg: dict[str, Any]) -> ClientEvent:
    """One client event → a typed event. Raises ProtocolError / UnsupportedError (the session
    answers those with an ``error`` event; the connection stays open)."""
    kind = msg.get("type")
    if not isinstance(kind, str):
        raise _bad("an event needs a string 'type'", "missing_required_parameter", "type")
    if kind in KNOWN_UNSUPPORTED:
        raise UnsupportedError(f"'{kind}' is not supported by this server")
    if kind not in CLIENT_EVENTS:
        raise _bad(f"unknown event type '{kind[:60]}'", "unknown_event", "type")
    if kind == "session.update":
        s = msg.get("session")
        if not isinstance(s, dict):
            raise _bad("session.update needs a 'session' object", "missing_required_parameter", "session")
        return SessionUpdate(s)
    if kind == "input_audio_buffer.append":
        data = msg.get("audio")
        if isinstance(data, str):
            try:
                data = base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError):
                raise _bad("'audio' is not valid base64", "invalid_value", "audio") from None
        if isinstance(data, (bytearray, memoryview)):
            data = bytes(data)
        if not isinstance(data, bytes):
            raise _bad("input_audio_buffer.append needs base64 'audio'", "missing_required_parameter", "audio")
        return AudioAppend(data)
    if kind == "input_audio_buffer.commit":
        return AudioCommit()
    if kind == "input_audio_buffer.clear":
        return AudioClear()
    if kind == "conversation.item.create":
        item = msg.get("item")
        if not isinstance(item, dict):
            raise _bad("conversation.item.create needs an 'item' object", "missing_required_parameter", "item")
        role, text = _item_text(item, "item")
        iid = item.get("id")
        prev = msg.get("previous_item_id")
        return ItemCreate(role, text, iid if isinstance(iid, str) and iid else None,
                          prev if isinstance(prev, str) else None)
    if kind == "conversation.item.truncate":
        iid = msg.get("item_id")
        end = msg.get("audio_end_ms")
        ci = msg.get("content_index", 0)
        if not isinstance(iid, str) or not iid:
            raise _bad("conversation.item.truncate needs 'item_id'", "missing_required_parameter", "item_id")
        if isinstance(end, bool) or not isinstance(end, int) or end < 0:
            raise _bad("'audio_end_ms' must be a non-negative integer", "invalid_value", "audio_end_ms")
        if isinstance(ci, bool) or not isinstance(ci, int) or ci != 0:
            raise _bad("'content_index' must be 0 (one audio part per item)", "invalid_value", "content_index")
        return ItemTruncate(iid, ci, end)
    if kind in ("conversation.item.delete", "conversation.item.retrieve"):
        iid = msg.get("item_id")
        if not isinstance(iid, str) or not iid:
            raise _bad(f"{kind} needs 'item_id'", "missing_required_parameter", "item_id")
        return ItemDelete(iid) if kind == "conversation.item.delete" else ItemRetrieve(iid)
    if kind == "response.create":
        r = msg.get("response") or {}
        if not isinstance(r, dict):
            raise _bad("'response' must be an object", "invalid_type", "response")
        if r.get("tools"):
            raise UnsupportedError("tools (function calling) are not supported by this agent")
        mods = r.get("output_modalities", r.get("modalities"))
        if mods is not None and (not isinstance(mods, list) or "audio" not in mods):
            raise UnsupportedError("text-only responses are not supported on /v1/realtime; use /v1/text")
        instr = _get(r, "instructions", str, "response")
        if instr is not None and len(instr) > MAX_INSTRUCTIONS:
            raise _bad(f"instructions may hold at most {MAX_INSTRUCTIONS} characters", "too_long",
                       "response.instructions")
        meta = r.get("metadata")
        if meta is not None and (not isinstance(meta, dict) or len(meta) > 16 or
                                 any(not isinstance(k, str) or not isinstance(v, str) or len(k) > 64 or len(v) > 512
                                     for k, v in meta.items())):
            raise _bad("metadata must map up to 16 strings to strings", param="response.metadata")
        conv = r.get("conversation", "auto")
        if conv not in ("auto", "none"):
            raise UnsupportedError("response.conversation must be 'auto' or 'none'")
        extra = []
        for i, item in enumerate(r.get("input") or []):
            if not isinstance(item, dict):
                raise _bad("response.input holds items", "invalid_type", "response.input")
            role, text = _item_text(item, f"response.input[{i}]")
            extra.append({"role": role, "content": text})
        tokens = _max_tokens(r.get("max_output_tokens", r.get("max_response_output_tokens")),
                             "response.max_output_tokens")
        return ResponseCreate(instr, tokens, meta, conv, tuple(extra))
    rid = msg.get("response_id")
    return ResponseCancel(rid if isinstance(rid, str) and rid else None)


# ---- server events ------------------------------------------------------------------------------

def event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "event_id": new_id("event"), **fields}


def error_event(exc: RealtimeError, client_event_id: str | None = None) -> dict[str, Any]:
    kind = "server_error" if exc.code in ("internal", "overloaded") else "invalid_request_error"
    return event("error", error={"type": kind, "code": exc.code, "message": exc.message,
                                 "param": getattr(exc, "param", None), "event_id": client_event_id})


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def assistant_item(item_id: str, status: str, transcript: str | None) -> dict[str, Any]:
    content = [] if transcript is None else [{"type": "output_audio", "transcript": transcript}]
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": "assistant",
            "status": status, "content": content}


def text_item(item_id: str, role: str, text: str) -> dict[str, Any]:
    """A completed message item with one text part (input_text for user and system, output_text for
    the assistant), as conversation.item.create makes."""
    part = {"type": "output_text" if role == "assistant" else "input_text", "text": text}
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": role, "status": "completed",
            "content": [part]}


def user_item(item_id: str, status: str, transcript: str | None, *, text: bool = False) -> dict[str, Any]:
    if text:
        content = [{"type": "input_text", "text": transcript or ""}]
    else:
        content = [{"type": "input_audio", "transcript": transcript}]
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": "user", "status": status,
            "content": content}


def response_object(response_id: str, status: str, cfg: SessionConfig, voice: str, *,
                    output: list[dict[str, Any]] | None = None, usage: dict[str, Any] | None = None,
                    status_details: dict[str, Any] | None = None, metadata: dict[str, str] | None = None,
                    metrics: dict[str, Any] | None = None, conversation: str = "auto") -> dict[str, Any]:
    obj: dict[str, Any] = {
        "id": response_id, "object": "realtime.response", "status": status, "status_details": status_details,
        "output": output or [], "conversation_id": "conv_default" if conversation == "auto" else None,
        "output_modalities": ["audio"], "metadata": metadata,
        "max_output_tokens": cfg.max_output_tokens if cfg.max_output_tokens is not None else "inf",
        "audio": {"output": {"format": _fmt_wire(cfg.output_format), "voice": voice}},
        "usage": usage,
    }
    if metrics is not None:
        obj["realtime_metrics"] = metrics  # our extension: per-turn latency metrics (docs/agent.md)
    return obj


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"total_tokens": prompt_tokens + completion_tokens, "input_tokens": prompt_tokens,
            "output_tokens": completion_tokens,
            "input_token_details": {"text_tokens": prompt_tokens, "audio_tokens": 0, "cached_tokens": 0},
            "output_token_details": {"text_tokens": completion_tokens, "audio_tokens": 0}}
