"""The /v1/text and chat-completions protocol, sans I/O: validation, states, stop strings, shapes."""

from __future__ import annotations

import json
import random

import pytest

from realtime.errors import ProtocolError, StateError
from realtime.protocol import text as tp


def _reference_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """Cut the whole text at the stop string that is complete first (smallest end; ties: longest)."""
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return (text[: min(hits)[1]], True) if hits else (text, False)


def _feed(chunks: list[str], stops: list[str]) -> tuple[str, bool, list[str]]:
    m = tp.StopMatcher(stops)
    emitted = []
    for c in chunks:
        emitted.append(m.push(c))
        if m.stopped:
            return "".join(emitted), True, emitted
    emitted.append(m.flush())
    return "".join(emitted), False, emitted


def test_stop_matcher_equals_cutting_the_whole_text_for_any_chunking() -> None:
    rng = random.Random(0)
    alphabet = "ab c\n"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 8))))
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        got, stopped, _ = _feed(chunks, stops)
        assert (got, stopped) == _reference_cut(text, stops), (text, stops, chunks)


def test_stop_matcher_holds_back_only_a_possible_prefix() -> None:
    m = tp.StopMatcher(["</end>"])
    assert m.push("Hello </") == "Hello "  # "</" may start the stop string
    assert m.held == "</"
    assert m.push("b>") == "</b>"  # resolved: not the stop string
    assert m.push(" x </en") == " x "
    assert m.push("d> tail") == "" and m.stopped
    m = tp.StopMatcher([])
    assert m.push("abc") == "abc" and m.flush() == ""
    m = tp.StopMatcher(["xyz"])
    assert m.push("ax") == "a" and m.flush() == "x"  # generation ended: the held tail was text


def test_parse_request_and_params() -> None:
    r = tp.parse_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                                     {"type": "text", "text": "!"}]}],
                          "max_completion_tokens": 5, "temperature": 0, "stop": "\n", "seed": 3, "top_k": 4})
    assert r.messages == ({"role": "user", "content": "Hi!"},) and r.prompt is None
    assert r.params == tp.GenParams(max_tokens=5, temperature=0.0, top_p=1.0, top_k=4, stop=("\n",), seed=3)
    r = tp.parse_request({"prompt": "Once upon"})
    assert r.prompt == "Once upon" and r.params == tp.GenParams()
    assert tp.parse_request({"messages": [{"role": "developer", "content": "x"}]}).messages[0]["role"] == "system"
    bad = [
        {},
        {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
        {"prompt": ""},
        {"prompt": 3},
        {"messages": []},
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"prompt": "a", "temperature": 3},
        {"prompt": "a", "temperature": True},
        {"prompt": "a", "top_p": -0.1},
        {"prompt": "a", "max_tokens": 0},
        {"prompt": "a", "max_tokens": 2.5},
        {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]},
        {"prompt": "a", "stop": [""]},
        {"prompt": "a", "stop": 5},
        {"prompt": "a", "seed": "x"},
        {"prompt": "x" * (tp.MAX_PROMPT_CHARS + 1)},
    ]
    for body in bad:
        with pytest.raises(ProtocolError):
            tp.parse_request(body)


def test_penalties_parse_and_unsupported_fields_are_refused() -> None:
    p = tp.parse_params({"frequency_penalty": 0.5, "presence_penalty": -2})
    assert (p.frequency_penalty, p.presence_penalty) == (0.5, -2.0) and p.penalized and not p.filtered
    assert not tp.parse_params({"frequency_penalty": 0, "presence_penalty": None}).penalized
    for body in ({"frequency_penalty": 2.5}, {"presence_penalty": "1"}, {"frequency_penalty": True}):
        with pytest.raises(ProtocolError):
            tp.parse_params(body)
    # fields that would change the reply and are not done here: an error with its own code, not ignored
    for body in ({"logit_bias": {"50256": -100}},
                 {"response_format": {"type": "json_object"}}, {"response_format": "json"},
                 {"audio": {"voice": "alloy"}}, {"modalities": ["text", "audio"]},
                 {"prediction": {"type": "content", "content": "x"}}):
        with pytest.raises(ProtocolError) as exc:
            tp.parse_params(body)
        assert exc.value.code == "unsupported", body
    # their off values pass (what SDKs send by default)
    tp.parse_params({"logprobs": False, "top_logprobs": 0, "logit_bias": {}, "response_format": {"type": "text"},
                     "modalities": ["text"], "user": "u", "metadata": {}, "store": False})
    # logprobs: a boolean, and top_logprobs 0..20 only with it
    p = tp.parse_params({"logprobs": True, "top_logprobs": 20})
    assert p.logprobs and p.top_logprobs == 20 and tp.parse_params({"logprobs": True}).top_logprobs == 0
    for body in ({"logprobs": "yes"}, {"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21},
                 {"logprobs": False, "top_logprobs": 1}):
        with pytest.raises(ProtocolError):
            tp.parse_params(body)


def test_parse_legacy_completion() -> None:
    c = tp.parse_completion({"prompt": ["Once"], "logprobs": 3, "stream": True})
    assert c.request.prompt == "Once" and c.stream and c.request.params.max_tokens == 16
    assert c.request.params.logprobs and c.request.params.top_logprobs == 3
    assert tp.parse_completion({"prompt": "a", "max_completion_tokens": 40}).request.params.max_tokens == 40
    assert not tp.parse_completion({"prompt": "a", "logprobs": None}).request.params.logprobs
    for body in ({"prompt": "a", "logprobs": True}, {"prompt": "a", "logprobs": 6}, {"prompt": ["a", "b"]},
                 {"prompt": [[1, 2]]}, {"prompt": "a", "best_of": 3}, {"prompt": "a", "echo": True}, {"prompt": ""}):
        with pytest.raises(ProtocolError):
            tp.parse_completion(body)


def test_parse_chat_completion() -> None:
    c = tp.parse_chat_completion({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True,
                                  "stream_options": {"include_usage": True}})
    assert c.model == "m" and c.stream and c.include_usage
    for body in ({"prompt": "x"}, {"messages": [{"role": "user", "content": "x"}], "n": 2},
                 {"messages": [{"role": "user", "content": "x"}], "stream": "yes"},
                 {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}):
        with pytest.raises(ProtocolError):
            tp.parse_chat_completion(body)


def test_session_states() -> None:
    p = tp.TextProtocol()
    assert p.receive({"type": "cancel"}) is None  # nothing running: ignored (the reply may just have ended)
    ev = p.receive({"type": "start", "prompt": "hi"})
    assert isinstance(ev, tp.Start) and p.state is tp.TextState.GENERATING
    with pytest.raises(StateError):
        p.receive({"type": "start", "prompt": "again"})
    assert isinstance(p.receive({"type": "cancel"}), tp.Cancel) and p.state is tp.TextState.IDLE
    assert isinstance(p.receive({"type": "start", "prompt": "next"}), tp.Start)
    p.finished()
    assert p.state is tp.TextState.IDLE
    with pytest.raises(ProtocolError) as e:
        p.receive({"type": "shout"})
    assert e.value.code == "unknown_type"
    with pytest.raises(ProtocolError):
        p.receive({"kind": "start"})
    p.fail()
    with pytest.raises(StateError):
        p.receive({"type": "start", "prompt": "x"})


def test_message_shapes() -> None:
    d = tp.done("length", 10, 3, 12.345, 50.0)
    assert d == {"type": "done", "finish_reason": "length", "usage": {"prompt_tokens": 10, "completion_tokens": 3},
                 "ttft_ms": 12.35, "tokens_per_s": 50.0}
    assert tp.delta("hi", 2) == {"type": "delta", "text": "hi", "tokens": 2}
    c = tp.chat_completion("id1", "m", "Paris.", "cancelled", 5, 2, created=7)
    assert c["choices"][0]["finish_reason"] == "stop" and c["usage"]["total_tokens"] == 7
    assert c["object"] == "chat.completion" and c["choices"][0]["message"] == {"role": "assistant", "content": "Paris."}
    k = tp.chat_chunk("id1", "m", 7, "x", role=True)
    assert k["choices"][0]["delta"] == {"role": "assistant", "content": "x"} and k["object"] == "chat.completion.chunk"
    k = tp.chat_chunk("id1", "m", 7, finish_reason="length")
    assert k["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    u = tp.chat_chunk("id1", "m", 7, empty_choices=True, usage_=tp.usage(1, 2))
    assert u["choices"] == [] and u["usage"]["total_tokens"] == 3
    raw = tp.sse({"a": "é"})
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n") and json.loads(raw[6:]) == {"a": "é"}
    assert tp.sse("[DONE]") == b"data: [DONE]\n\n"
