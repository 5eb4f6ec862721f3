"""Twilio Media Streams without I/O: the message sequence Twilio sends, what we send back, framing."""

from __future__ import annotations

import base64

import pytest

from realtime.errors import DecodeError, ProtocolError, StateError, UnsupportedError
from realtime.protocol import twilio as tw

SID = "MZ18ad3ab5a668481ce02b83e7395059f0"


def start_msg(**fmt: object) -> dict:
    media_format = {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1, **fmt}
    return {"event": "start", "sequenceNumber": "1", "streamSid": SID,
            "start": {"accountSid": "AC123", "streamSid": SID, "callSid": "CA456", "tracks": ["inbound"],
                      "customParameters": {"FirstName": "Jane"}, "mediaFormat": media_format}}


def media_msg(payload: bytes, seq: int = 2, chunk: int = 1) -> dict:
    return {"event": "media", "sequenceNumber": str(seq), "streamSid": SID,
            "media": {"track": "inbound", "chunk": str(chunk), "timestamp": str(20 * (chunk - 1)),
                      "payload": base64.b64encode(payload).decode()}}


def started() -> tw.TwilioStream:
    s = tw.TwilioStream()
    assert s.receive({"event": "connected", "protocol": "Call", "version": "1.0.0"}) == tw.Connected("Call", "1.0.0")
    ev = s.receive(start_msg())
    assert isinstance(ev, tw.Start)
    return s


def test_the_twilio_sequence() -> None:
    s = tw.TwilioStream()
    s.receive({"event": "connected", "protocol": "Call", "version": "1.0.0"})
    ev = s.receive(start_msg())
    assert ev == tw.Start(SID, "CA456", "AC123", ("inbound",), "audio/x-mulaw", 8000, 1, {"FirstName": "Jane"})
    assert s.state is tw.StreamState.STREAMING and s.stream_sid == SID
    m = s.receive(media_msg(b"\xff" * 160, seq=2, chunk=1))
    assert m == tw.Media(b"\xff" * 160, "inbound", 1, 0, 2)
    assert s.receive(media_msg(b"\x7f" * 160, seq=3, chunk=2)).timestamp_ms == 20
    assert s.media_in == 2 and s.bytes_in == 320 and s.last_sequence == 3
    assert s.receive({"event": "mark", "sequenceNumber": "4", "streamSid": SID, "mark": {"name": "resp_1"}}) \
        == tw.Mark("resp_1")
    assert s.receive({"event": "dtmf", "streamSid": SID, "sequenceNumber": "5",
                      "dtmf": {"track": "inbound_track", "digit": "#"}}) == tw.Dtmf("#")
    assert s.receive({"event": "stop", "sequenceNumber": "6", "streamSid": SID,
                      "stop": {"accountSid": "AC123", "callSid": "CA456"}}) == tw.Stop("CA456")
    assert s.state is tw.StreamState.STOPPED
    with pytest.raises(StateError):
        s.receive(media_msg(b"\xff" * 160))


def test_outbound_messages() -> None:
    s = started()
    msg = s.media(b"\x00" * 160)
    assert msg == {"event": "media", "streamSid": SID, "media": {"payload": base64.b64encode(b"\x00" * 160).decode()}}
    assert s.mark("resp_9") == {"event": "mark", "streamSid": SID, "mark": {"name": "resp_9"}}
    assert s.clear() == {"event": "clear", "streamSid": SID}


@pytest.mark.parametrize("msg, err", [
    ({"sequenceNumber": "1"}, ProtocolError),
    ({"event": "bogus", "streamSid": SID}, ProtocolError),
    ({"event": "media", "streamSid": SID}, ProtocolError),
    ({"event": "media", "streamSid": SID, "media": {"payload": 5}}, ProtocolError),
    ({"event": "media", "streamSid": SID, "media": {"payload": "!!!!"}}, DecodeError),
    ({"event": "media", "streamSid": SID, "media": {"payload": "AAAA", "track": "sideways"}}, ProtocolError),
    ({"event": "media", "streamSid": "MZother", "media": {"payload": "AAAA"}}, ProtocolError),
    ({"event": "mark", "streamSid": SID, "mark": {}}, ProtocolError),
    ({"event": "dtmf", "streamSid": SID, "dtmf": {"digit": "55"}}, ProtocolError),
])
def test_bad_messages_after_start(msg: dict, err: type) -> None:
    s = started()
    with pytest.raises(err):
        s.receive(msg)
    assert s.state is tw.StreamState.STREAMING  # a bad message does not end the stream


def test_state_and_format_errors() -> None:
    s = tw.TwilioStream()
    with pytest.raises(StateError):
        s.receive(media_msg(b"\xff" * 160))
    with pytest.raises(UnsupportedError):
        tw.TwilioStream().receive(start_msg(sampleRate=16000))
    with pytest.raises(UnsupportedError):
        tw.TwilioStream().receive(start_msg(encoding="audio/l16"))
    with pytest.raises(ProtocolError):
        tw.TwilioStream().receive({"event": "start", "start": {"callSid": "CA"}})  # no streamSid
    s = started()
    with pytest.raises(StateError):
        s.receive(start_msg())


def test_framer_cuts_20ms_frames_and_pads_the_tail() -> None:
    f = tw.MulawFramer()
    assert f.push(b"\x01" * 100) == []
    frames = f.push(b"\x02" * 300)
    assert [len(x) for x in frames] == [160, 160] and frames[0] == b"\x01" * 100 + b"\x02" * 60
    tail = f.flush()
    assert tail == [b"\x02" * 80 + bytes([tw.ULAW_SILENCE]) * 80]
    assert f.flush() == []
    f.push(b"\x03" * 10)
    f.reset()
    assert f.flush() == []
