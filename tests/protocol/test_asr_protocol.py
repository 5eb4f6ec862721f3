"""The /v1/asr state machine without I/O: events for good messages, typed errors for bad ones."""

from __future__ import annotations

import pytest

from realtime.errors import ProtocolError, StateError, UnsupportedError
from realtime.protocol.asr import ASRParams, ASRProtocol, ASRState, Audio, Finalize, Start, Stop, parse_start


def started(**fields: object) -> ASRProtocol:
    p = ASRProtocol(languages=("en",))
    ev = p.receive({"type": "start", **fields})
    assert isinstance(ev, Start)
    return p


def test_start_defaults_and_fields() -> None:
    p = started()
    assert p.params == ASRParams(sample_rate=16000, format="pcm_s16le", language=None, interim=True)
    assert p.state is ASRState.STREAMING
    q = started(sample_rate=8000, format="mulaw", language="EN", interim=False, preview=True, words=True)
    assert q.params == ASRParams(sample_rate=8000, format="mulaw", language="en", interim=False, preview=True,
                                 words=True)
    assert not p.params.preview and not p.params.words and p.params.task == "transcribe"
    for rate in (8000, 16000, 22050, 24000, 48000):
        assert parse_start({"type": "start", "sample_rate": rate}).sample_rate == rate


@pytest.mark.parametrize("fields, err, code", [
    ({"sample_rate": 44100}, UnsupportedError, "unsupported"),
    ({"sample_rate": True}, ProtocolError, "bad_field"),
    ({"sample_rate": "16000"}, ProtocolError, "bad_field"),
    ({"format": "opus"}, UnsupportedError, "unsupported"),
    ({"language": "fr"}, UnsupportedError, "unsupported"),  # English-only model
    ({"language": 3}, ProtocolError, "bad_field"),
    ({"interim": "yes"}, ProtocolError, "bad_field"),
    ({"preview": 1}, ProtocolError, "bad_field"),
    ({"words": "yes"}, ProtocolError, "bad_field"),
    ({"task": "translate"}, UnsupportedError, "unsupported"),  # English-only model
    ({"task": "summarize"}, UnsupportedError, "unsupported"),
    ({"task": 1}, ProtocolError, "bad_field"),
    ({"prompt": 3}, ProtocolError, "bad_field"),
    ({"prompt": "x" * 2001}, ProtocolError, "too_long"),
])
def test_bad_start(fields: dict, err: type, code: str) -> None:
    p = ASRProtocol(languages=("en",))
    with pytest.raises(err) as e:
        p.receive({"type": "start", **fields})
    assert e.value.code == code
    assert p.state is ASRState.AWAIT_START


def test_any_language_when_the_model_lists_none() -> None:
    assert parse_start({"type": "start", "language": "fr"}, None).language == "fr"
    assert parse_start({"type": "start", "language": "de"}, ("de", "en")).language == "de"
    assert parse_start({"type": "start", "task": "translate"}, ("de", "en")).task == "translate"


def test_prompt_is_kept_stripped_and_blank_is_none() -> None:
    assert parse_start({"type": "start", "prompt": "  Gregson, Holmes. "}).prompt == "Gregson, Holmes."
    assert parse_start({"type": "start", "prompt": "   "}).prompt is None


def test_audio_sizes_per_format() -> None:
    p = started(format="pcm_s16le")
    assert p.receive({"type": "audio", "audio": b"\x00\x01" * 3}) == Audio(b"\x00\x01" * 3)
    assert p.receive({"type": "audio", "audio": bytearray(b"\x00\x00")}) == Audio(b"\x00\x00")
    with pytest.raises(ProtocolError) as e:
        p.receive({"type": "audio", "audio": b"\x00\x01\x02"})
    assert e.value.code == "bad_audio"
    f = started(format="pcm_f32le")
    with pytest.raises(ProtocolError):
        f.receive({"type": "audio", "audio": b"\x00" * 6})
    assert f.receive({"type": "audio", "audio": b"\x00" * 8}) == Audio(b"\x00" * 8)
    u = started(format="alaw")
    assert u.receive({"type": "audio", "audio": b"\x55" * 7}) == Audio(b"\x55" * 7)
    with pytest.raises(ProtocolError) as e:
        u.receive({"type": "audio", "audio": "not bytes"})
    assert e.value.code == "missing_field"


def test_state_rules() -> None:
    p = ASRProtocol()
    with pytest.raises(StateError):
        p.receive({"type": "audio", "audio": b"\x00\x00"})
    with pytest.raises(StateError):
        p.receive({"type": "finalize"})
    p.receive({"type": "start"})
    with pytest.raises(StateError):
        p.receive({"type": "start"})
    assert p.receive({"type": "finalize"}) == Finalize()
    assert p.receive({"type": "stop"}) == Stop()
    assert p.state is ASRState.STOPPING
    for msg in ({"type": "audio", "audio": b"\x00\x00"}, {"type": "finalize"}, {"type": "stop"}):
        with pytest.raises(StateError):
            p.receive(msg)
    p.finished()
    assert p.state is ASRState.DONE
    with pytest.raises(StateError):
        p.receive({"type": "start"})


def test_unknown_and_missing_type() -> None:
    p = started()
    with pytest.raises(ProtocolError) as e:
        p.receive({"type": "text", "text": "hi"})
    assert e.value.code == "unknown_type"
    with pytest.raises(ProtocolError) as e:
        p.receive({"audio": b""})
    assert e.value.code == "missing_field"
    p.fail()
    with pytest.raises(StateError):
        p.receive({"type": "finalize"})
