"""The OpenAI Realtime subset without I/O: client events parse to typed events, bad ones raise typed
errors, session.update applies field by field, and server events match the openai SDK's schema."""

from __future__ import annotations

import base64

import pytest

from realtime.errors import ProtocolError, UnsupportedError
from realtime.protocol import openai_realtime as oa


def test_audio_append_commit_clear() -> None:
    data = b"\x01\x00\x02\x00"
    ev = oa.parse_client_event({"type": "input_audio_buffer.append", "audio": base64.b64encode(data).decode()})
    assert ev == oa.AudioAppend(data)
    # the server's frame decoder may already have turned base64 'audio' into bytes
    assert oa.parse_client_event({"type": "input_audio_buffer.append", "audio": data}) == oa.AudioAppend(data)
    assert oa.parse_client_event({"type": "input_audio_buffer.commit"}) == oa.AudioCommit()
    assert oa.parse_client_event({"type": "input_audio_buffer.clear"}) == oa.AudioClear()


@pytest.mark.parametrize("msg, err, code", [
    ({}, ProtocolError, "missing_required_parameter"),
    ({"type": 3}, ProtocolError, "missing_required_parameter"),
    ({"type": "nope"}, ProtocolError, "unknown_event"),
    ({"type": "session.close"}, UnsupportedError, "unsupported"),
    ({"type": "conversation.item.retrieve"}, ProtocolError, "missing_required_parameter"),
    ({"type": "conversation.item.delete"}, ProtocolError, "missing_required_parameter"),
    ({"type": "conversation.item.delete", "item_id": 7}, ProtocolError, "missing_required_parameter"),
    ({"type": "output_audio_buffer.clear"}, UnsupportedError, "unsupported"),
    ({"type": "input_audio_buffer.append"}, ProtocolError, "missing_required_parameter"),
    ({"type": "input_audio_buffer.append", "audio": "!!"}, ProtocolError, "invalid_value"),
    ({"type": "session.update"}, ProtocolError, "missing_required_parameter"),
    ({"type": "conversation.item.truncate", "audio_end_ms": 5}, ProtocolError, "missing_required_parameter"),
    ({"type": "conversation.item.truncate", "item_id": "i", "audio_end_ms": -1}, ProtocolError, "invalid_value"),
    ({"type": "conversation.item.truncate", "item_id": "i", "audio_end_ms": True}, ProtocolError, "invalid_value"),
    ({"type": "conversation.item.truncate", "item_id": "i", "audio_end_ms": 5, "content_index": 1},
     ProtocolError, "invalid_value"),
    ({"type": "conversation.item.create"}, ProtocolError, "missing_required_parameter"),
    ({"type": "conversation.item.create", "item": {"type": "function_call"}}, UnsupportedError, "unsupported"),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "tool", "content": []}},
     ProtocolError, "invalid_value"),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                   "content": [{"type": "input_image", "image_url": "x"}]}},
     UnsupportedError, "unsupported"),
    ({"type": "response.create", "response": {"tools": [{"type": "function"}]}}, UnsupportedError, "unsupported"),
    ({"type": "response.create", "response": {"output_modalities": ["text"]}}, UnsupportedError, "unsupported"),
    ({"type": "response.create", "response": {"max_output_tokens": 0}}, ProtocolError, "invalid_value"),
    ({"type": "response.create", "response": {"metadata": {"k": 1}}}, ProtocolError, "invalid_value"),
    ({"type": "response.create", "response": {"conversation": "conv_x"}}, UnsupportedError, "unsupported"),
])
def test_bad_client_events(msg: dict, err: type, code: str) -> None:
    with pytest.raises(err) as e:
        oa.parse_client_event(msg)
    assert e.value.code == code


def test_items_truncate_response_events() -> None:
    ev = oa.parse_client_event({"type": "conversation.item.create", "previous_item_id": "p", "item": {
        "id": "item_1", "type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "Hi "}, {"type": "input_text", "text": "there"}]}})
    assert ev == oa.ItemCreate("user", "Hi there", "item_1", "p")
    ev = oa.parse_client_event({"type": "conversation.item.truncate", "item_id": "item_2", "content_index": 0,
                                "audio_end_ms": 1500})
    assert ev == oa.ItemTruncate("item_2", 0, 1500)
    assert oa.parse_client_event({"type": "conversation.item.delete", "item_id": "item_3"}) == oa.ItemDelete("item_3")
    assert oa.parse_client_event({"type": "conversation.item.retrieve", "item_id": "item_4"}) == oa.ItemRetrieve("item_4")
    ev = oa.parse_client_event({"type": "response.create"})
    assert ev == oa.ResponseCreate()
    ev = oa.parse_client_event({"type": "response.create", "response": {
        "instructions": "Be brief.", "max_output_tokens": 32, "metadata": {"a": "b"}, "conversation": "none",
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Q?"}]}]}})
    assert ev == oa.ResponseCreate("Be brief.", 32, {"a": "b"}, "none", ({"role": "user", "content": "Q?"},))
    assert oa.parse_client_event({"type": "response.create", "response": {"max_output_tokens": "inf"}}) \
        == oa.ResponseCreate()
    assert oa.parse_client_event({"type": "response.cancel", "response_id": "resp_1"}) == oa.ResponseCancel("resp_1")
    assert oa.parse_client_event({"type": "response.cancel"}) == oa.ResponseCancel(None)


def test_session_update_ga_fields() -> None:
    cfg = oa.SessionConfig()
    assert cfg.input_codec == ("pcm_s16le", 24000) and cfg.turn_detection is not None
    new = oa.apply_session_update(cfg, {
        "type": "realtime", "instructions": "Talk like a pirate.", "max_output_tokens": 64,
        "audio": {"input": {"format": {"type": "audio/pcmu"},
                            "turn_detection": {"type": "server_vad", "threshold": 0.7, "prefix_padding_ms": 200,
                                               "silence_duration_ms": 800, "interrupt_response": False}},
                  "output": {"format": {"type": "audio/pcma"}, "voice": "marin"}}})
    assert new.instructions == "Talk like a pirate." and new.max_output_tokens == 64
    assert new.input_codec == ("mulaw", 8000) and new.output_codec == ("alaw", 8000)
    assert new.voice == "marin"
    assert new.turn_detection == oa.TurnDetection(threshold=0.7, prefix_padding_ms=200, silence_duration_ms=800,
                                                  create_response=True, interrupt_response=False)
    # absent fields keep their values; null turns detection off
    again = oa.apply_session_update(new, {"type": "realtime", "audio": {"input": {"turn_detection": None}}})
    assert again.turn_detection is None and again.input_format == "audio/pcmu" and again.voice == "marin"
    assert oa.apply_session_update(again, {"max_output_tokens": "inf"}).max_output_tokens is None


def test_transcription_prompt() -> None:
    """audio.input.transcription.prompt (the beta input_audio_transcription's too): kept stripped,
    echoed in the session object; null transcription drops it with the model."""
    new = oa.apply_session_update(oa.SessionConfig(), {"audio": {"input": {"transcription": {
        "model": "whisper-1", "prompt": " Gregson, Holmes "}}}})
    assert new.transcription_model == "whisper-1" and new.transcription_prompt == "Gregson, Holmes"
    assert oa.session_object(new, "s", "v")["audio"]["input"]["transcription"] == {
        "model": "whisper-1", "prompt": "Gregson, Holmes", "language": None}
    beta = oa.apply_session_update(oa.SessionConfig(), {"input_audio_transcription": {"prompt": "Lestrade"}})
    assert beta.transcription_prompt == "Lestrade"
    off = oa.apply_session_update(new, {"audio": {"input": {"transcription": None}}})
    assert off.transcription_model is None and off.transcription_prompt is None
    for bad in (5, "x" * 2001):
        with pytest.raises(ProtocolError):
            oa.apply_session_update(oa.SessionConfig(), {"input_audio_transcription": {"prompt": bad}})


def test_transcription_language_is_one_the_model_takes() -> None:
    new = oa.apply_session_update(oa.SessionConfig(), {"input_audio_transcription": {"language": "EN"}},
                                  languages=("en",))
    assert new.transcription_language == "en"
    assert oa.session_object(new, "s", "v")["audio"]["input"]["transcription"]["language"] == "en"
    assert oa.apply_session_update(new, {"input_audio_transcription": {"language": ""}}).transcription_language is None
    with pytest.raises(UnsupportedError, match="'fr'"):
        oa.apply_session_update(oa.SessionConfig(), {"input_audio_transcription": {"language": "fr"}},
                                languages=("en",))
    with pytest.raises(ProtocolError):
        oa.apply_session_update(oa.SessionConfig(), {"input_audio_transcription": {"language": 7}})


def test_session_update_beta_fields() -> None:
    new = oa.apply_session_update(oa.SessionConfig(), {"input_audio_format": "g711_ulaw",
                                                       "output_audio_format": "pcm16", "voice": "alloy",
                                                       "turn_detection": {"type": "server_vad",
                                                                          "silence_duration_ms": 300}})
    assert new.input_format == "audio/pcmu" and new.output_format == "audio/pcm" and new.voice == "alloy"
    assert new.turn_detection is not None and new.turn_detection.silence_duration_ms == 300


@pytest.mark.parametrize("session, err", [
    ({"audio": {"input": {"format": {"type": "audio/opus"}}}}, UnsupportedError),
    ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}, UnsupportedError),
    ({"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}}, UnsupportedError),
    ({"audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 2}}}}, ProtocolError),
    ({"audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": "x"}}}}, ProtocolError),
    ({"output_modalities": ["text"]}, UnsupportedError),
    ({"tools": [{"type": "function", "name": "f"}]}, UnsupportedError),
    ({"type": "transcription"}, UnsupportedError),
    ({"instructions": 5}, ProtocolError),
    ({"max_output_tokens": 10_000}, ProtocolError),
    ({"audio": "x"}, ProtocolError),
])
def test_session_update_refusals(session: dict, err: type) -> None:
    with pytest.raises(err):
        oa.apply_session_update(oa.SessionConfig(), session)


def test_voice_locked_after_audio() -> None:
    cfg = oa.apply_session_update(oa.SessionConfig(), {"audio": {"output": {"voice": "alloy"}}})
    assert oa.apply_session_update(cfg, {"audio": {"output": {"voice": "alloy"}}}, voice_locked=True).voice == "alloy"
    with pytest.raises(ProtocolError) as e:
        oa.apply_session_update(cfg, {"audio": {"output": {"voice": "echo"}}}, voice_locked=True)
    assert e.value.code == "voice_locked"


def test_server_events_parse_with_the_openai_sdk() -> None:
    """Our server events, read by the SDK's own parser, give the typed models with our values."""
    from openai.types.realtime import (ConversationItemDeletedEvent, ConversationItemTruncatedEvent, RealtimeErrorEvent, ResponseAudioDeltaEvent,
                                       ResponseDoneEvent, SessionCreatedEvent)
    from openai.types.realtime.realtime_server_event import RealtimeServerEvent
    from openai._models import construct_type

    def parse(ev: dict):  # noqa: ANN202
        return construct_type(value=ev, type_=RealtimeServerEvent)

    cfg = oa.SessionConfig(voice="alloy")
    s = parse(oa.event("session.created", session=oa.session_object(cfg, "sess_1", "joe")))
    assert isinstance(s, SessionCreatedEvent)
    assert s.session.audio.output.format.type == "audio/pcm" and s.session.audio.output.format.rate == 24000
    assert s.session.audio.input.turn_detection.type == "server_vad"
    d = parse(oa.event("response.output_audio.delta", response_id="r", item_id="i", output_index=0,
                       content_index=0, delta=oa.b64(b"\x00\x01")))
    assert isinstance(d, ResponseAudioDeltaEvent) and base64.b64decode(d.delta) == b"\x00\x01"
    item = oa.assistant_item("i", "incomplete", "Hello")
    done = parse(oa.event("response.done", response=oa.response_object(
        "r", "cancelled", cfg, "alloy", output=[item], usage=oa.usage(10, 3),
        status_details={"type": "cancelled", "reason": "turn_detected"}, metrics={"turn_latency_ms": 700.0})))
    assert isinstance(done, ResponseDoneEvent)
    assert done.response.status == "cancelled" and done.response.status_details.reason == "turn_detected"
    assert done.response.usage.output_tokens == 3 and done.response.output[0].content[0].transcript == "Hello"
    assert done.response.model_extra["realtime_metrics"] == {"turn_latency_ms": 700.0}
    t = parse(oa.event("conversation.item.truncated", item_id="i", content_index=0, audio_end_ms=300))
    assert isinstance(t, ConversationItemTruncatedEvent) and t.audio_end_ms == 300
    d = parse(oa.event("conversation.item.deleted", item_id="i"))
    assert isinstance(d, ConversationItemDeletedEvent) and d.item_id == "i"
    exc = UnsupportedError("nope")
    e = parse(oa.error_event(exc, "evt_7"))
    assert isinstance(e, RealtimeErrorEvent) and e.error.code == "unsupported" and e.error.event_id == "evt_7"
    assert e.error.type == "invalid_request_error"
