"""Sans-I/O tests of the /v1/tts protocol: frames, state machine, segmenter, player."""

from __future__ import annotations

import base64
import json

import msgpack
import pytest

from realtime.errors import DecodeError, FrameTooLarge, ProtocolError, StateError, UnsupportedError
from realtime.protocol.frames import WireFormat, decode_frame, encode_frame
from realtime.protocol.player import GapTracker
from realtime.protocol.segmenter import Segmenter
from realtime.protocol.tts import Cancel, Flush, Start, Stop, Text, TTSProtocol, TTSState


def test_msgpack_and_json_round_trip_bytes() -> None:
    msg = {"type": "audio", "seq": 3, "audio": b"\x00\x01\xff", "start_ms": 1.5, "duration_ms": 40.0}
    packed = encode_frame(msg, WireFormat.MSGPACK)
    assert isinstance(packed, bytes)
    assert decode_frame(packed) == (msg, WireFormat.MSGPACK)
    text = encode_frame(msg, WireFormat.JSON)
    assert isinstance(text, str)
    assert json.loads(text)["audio"] == base64.b64encode(b"\x00\x01\xff").decode()
    assert decode_frame(text) == (msg, WireFormat.JSON)


@pytest.mark.parametrize("frame, error", [
    (b"\xc1\xc1\xc1", DecodeError),  # 0xc1 is never valid msgpack
    ("{not json", DecodeError),
    ("[1, 2]", DecodeError),  # valid JSON, not a map
    (msgpack.packb([1, 2]), DecodeError),
    ('{"type": "start", "audio": "!!notbase64"}', DecodeError),
])
def test_bad_frames_raise_typed_errors(frame: bytes | str, error: type) -> None:
    with pytest.raises(error) as exc:
        decode_frame(frame)
    assert exc.value.close_code == 1007


def test_oversized_frame() -> None:
    with pytest.raises(FrameTooLarge) as exc:
        decode_frame(b"\x00" * 101, max_size=100)
    assert exc.value.close_code == 1009


def test_state_machine_happy_path() -> None:
    p = TTSProtocol(default_rate=22050)
    ev = p.receive({"type": "start", "format": "mulaw", "sample_rate": 8000, "chunk_ms": 20})
    assert isinstance(ev, Start) and ev.params.format == "mulaw" and ev.params.sample_rate == 8000
    assert ev.params.chunk_ms == 20 and p.state is TTSState.STREAMING
    assert p.receive({"type": "text", "text": "Hi."}) == Text("Hi.")
    assert isinstance(p.receive({"type": "flush"}), Flush)
    assert isinstance(p.receive({"type": "stop"}), Stop)
    assert p.state is TTSState.STOPPING
    with pytest.raises(StateError):
        p.receive({"type": "text", "text": "late"})
    p.finished()
    assert p.state is TTSState.DONE


def test_defaults_and_cancel() -> None:
    p = TTSProtocol(default_rate=24000)
    ev = p.receive({"type": "start"})
    assert isinstance(ev, Start)
    assert (ev.params.format, ev.params.sample_rate, ev.params.chunk_ms) == ("pcm_s16le", 24000, None)
    assert isinstance(p.receive({"type": "cancel"}), Cancel)
    with pytest.raises(StateError):
        p.receive({"type": "text", "text": "x"})


@pytest.mark.parametrize("msg, error, close", [
    ({"type": "text", "text": "x"}, StateError, 1008),  # before start
    ({"type": "nope"}, ProtocolError, 1008),
    ({"text": "no type"}, ProtocolError, 1008),
    ({"type": "start", "format": "mp3"}, UnsupportedError, 1003),
    ({"type": "start", "sample_rate": 44100}, UnsupportedError, 1003),
    ({"type": "start", "sample_rate": True}, ProtocolError, 1008),
    ({"type": "start", "sample_rate": "24000"}, ProtocolError, 1008),
    ({"type": "start", "chunk_ms": 1}, ProtocolError, 1008),
    ({"type": "start", "reference": {"text": "no audio"}}, ProtocolError, 1008),
])
def test_bad_messages(msg: dict, error: type, close: int) -> None:
    p = TTSProtocol()
    with pytest.raises(error) as exc:
        p.receive(msg)
    assert exc.value.close_code == close
    assert "Traceback" not in exc.value.message


def test_text_needs_text_and_start_only_once() -> None:
    p = TTSProtocol()
    p.receive({"type": "start"})
    with pytest.raises(ProtocolError, match="text"):
        p.receive({"type": "text"})
    with pytest.raises(ProtocolError):
        p.receive({"type": "text", "text": 5})
    with pytest.raises(StateError, match="twice"):
        p.receive({"type": "start"})


def test_segmenter_sentences_clauses_and_flush() -> None:
    s = Segmenter(first_clause_chars=24, clause_chars=80)
    out = []
    for piece in ["Hel", "lo the", "re. How are", " you today? I am", " fine"]:
        out += s.push(piece)
    assert out == ["Hello there.", "How are you today?"]
    assert s.flush() == ["I am fine"]
    assert s.flush() == []


def test_segmenter_keeps_abbreviations_and_cuts_first_clause_early() -> None:
    s = Segmenter(first_clause_chars=24, clause_chars=80)
    assert s.push("Dr. Smith went to Washington, and then ") == ["Dr. Smith went to Washington,"]
    # later clauses wait for more text
    assert s.push("he came back, tired ") == []
    assert s.push("but happy. ") == ["and then he came back, tired but happy."]


def test_segmenter_never_splits_words_in_long_runs() -> None:
    s = Segmenter(max_chars=50)
    words = ("word " * 40).strip()
    segs = s.push(words) + s.flush()
    assert " ".join(segs) == words
    assert all(len(x) <= 50 for x in segs)


def test_gap_tracker_counts_late_chunks_only() -> None:
    g = GapTracker()
    g.on_chunk(10.0, 0.1)  # plays 10.0 - 10.1
    g.on_chunk(10.05, 0.1)  # early: buffered until 10.2
    g.on_chunk(10.25, 0.1)  # 50 ms late
    assert g.underruns == 1 and abs(g.underrun_s - 0.05) < 1e-9
    g.on_chunk(10.6, 0.1)  # 250 ms late
    assert g.underruns == 2 and g.gaps_over_100ms == 1 and abs(g.max_underrun_s - 0.25) < 1e-9
    g.idle()  # the sender ran out of text: the next gap is not an underrun
    g.on_chunk(20.0, 0.1)
    assert g.underruns == 2
    st = g.stats()
    assert st["chunks"] == 5 and st["audio_ms"] == pytest.approx(500.0)
