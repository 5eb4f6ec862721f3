"""Typed errors for user, client and config input (rule 9: asserts are for invariants only).

Every error that can reach a client carries a short machine-readable ``code`` and a
WebSocket close code; the message is safe to show to a peer (no internals).
"""

from __future__ import annotations


class RealtimeError(Exception):
    """Base class for errors caused by input from a user, a client or a config file."""

    code: str = "error"
    close_code: int = 1008  # policy violation: the generic "you sent something we refuse"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class ProtocolError(RealtimeError):
    """A frame that does not follow the protocol (unknown type, missing field, bad state)."""

    code = "bad_request"
    close_code = 1008


class DecodeError(ProtocolError):
    """A frame that is not valid msgpack/JSON, or not a map."""

    code = "invalid_frame"
    close_code = 1007


class UnsupportedError(ProtocolError):
    """A valid request for something we do not offer (format, rate, voice, model)."""

    code = "unsupported"
    close_code = 1003


class FrameTooLarge(ProtocolError):
    """A frame over the configured size limit."""

    code = "too_large"
    close_code = 1009


class StateError(ProtocolError):
    """A message that is not allowed in the session's current state."""

    code = "bad_state"
    close_code = 1008


class InternalError(RealtimeError):
    """Our fault (an engine failed). The message sent to the client never holds the details."""

    code = "internal"
    close_code = 1011


class AuthError(RealtimeError):
    code = "unauthorized"
    close_code = 1008


class OverloadedError(RealtimeError):
    """The scheduler has no free slot; the client may retry later."""

    code = "overloaded"
    close_code = 1013


class ConfigError(RealtimeError):
    """Bad server configuration or a checkpoint folder we cannot load."""

    code = "config"
    close_code = 1011


class ModelFormatError(ConfigError):
    """A weights file whose contents do not match the expected format."""

    code = "model_format"
