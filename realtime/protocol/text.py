"""Text generation protocol, sans I/O: /v1/text session states, request validation (shared with the
OpenAI-compatible /v1/chat/completions), stop-string matching and the OpenAI response shapes.

/v1/text states::

    IDLE --start--> GENERATING --(done sent)--> IDLE      (one connection may run many requests)
                        |
                        +--cancel--> IDLE (the server answers with done, finish_reason "cancelled")
    any state --protocol error--> FAILED

A ``cancel`` while IDLE is ignored: the reply may have ended while the cancel was in flight.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

from realtime.errors import ProtocolError, StateError

MAX_MESSAGES = 512
MAX_PROMPT_CHARS = 200_000
MAX_STOPS = 4  # as OpenAI
MAX_STOP_CHARS = 64
MAX_TOKENS_LIMIT = 32_768
MAX_TOP_LOGPROBS = 20  # as OpenAI
ROLES = ("system", "user", "assistant", "tool", "developer")


class TextState(str, Enum):
    IDLE = "idle"
    GENERATING = "generating"
    FAILED = "failed"


@dataclass(frozen=True)
class GenParams:
    """Sampling and stop settings of one request (validated)."""

    max_tokens: int | None = None  # None: until eos or the context is full
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop: tuple[str, ...] = ()
    seed: int | None = None  # None: the server picks one
    # OpenAI's penalties on the reply's own tokens so far: logit -= frequency * count + presence * (count > 0)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # each reply token's log probability under the model (before penalties and temperature), and
    # the top_logprobs most likely tokens at its place
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def filtered(self) -> bool:
        """Does top-k or top-p narrow the vocabulary (the sampler must sort it)?"""
        return self.top_k > 0 or self.top_p < 1.0

    @property
    def penalized(self) -> bool:
        """Does a frequency or presence penalty change the logits?"""
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


@dataclass(frozen=True)
class Request:
    """Exactly one of ``messages`` (chat, rendered with the model's template) or ``prompt`` (raw text)."""

    messages: tuple[dict[str, str], ...] | None
    prompt: str | None
    params: GenParams


@dataclass(frozen=True)
class Start:
    request: Request


@dataclass(frozen=True)
class Cancel:
    pass


Event = Start | Cancel


def _bad(msg: str, code: str = "bad_field") -> ProtocolError:
    return ProtocolError(msg, code=code)


def _num(body: dict[str, Any], name: str, lo: float, hi: float, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise _bad(f"'{name}' must be a number between {lo:g} and {hi:g}")
    return float(v)


def _int(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _bad(f"'{name}' must be an integer between {lo} and {hi}")
    return int(v)


def parse_messages(value: Any) -> tuple[dict[str, str], ...]:
    """OpenAI-style messages → ({"role", "content"}, ...). Content may be a string or a list of
    ``{"type": "text", "text": ...}`` parts (other part types are refused)."""
    if not isinstance(value, list) or not value:
        raise _bad("'messages' must be a non-empty list", "missing_field")
    if len(value) > MAX_MESSAGES:
        raise _bad(f"at most {MAX_MESSAGES} messages")
    out = []
    total = 0
    for m in value:
        if not isinstance(m, dict):
            raise _bad("each message must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise _bad(f"message role must be one of {', '.join(ROLES)}")
        if isinstance(content, list):
            parts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise _bad("only text content parts are supported")
                parts.append(p["text"])
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise _bad("message content must be a string or a list of text parts")
        total += len(content)
        out.append({"role": "system" if role == "developer" else role, "content": content})
    if total > MAX_PROMPT_CHARS:
        raise _bad(f"the messages hold more than {MAX_PROMPT_CHARS} characters", "too_long")
    return tuple(out)


# OpenAI fields that would change what comes back and that this server does not do: refused, not
# ignored (a client asking for them would otherwise get a reply it did not ask for)
_UNSUPPORTED = {
    "logit_bias": "'logit_bias' is not supported",
    "audio": "audio output is not supported here: use /v1/audio/speech or /v1/tts",
    "prediction": "predicted outputs are not supported",
}


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name, why in _UNSUPPORTED.items():
        v = body.get(name)
        if v is not None and v is not False and v != {} and v != 0:
            raise _bad(why, "unsupported")
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind != "text":
            raise _bad("only response_format {'type': 'text'} is supported (no JSON mode)", "unsupported")
    mods = body.get("modalities")
    if mods is not None and mods != ["text"]:
        raise _bad("only modalities ['text'] are supported", "unsupported")


def parse_params(body: dict[str, Any], *, default_temperature: float = 1.0) -> GenParams:
    """Validate sampling fields (same names as OpenAI; ``max_completion_tokens`` is an alias).
    Fields that would change the reply and that are not done here (logit_bias, JSON mode, audio
    output) are refused."""
    _refuse_unsupported(body)
    max_tokens = _int(body, "max_tokens", 1, MAX_TOKENS_LIMIT)
    alias = _int(body, "max_completion_tokens", 1, MAX_TOKENS_LIMIT)
    if max_tokens is None:
        max_tokens = alias
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise _bad("'stop' must be a string or a list of strings")
    if len(stops) > MAX_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise _bad(f"at most {MAX_STOPS} stop strings of 1..{MAX_STOP_CHARS} characters")
    seed = _int(body, "seed", -(2**63), 2**63 - 1)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _bad("'logprobs' must be a boolean")
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    if top and not logprobs:
        raise _bad("'top_logprobs' needs 'logprobs': true")
    return GenParams(
        max_tokens=max_tokens,
        temperature=_num(body, "temperature", 0.0, 2.0, default_temperature),
        top_p=_num(body, "top_p", 0.0, 1.0, 1.0),  # 0 keeps only the most likely token
        top_k=_int(body, "top_k", 0, 1_000_000) or 0,
        stop=stops,
        seed=seed,
        frequency_penalty=_num(body, "frequency_penalty", -2.0, 2.0, 0.0),
        presence_penalty=_num(body, "presence_penalty", -2.0, 2.0, 0.0),
        logprobs=bool(logprobs),
        top_logprobs=top,
    )


def parse_request(body: dict[str, Any]) -> Request:
    """A /v1/text ``start`` body or a chat-completions body → Request."""
    has_m, has_p = body.get("messages") is not None, body.get("prompt") is not None
    if has_m == has_p:
        raise _bad("give exactly one of 'messages' or 'prompt'", "missing_field")
    if has_p:
        prompt = body["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise _bad("'prompt' must be a non-empty string")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise _bad(f"'prompt' holds more than {MAX_PROMPT_CHARS} characters", "too_long")
        return Request(None, prompt, parse_params(body))
    return Request(parse_messages(body["messages"]), None, parse_params(body))


@dataclass(frozen=True)
class ChatRequest:
    request: Request
    model: str | None
    stream: bool
    include_usage: bool


def parse_chat_completion(body: dict[str, Any]) -> ChatRequest:
    """Validate an OpenAI chat.completions body. ``n`` other than 1 and tools are refused."""
    if body.get("messages") is None:
        raise _bad("'messages' is required", "missing_field")
    if body.get("prompt") is not None:
        raise _bad("'prompt' is not a chat-completions field")
    n = body.get("n")
    if n not in (None, 1):
        raise _bad("only n=1 is supported")
    if body.get("tools") or body.get("functions"):
        raise _bad("tools are not supported")
    return ChatRequest(parse_request(body), *_envelope(body))


def _envelope(body: dict[str, Any]) -> tuple[str | None, bool, bool]:
    """An OpenAI body's (model, stream, stream_options.include_usage)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise _bad("'stream_options' must be an object")
    return model, stream, bool(opts.get("include_usage", False))


MAX_LEGACY_LOGPROBS = 5  # as OpenAI's completions endpoint
LEGACY_DEFAULT_MAX_TOKENS = 16  # OpenAI's default there (chat's is "until the end")


def parse_completion(body: dict[str, Any]) -> ChatRequest:
    """Validate an OpenAI (legacy) completions body: one string ``prompt`` (or a list holding one),
    ``max_tokens`` 16 by default as OpenAI's, ``logprobs`` an integer 0..5 (the top alternatives).
    ``n``/``best_of`` other than 1, ``echo`` and ``suffix`` are refused."""
    if body.get("messages") is not None:
        raise _bad("'messages' is a chat-completions field (POST /v1/chat/completions)")
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise _bad("'prompt' must be a string (or a list of one string; token arrays are not supported)")
        prompt = prompt[0]
    for name in ("n", "best_of"):
        if body.get(name) not in (None, 1):
            raise _bad(f"only {name}=1 is supported")
    if body.get("echo"):
        raise _bad("'echo' is not supported", "unsupported")
    if body.get("suffix"):
        raise _bad("'suffix' (insertion) is not supported", "unsupported")
    lp = body.get("logprobs")
    if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_LEGACY_LOGPROBS):
        raise _bad(f"'logprobs' must be an integer between 0 and {MAX_LEGACY_LOGPROBS}")
    fields = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs", "echo", "suffix")}
    fields["prompt"] = prompt
    if lp is not None:
        fields.update(logprobs=True, top_logprobs=lp)
    if fields.get("max_tokens") is None and fields.get("max_completion_tokens") is None:
        fields["max_tokens"] = LEGACY_DEFAULT_MAX_TOKENS
    return ChatRequest(parse_request(fields), *_envelope(body))


class TextProtocol:
    """Validates /v1/text client messages against the session state and turns them into events."""

    def __init__(self) -> None:
        self.state = TextState.IDLE

    def receive(self, msg: dict[str, Any]) -> Event | None:
        kind = msg.get("type")
        if not isinstance(kind, str):
            raise ProtocolError("a message needs a string 'type'", code="missing_field")
        if self.state is TextState.FAILED:
            raise StateError("the session has failed")
        if kind == "start":
            if self.state is TextState.GENERATING:
                raise StateError("'start' while a reply is being generated (send 'cancel' first)")
            req = parse_request(msg)
            self.state = TextState.GENERATING
            return Start(req)
        if kind == "cancel":
            if self.state is TextState.IDLE:
                return None  # the reply already ended
            self.state = TextState.IDLE
            return Cancel()
        raise ProtocolError(f"unknown message type '{kind[:40]}'", code="unknown_type")

    def finished(self) -> None:
        """The server sent ``done`` for the current request."""
        if self.state is TextState.GENERATING:
            self.state = TextState.IDLE

    def fail(self) -> None:
        self.state = TextState.FAILED


class StopMatcher:
    """Cuts streamed text at the first stop string to complete, never emitting the stop string itself.

    ``push`` returns the text that is safe to emit now: a tail that could be the start of a stop
    string is held back until later text resolves it. Invariant: the held tail is the longest
    suffix of the text seen that is a proper prefix of some stop string, so a stop string that
    begins in emitted text is impossible.
    """

    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        assert not self.stopped, "push after a stop string matched"
        s = self.held + text
        if not self.stops:
            self.held = ""
            return s
        # The stop string that completes first in the stream wins (ties: the longer one), as a
        # token-by-token check would find it; everything from its start on is dropped.
        hits = [(i + len(st), i) for st in self.stops if (i := s.find(st)) >= 0]
        if hits:
            self.stopped = True
            self.held = ""
            return s[: min(hits)[1]]
        keep = 0
        for st in self.stops:
            for n in range(min(len(st) - 1, len(s)), keep, -1):
                if s.endswith(st[:n]):
                    keep = n
                    break
        self.held = s[len(s) - keep:] if keep else ""
        return s[: len(s) - keep]

    def flush(self) -> str:
        """The generation ended without a stop string: the held tail is plain text after all."""
        out, self.held = self.held, ""
        return out


# ---- server messages (/v1/text) ------------------------------------------------------------------

def ready(session: str, model: str, context: int) -> dict[str, Any]:
    return {"type": "ready", "session": session, "model": model, "context_tokens": context}


def delta(text: str, tokens: int, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "delta", "text": text, "tokens": tokens}
    if logprobs is not None:
        out["logprobs"] = logprobs
    return out


def done(finish_reason: str, prompt_tokens: int, completion_tokens: int, ttft_ms: float | None,
         tokens_per_s: float | None) -> dict[str, Any]:
    return {"type": "done", "finish_reason": finish_reason,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
            "ttft_ms": None if ttft_ms is None else round(ttft_ms, 2),
            "tokens_per_s": None if tokens_per_s is None else round(tokens_per_s, 2)}


# ---- OpenAI shapes ---------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def logprob_entry(token: bytes, logprob: float, top: list[tuple[bytes, float]] | None = None) -> dict[str, Any]:
    """OpenAI's ChatCompletionTokenLogprob: the token's text (its bytes as UTF-8, U+FFFD where a
    token holds part of a character), its bytes, its log probability and the top alternatives."""
    entry: dict[str, Any] = {"token": token.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(token)}
    entry["top_logprobs"] = [{"token": t.decode("utf-8", "replace"), "logprob": lp, "bytes": list(t)}
                             for t, lp in (top or [])]
    return entry


def _choice_logprobs(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    return None if entries is None else {"content": entries, "refusal": None}


def chat_completion(cid: str, model: str, text: str, finish_reason: str, prompt_tokens: int,
                    completion_tokens: int, created: int | None = None,
                    logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion", "created": int(created or time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": openai_finish(finish_reason), "logprobs": _choice_logprobs(logprobs)}],
            "usage": usage(prompt_tokens, completion_tokens)}


def legacy_logprobs(entries: list[dict[str, Any]], offset: int) -> dict[str, Any]:
    """Chat-style token entries -> the completions endpoint's logprobs object (parallel lists;
    ``text_offset``: each token's first character in the completion text, from ``offset``)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    seen = b""
    for e in entries:
        out["tokens"].append(e["token"])
        out["token_logprobs"].append(e["logprob"])
        out["top_logprobs"].append({t["token"]: t["logprob"] for t in e["top_logprobs"]})
        out["text_offset"].append(offset + len(seen.decode("utf-8", "ignore")))
        seen += bytes(e["bytes"])
    return out


def completion(cid: str, model: str, created: int, text: str | None, finish_reason: str | None = None,
               logprobs: dict[str, Any] | None = None, usage_: dict[str, int] | None = None) -> dict[str, Any]:
    """A (legacy) completions response or one of its streamed events (``text`` None: the
    usage-only event, no choices)."""
    choices = [] if text is None else [{"text": text, "index": 0, "logprobs": logprobs,
                                        "finish_reason": None if finish_reason is None else openai_finish(finish_reason)}]
    out: dict[str, Any] = {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out


def chat_chunk(cid: str, model: str, created: int, content: str | None = None, *, role: bool = False,
               finish_reason: str | None = None, usage_: dict[str, int] | None = None,
               empty_choices: bool = False, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    d: dict[str, Any] = {}
    if role:
        d["role"] = "assistant"
    if content is not None:
        d["content"] = content
    fr = None if finish_reason is None else openai_finish(finish_reason)
    choices = [] if empty_choices else [{"index": 0, "delta": d, "logprobs": _choice_logprobs(logprobs),
                                         "finish_reason": fr}]
    out: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out


def openai_finish(reason: str) -> str:
    """Our finish reasons (stop, length, cancelled) → OpenAI's (stop, length)."""
    return "length" if reason == "length" else "stop"


def sse(data: dict[str, Any] | str) -> bytes:
    import json

    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {body}\n\n".encode()
