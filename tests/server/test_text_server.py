"""Text generation through the one scheduler, on a real uvicorn server with the embedded SmolLM2.

One server for the module (the model loads once). Greedy answers are checked against what the
model says (it answers "The capital of France is Paris."); batching is checked as equality with
solo decodes plus a count of shared decode steps.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest
import websockets
from liveserver import serve

from realtime.config import ServerConfig
from realtime.protocol.text import GenParams
from realtime.server import create_app
from realtime.text_service import TextDelta, TextDone, TextService

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = [
    FRANCE,
    [{"role": "user", "content": "Name three colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Say hello."}],
]


@pytest.fixture(scope="module")
def live(piper_backend):  # noqa: ANN001, ANN201
    svc = TextService(ServerConfig(), n_slots=8, max_seq_len=256)
    app = create_app(ServerConfig(warmup=False), tts=piper_backend, services=[svc])
    with serve(app) as lv:
        lv.svc = svc
        yield lv


async def _ws_request(url: str, start: dict, cancel_after: int | None = None) -> tuple[str, dict, list]:
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "start", **start}))
        ready = json.loads(await ws.recv())
        assert ready["type"] == "ready" and ready["prompt_tokens"] > 0, ready
        parts, deltas = [], 0
        while True:
            msg = json.loads(await ws.recv())
            if msg["type"] == "delta":
                parts.append(msg["text"])
                deltas += 1
                if cancel_after is not None and deltas == cancel_after:
                    await ws.send(json.dumps({"type": "cancel"}))
            elif msg["type"] == "done":
                return "".join(parts), msg, []
            else:
                raise AssertionError(msg)


def _run(coro):  # noqa: ANN001, ANN202
    return asyncio.run(coro)


def test_chat_completions_answers_paris(live) -> None:  # noqa: ANN001
    body = {"model": "smollm2", "messages": FRANCE, "temperature": 0, "max_tokens": 32}
    r = httpx.post(f"{live.http}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    text = out["choices"][0]["message"]["content"]
    assert out["object"] == "chat.completion" and "Paris" in text, text
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["prompt_tokens"] > 10 and 0 < out["usage"]["completion_tokens"] <= 32

    chunks = []
    with httpx.stream("POST", f"{live.http}/v1/chat/completions", json={**body, "stream": True,
                      "stream_options": {"include_usage": True}}, timeout=120) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in resp.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert streamed == text  # greedy: the same reply, streamed
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["usage"] == out["usage"]

    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{live.http}/v1", api_key="unused")
    res = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, max_tokens=32)
    assert res.choices[0].message.content == text and res.usage.completion_tokens == out["usage"]["completion_tokens"]
    stream = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, max_tokens=32, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_cpu_runs_native_products_unless_exact(live) -> None:  # noqa: ANN001
    # The served CPU default runs the GGUF's 4-bit codes; text_exact (serve --text-exact) loads the
    # float32 path that equals transformers, with no CPU products at all.
    head = live.svc.model.embed_tokens.weight
    assert head.cpu_product is not None and live.svc.model.transformer.layers[0].self_attn.qkv_cpu.bf16 is None
    exact = TextService(ServerConfig(text_exact=True), n_slots=1, max_seq_len=64)
    exact.load()
    m = exact.model
    assert not hasattr(m.embed_tokens.weight, "cpu_product") and m.transformer.layers[0].self_attn.qkv_cpu is None
    assert not any(hasattr(p, "cpu_product") for p in m.parameters())


def test_batched_decode_equals_solo_and_shares_steps(live) -> None:  # noqa: ANN001
    url = f"{live.ws}/v1/text"
    starts = [{"messages": p, "temperature": 0, "max_tokens": 16} for p in PROMPTS]
    solo = [_run(_ws_request(url, s)) for s in starts]
    lane = live.svc.decode_lane
    steps0, tokens0 = lane.steps, lane.tokens

    async def together():  # noqa: ANN202
        return await asyncio.gather(*[_ws_request(url, s) for s in starts])

    both = _run(together())
    steps, tokens = lane.steps - steps0, lane.tokens - tokens0
    for (st, sd, _), (bt, bd, _) in zip(solo, both):
        assert bt == st and bd["usage"] == sd["usage"] and bd["finish_reason"] == sd["finish_reason"]
    decode_tokens = sum(d["usage"]["completion_tokens"] - 1 for _, d, _ in both)  # the first comes from prefill
    assert tokens == decode_tokens
    # Solo, every decoded token is its own step; batched, the streams shared steps.
    assert steps < 0.6 * decode_tokens, (steps, decode_tokens)
    assert all(d["tokens_per_s"] and d["ttft_ms"] for _, d, _ in both)


def test_more_requests_than_slots_wait_for_a_slot(live) -> None:  # noqa: ANN001
    url = f"{live.ws}/v1/text"
    n = live.svc.engine.n_slots + 3

    async def many():  # noqa: ANN202
        return await asyncio.gather(*[_ws_request(url, {"messages": FRANCE, "temperature": 0, "max_tokens": 4})
                                      for _ in range(n)])

    out = _run(many())
    assert [t for t, _, _ in out] == ["The capital of France"] * n
    _run(live.wait_idle(2.0))  # the last job is reaped at the worker's next step, maybe after its "done"
    assert live.state.scheduler.active == 0 and live.svc.prefill_lane.pool.available() == live.svc.engine.n_slots


def test_seeded_sampling_is_reproducible(live) -> None:  # noqa: ANN001
    url = f"{live.ws}/v1/text"
    start = {"messages": PROMPTS[2], "temperature": 1.0, "top_p": 0.95, "seed": 1234, "max_tokens": 20}
    a = _run(_ws_request(url, start))[0]
    b = _run(_ws_request(url, start))[0]

    async def beside():  # noqa: ANN202
        return await asyncio.gather(_ws_request(url, {**start, "seed": 99}), _ws_request(url, start),
                                    _ws_request(url, {**start, "messages": FRANCE}))

    other, c, _ = _run(beside())
    assert a == b == c[0] and a
    assert other[0] != a  # the seed matters


def test_penalties_through_both_surfaces(live) -> None:  # noqa: ANN001
    """frequency_penalty / presence_penalty from /v1/text and /v1/chat/completions: the same reply
    twice, and not the unpenalised one (see the engine-level test for the arithmetic)."""
    cat = {"prompt": "The cat and the dog and the", "temperature": 0, "max_tokens": 16}
    url = f"{live.ws}/v1/text"
    plain, penalised, again = (_run(_ws_request(url, {**cat, **pen}))[0]
                               for pen in ({}, {"presence_penalty": -2.0}, {"presence_penalty": -2.0}))
    assert penalised != plain and penalised == again, (plain, penalised)
    chat = f"{live.http}/v1/chat/completions"
    body = {"messages": PROMPTS[2], "temperature": 0, "max_tokens": 24}
    replies = [httpx.post(chat, json={**body, **pen}, timeout=60).json()["choices"][0]["message"]["content"]
               for pen in ({}, {"frequency_penalty": 1.5}, {"frequency_penalty": 1.5})]
    assert replies[1] == replies[2] and replies[0] != replies[1], replies


def test_stop_strings_and_max_tokens(live) -> None:  # noqa: ANN001
    url = f"{live.ws}/v1/text"
    text, done, _ = _run(_ws_request(url, {"messages": FRANCE, "temperature": 0, "stop": ["Paris"]}))
    assert text == "The capital of France is " and done["finish_reason"] == "stop"
    # a stop string spread over several tokens: its first tokens were held back, never sent
    text, done, _ = _run(_ws_request(url, {"messages": FRANCE, "temperature": 0, "stop": [" of Fr", "zzz"]}))
    assert text == "The capital" and done["finish_reason"] == "stop"
    text, done, _ = _run(_ws_request(url, {"messages": FRANCE, "temperature": 0, "max_tokens": 3}))
    assert text == "The capital of" and done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 3
    # a raw prompt (no chat template) runs to max_tokens
    text, done, _ = _run(_ws_request(url, {"prompt": "The quick brown fox", "temperature": 0, "max_tokens": 5}))
    assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 5 and text


def test_pipelined_decode_lane_gives_the_same_replies(live) -> None:  # noqa: ANN001
    """With one step in flight (the CUDA default: step n+1 launched before step n is read), the replies,
    stops, max-token cuts and usage are those of the read-every-step lane; a reply that ends on eos
    or a stop string had one extra token computed, which is dropped."""
    url = f"{live.ws}/v1/text"
    starts = [{"messages": p, "temperature": 0, "max_tokens": 24} for p in PROMPTS]
    starts += [{"messages": FRANCE, "temperature": 0, "stop": ["Paris"]},
               {"messages": FRANCE, "temperature": 0, "max_tokens": 3},
               {"messages": PROMPTS[2], "temperature": 1.0, "seed": 7, "max_tokens": 12}]

    async def together():  # noqa: ANN202
        return await asyncio.gather(*[_ws_request(url, s) for s in starts])

    lane = live.svc.decode_lane
    assert lane.pipelined is False  # the CPU default
    want = _run(together())
    try:
        lane.pipelined = True
        dropped0 = lane.dropped
        got = _run(together())
        solo = [_run(_ws_request(url, s)) for s in starts[4:]]
    finally:
        lane.pipelined = False
    for (wt, wd, _), (gt, gd, _) in zip(want, got):
        assert gt == wt and gd["usage"] == wd["usage"] and gd["finish_reason"] == wd["finish_reason"]
    assert [t for t, _, _ in solo] == [t for t, _, _ in want[4:]]
    assert got[5][1]["usage"]["completion_tokens"] == 3 and got[4][0] == "The capital of France is "
    assert lane.dropped > dropped0  # the stop-string reply's extra token


@pytest.mark.parametrize("pipelined", [False, True])
def test_cancel_frees_the_slot_and_the_connection_goes_on(live, pipelined) -> None:  # noqa: ANN001
    """Cancel mid-reply: the slot comes back, the connection takes the next request. Pipelined too
    (the CUDA default), where the cancelled reply may still have a step in flight on its slot."""
    url = f"{live.ws}/v1/text"
    sched = live.state.scheduler
    lane = live.svc.decode_lane

    async def go():  # noqa: ANN202
        await live.wait_idle(2.0)  # (an earlier test's job is reaped lazily)
        assert sched.active == 0
        free0 = live.svc.prefill_lane.pool.available()
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"type": "start", "prompt": "Once upon a time", "temperature": 0.8,
                                      "seed": 1, "max_tokens": 200}))
            assert json.loads(await ws.recv())["type"] == "ready"
            first = json.loads(await ws.recv())
            assert first["type"] == "delta"
            await ws.send(json.dumps({"type": "cancel"}))
            while (msg := json.loads(await ws.recv()))["type"] == "delta":
                pass
            assert msg["type"] == "done" and msg["finish_reason"] == "cancelled", msg
            assert msg["usage"]["completion_tokens"] < 200
            await live.wait_idle(2.0)
            # reaped before the next step: at most one step (~tens of ms here) after the cancel
            assert sched.active == 0 and live.svc.prefill_lane.pool.available() == free0
            await ws.send(json.dumps({"type": "cancel"}))  # late cancel: ignored
            await ws.send(json.dumps({"type": "start", "messages": FRANCE, "temperature": 0, "max_tokens": 3}))
            assert json.loads(await ws.recv())["type"] == "ready"
            parts = []
            while (msg := json.loads(await ws.recv()))["type"] == "delta":
                parts.append(msg["text"])
            assert msg["finish_reason"] == "length" and "".join(parts) == "The capital of"

    lane.pipelined = pipelined
    try:
        _run(go())
    finally:
        lane.pipelined = False


def test_bad_input_errors(live) -> None:  # noqa: ANN001
    url = f"{live.ws}/v1/text"

    async def expect_error(msgs: list[dict], code: str, close: int) -> None:
        async with websockets.connect(url) as ws:
            for m in msgs:
                await ws.send(json.dumps(m))
            while (msg := json.loads(await ws.recv()))["type"] != "error":
                pass
            assert msg["code"] == code, msg
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
            assert ws.close_code == close

    _run(expect_error([{"type": "start"}], "missing_field", 1008))
    _run(expect_error([{"type": "start", "prompt": "x", "temperature": -1}], "bad_field", 1008))
    _run(expect_error([{"type": "poke"}], "unknown_type", 1008))
    _run(expect_error([{"type": "start", "prompt": "Once upon a time", "max_tokens": 100},
                       {"type": "start", "prompt": "again"}], "bad_state", 1008))
    _run(expect_error([{"type": "start", "prompt": "word " * 400}], "context_length_exceeded", 1008))

    chat = f"{live.http}/v1/chat/completions"
    for body, code in (({"messages": FRANCE, "temperature": 5}, "bad_field"), ({"model": "m"}, "missing_field"),
                       ({"messages": [{"role": "user", "content": "word " * 400}]}, "context_length_exceeded")):
        r = httpx.post(chat, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(chat, content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    for extra in ({"response_format": {"type": "json_object"}}, {"logit_bias": {"1": 5}}, {"top_logprobs": 2}):
        r = httpx.post(chat, json={"messages": FRANCE, **extra}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] in ("unsupported", "bad_field"), r.text
    assert live.state.scheduler.active == 0


def test_python_api_models_and_ttft_metric(live) -> None:  # noqa: ANN001
    svc = live.svc

    async def use():  # noqa: ANN202
        job = svc.submit(FRANCE, GenParams(temperature=0, max_tokens=32))
        events = [ev async for ev in job.stream()]
        return events

    events = _run(use())
    assert isinstance(events[-1], TextDone) and all(isinstance(e, TextDelta) for e in events[:-1])
    text = "".join(e.text for e in events[:-1])
    assert "Paris" in text and events[-1].text == text and events[-1].finish_reason == "stop"
    assert sum(e.tokens for e in events[:-1]) <= events[-1].completion_tokens
    models = httpx.get(f"{live.http}/v1/models", timeout=10).json()["data"]
    assert any(m["kind"] == "text" and m["context_tokens"] == 256 for m in models)
    for m in models:  # OpenAI's model object fields on every entry (TTS, ASR, text, agent)
        assert m["object"] == "model" and isinstance(m["created"], int) and m["owned_by"] and m["id"], m
    metrics = httpx.get(f"{live.http}/metrics", timeout=10).text
    count = [ln for ln in metrics.splitlines() if ln.startswith("realtime_text_ttft_seconds_count")]
    assert count and float(count[0].split()[1]) >= 1


def test_python_text_client(live) -> None:  # noqa: ANN001
    """realtime.clients.text against the live server: replies on one connection (msgpack and JSON
    frames), the same text as chat completions, a cancel from another task, a refused request."""
    import realtime.protocol.frames as frames
    from realtime.clients.text import ServerError, TextClient

    want = httpx.post(f"{live.http}/v1/chat/completions", json={"messages": FRANCE, "temperature": 0, "max_tokens": 32},
                      timeout=60).json()["choices"][0]["message"]["content"]

    async def use(wire):  # noqa: ANN001, ANN202
        async with TextClient(f"{live.ws}/v1/text", wire=wire) as c:
            streamed = "".join([d.text async for d in c.generate(messages=FRANCE, temperature=0, max_tokens=32)])
            first = (c.ready, c.done)
            again, done = await c.complete(messages=FRANCE, temperature=0, max_tokens=32, logprobs=True)
            pieces = []
            async for d in c.generate(prompt="Once upon a time", temperature=0, max_tokens=200):
                pieces.append(d)
                if len(pieces) == 2:
                    asyncio.ensure_future(c.cancel())  # (another task, as an app's stop button would)
            cancelled = c.done
            with pytest.raises(ServerError) as exc:
                await c.complete(prompt="x", temperature=5)
            return streamed, first, again, done, pieces, cancelled, exc.value.code

    for wire in (frames.WireFormat.JSON, frames.WireFormat.MSGPACK):
        streamed, (ready, done1), again, done, pieces, cancelled, code = _run(use(wire))
        assert streamed == again == want and ready["prompt_tokens"] > 10 and done1["finish_reason"] == "stop"
        assert done["usage"]["completion_tokens"] == done1["usage"]["completion_tokens"]
        assert cancelled["finish_reason"] == "cancelled" and 2 <= len(pieces) < 200
        assert code == "bad_field"


def test_chat_cli_against_the_live_server(live) -> None:  # noqa: ANN001
    url = f"{live.ws}/v1/text"
    r = subprocess.run([sys.executable, "-m", "realtime.cli", "chat", "-p", "What is the capital of France?",
                        "--url", url], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout
    # interactive, stdin piped: one reply per line, the conversation carries over
    r = subprocess.run([sys.executable, "-m", "realtime.cli", "chat", "--url", url, "--max-tokens", "12",
                        "--system", "You are a helpful assistant."],
                       input="What is the capital of France?\nThank you!\n", capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout and r.stderr.count("tokens, ttft") == 2
    r = subprocess.run([sys.executable, "-m", "realtime.cli", "chat", "-p", "What is the capital of France?",
                        "--url", url, "--presence-penalty", "5"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "presence_penalty" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "realtime.cli", "chat", "-p", "hi", "--url", "ws://127.0.0.1:9/v1/text"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr


def test_padding_rows_on_the_scratch_slot_change_nothing(live) -> None:  # noqa: ANN001
    """What a graphed step does on any device: rows padded with the scratch slot leave the real rows'
    tokens as an unpadded step gives them (checked eagerly here; the GPU test checks the graph)."""
    import torch

    from realtime.text_service import BatchDecoder

    model, tok = live.svc.model, live.svc.tokenizer
    runs = []
    for pad in (0, 2):
        dec = BatchDecoder(model, 2, 96)
        out = [[dec.start(s, tok.encode(tok.apply_chat_template(PROMPTS[s])), 0.8, 0, 1.0, seed=s)] for s in range(2)]
        idx = torch.tensor([0, 1] + [dec.scratch] * pad)
        for _ in range(6):
            with torch.inference_mode():
                nxt = dec._eager(idx, "filter")
                dec._reset_scratch()
            for s in range(2):
                out[s].append(int(nxt[s]))
        assert int(dec.pos[dec.scratch]) == 0
        runs.append(out)
    assert runs[0] == runs[1]


def test_fused_advance_gives_the_torch_ops_tokens(live) -> None:  # noqa: ANN001
    """The one-launch token pick and slot bookkeeping (kernels/sampling.advance_rows, on by default on
    CUDA; here through the Triton interpreter) against the torch ops: greedy and temperature-only
    steps, rows padded with the scratch slot, the same tokens, positions and sampler steps."""
    import torch

    from realtime.text_service import BatchDecoder

    model, tok = live.svc.model, live.svc.tokenizer
    assert not BatchDecoder(model, 1, 32).fused_advance  # (off on the CPU unless asked for)
    runs = []
    for fused in (False, True):
        dec = BatchDecoder(model, 3, 96)
        dec.use_fused_advance(fused)
        temps = (0.0, 0.9, 1.3)
        out = [[dec.start(s, tok.encode(tok.apply_chat_template(PROMPTS[s])), temps[s], 0, 1.0, seed=s)]
               for s in range(3)]
        idx = torch.tensor([0, 1, 2, dec.scratch])
        for i in range(6):
            with torch.inference_mode():
                nxt = dec._eager(idx if i % 2 else idx[:3], "greedy" if i == 2 else "sample")
                if not fused:
                    dec._reset_scratch()
            for s in range(3):
                out[s].append(int(nxt[s]))
        runs.append((out, dec.pos.tolist(), dec.step_no.tolist(), dec.tok.tolist()))
    assert runs[0] == runs[1]
    assert runs[0][0][1] != runs[0][0][2]  # the sampled rows sampled


def test_penalties_equal_a_plain_loop_and_leave_other_rows_alone(live) -> None:  # noqa: ANN001
    """OpenAI's frequency and presence penalties (logit - f * count - p * (count > 0), over the
    reply's own tokens) against a plain loop over the model's decode step with its own counts: a
    penalised greedy row, an unpenalised greedy row and a penalised sampled row in the same steps."""
    import torch

    from realtime.engines.sampling import sample
    from realtime.text_service import PREFIX_CHUNK, BatchDecoder

    model, tok = live.svc.model, live.svc.tokenizer
    n = 4
    ids = [tok.encode("The cat and the dog and the")] * n  # (greedy: " cat and the dog are all the same. ...")
    rows = [(0.0, 1.5, 0.0), (0.0, 0.0, 0.0), (0.0, 0.0, -2.0), (0.9, 0.3, 1.5)]  # (temperature, frequency, presence)
    steps = 20

    dec = BatchDecoder(model, n, 128)
    out = [[dec.start(s, ids[s], t, 0, 1.0, s, f, p)] for s, (t, f, p) in enumerate(rows)]
    for _ in range(steps):
        for s, t in enumerate(dec.step(list(range(n)), greedy=False, filtered=False, penalized=True)):
            out[s].append(t)

    # the loop: its own cache, the same prefill chunks and batch, the penalties and counts by hand
    cache = model.new_cache(n, 128)
    ref, counts, last = [[] for _ in rows], torch.zeros(n, model.vocab_size), []
    with torch.inference_mode():
        for s in range(n):
            for at in range(0, len(ids[s]), PREFIX_CHUNK):
                logits = model.prefill(cache, s, ids[s][at:at + PREFIX_CHUNK], start_pos=at)
            last.append(logits)
        logits = torch.stack(last)
        for i in range(steps + 1):
            temp = torch.tensor([r[0] for r in rows])
            f, p = torch.tensor([r[1] for r in rows])[:, None], torch.tensor([r[2] for r in rows])[:, None]
            pen = logits - f * counts - p * (counts > 0).float()
            nxt = sample(pen, temp, torch.zeros(n, dtype=torch.long), torch.ones(n), torch.arange(n),
                         torch.full((n,), i))
            for s in range(n):
                ref[s].append(int(nxt[s]))
                counts[s, nxt[s]] += 1
            pos = torch.tensor([len(ids[s]) + i for s in range(n)])
            logits = model.decode_step(cache, torch.arange(n), nxt, pos)
    assert out == ref
    # the same prompt: each penalty changed the greedy reply; a negative presence penalty repeats more
    assert out[0] != out[1] and out[2] != out[1]
    assert max(out[2].count(t) for t in out[2]) > max(out[1].count(t) for t in out[1])


def test_logprobs_are_the_models_and_leave_the_tokens(live) -> None:  # noqa: ANN001
    """A step asked for logprobs gives each row's log_softmax (the model's logits, before penalties
    and temperature) at its token and its top k, as a plain loop over the model computes them; the
    tokens are those of the same steps without logprobs."""
    import torch

    from realtime.engines.sampling import sample
    from realtime.text_service import PREFIX_CHUNK, BatchDecoder

    model, tok = live.svc.model, live.svc.tokenizer
    ids = [tok.encode(tok.apply_chat_template(PROMPTS[s])) for s in (0, 2)]
    rows = [(0.0, 0.0), (1.0, 0.8)]  # (temperature, presence penalty)
    steps, k = 8, 3
    runs = []
    for lp in (None, k):
        dec = BatchDecoder(model, 2, 128)
        out, lps = [[dec.start(s, ids[s], t, 0, 1.0, s, 0.0, p, logprobs=lp)] for s, (t, p) in enumerate(rows)], []
        for _ in range(steps):
            res = dec.launch([0, 1], greedy=False, filtered=False, penalized=True, logprobs=lp)
            for s, t in enumerate(res.result()):
                out[s].append(t)
            lps.append(res.logprobs())
        runs.append((out, lps))
    assert runs[0][0] == runs[1][0] and runs[0][1] == [None] * steps
    out, lps = runs[1]
    cache = model.new_cache(2, 128)
    counts = torch.zeros(2, model.vocab_size)
    with torch.inference_mode():
        last = []
        for s in range(2):
            for at in range(0, len(ids[s]), PREFIX_CHUNK):
                logits = model.prefill(cache, s, ids[s][at:at + PREFIX_CHUNK], start_pos=at)
            last.append(logits)
        for s in range(2):
            counts[s, out[s][0]] += 1
        logits = torch.stack(last)
        for i in range(1, steps + 1):
            nxt = torch.tensor([out[0][i - 1], out[1][i - 1]])
            pos = torch.tensor([len(ids[s]) + i - 1 for s in range(2)])
            logits = model.decode_step(cache, torch.arange(2), nxt, pos)
            lsm = torch.log_softmax(logits, -1)
            pen = logits - torch.tensor([[0.0], [0.8]]) * (counts > 0).float()
            again = sample(pen, torch.tensor([0.0, 1.0]), torch.zeros(2, dtype=torch.long), torch.ones(2),
                           torch.arange(2), torch.full((2,), i))
            assert again.tolist() == [out[0][i], out[1][i]]
            for s in range(2):
                chosen, top = lps[i - 1][s]
                assert chosen == pytest.approx(float(lsm[s, out[s][i]]), abs=1e-5)
                vals, best = lsm[s].topk(k)
                assert [t for t, _ in top] == best.tolist()
                assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=1e-5)
                counts[s, out[s][i]] += 1
            assert lps[i - 1][0][0] == lps[i - 1][0][1][0][1]  # the greedy row's token is its top 1


def test_logprobs_through_chat_completions_and_v1_text(live) -> None:  # noqa: ANN001
    """OpenAI's logprobs shape: one entry a content token, its bytes adding up to the reply, the
    token the top alternative for a greedy reply; streamed chunks carry the same entries."""
    chat = f"{live.http}/v1/chat/completions"
    body = {"messages": FRANCE, "temperature": 0, "max_tokens": 24, "logprobs": True, "top_logprobs": 2}
    out = httpx.post(chat, json=body, timeout=60).json()
    text, entries = out["choices"][0]["message"]["content"], out["choices"][0]["logprobs"]["content"]
    assert "Paris" in text and bytes(b for e in entries for b in e["bytes"]).decode() == text
    for e in entries:
        assert e["logprob"] <= 0 and len(e["top_logprobs"]) == 2
        assert e["top_logprobs"][0]["token"] == e["token"] and e["top_logprobs"][0]["logprob"] == e["logprob"]
        assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
    assert httpx.post(chat, json={**body, "logprobs": False, "top_logprobs": 0}, timeout=60).json()["choices"][0][
        "logprobs"] is None
    with httpx.stream("POST", chat, json={**body, "stream": True}, timeout=60) as resp:
        chunks = [json.loads(ln[6:]) for ln in resp.iter_lines() if ln.startswith("data: {")]
    streamed = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == entries
    deltas = []

    async def ws() -> None:
        async with websockets.connect(f"{live.ws}/v1/text") as conn:
            await conn.send(json.dumps({"type": "start", **body}))
            while (msg := json.loads(await conn.recv()))["type"] != "done":
                deltas.append(msg)

    _run(ws())
    assert [e for d in deltas if d["type"] == "delta" for e in d["logprobs"]] == entries
    openai = pytest.importorskip("openai")
    res = openai.OpenAI(base_url=f"{live.http}/v1", api_key="unused").chat.completions.create(
        model="m", messages=FRANCE, temperature=0, max_tokens=24, logprobs=True, top_logprobs=2)
    assert [c.token for c in res.choices[0].logprobs.content] == [e["token"] for e in entries]


def test_legacy_completions_endpoint(live) -> None:  # noqa: ANN001
    """POST /v1/completions: a raw prompt, OpenAI's text_completion shapes (16 tokens by default),
    the same reply as /v1/text gives the prompt; legacy logprobs as parallel lists; streamed."""
    url = f"{live.http}/v1/completions"
    body = {"model": "m", "prompt": "The capital of France is", "temperature": 0, "max_tokens": 12}
    out = httpx.post(url, json=body, timeout=60).json()
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-"), out
    text = out["choices"][0]["text"]
    assert "Paris" in text and out["choices"][0]["finish_reason"] in ("stop", "length")
    assert text == _run(_ws_request(f"{live.ws}/v1/text", {k: v for k, v in body.items() if k != "model"}))[0]
    assert 0 < out["usage"]["completion_tokens"] <= 12 and out["usage"]["total_tokens"] == (
        out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"])
    assert httpx.post(url, json={"prompt": ["Once upon a time"], "temperature": 0},
                      timeout=60).json()["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens
    lp = httpx.post(url, json={**body, "logprobs": 2}, timeout=60).json()["choices"][0]
    assert lp["text"] == text
    info = lp["logprobs"]
    assert "".join(info["tokens"]) == text and len(info["token_logprobs"]) == len(info["tokens"])
    assert info["text_offset"] == [sum(len(t) for t in info["tokens"][:i]) for i in range(len(info["tokens"]))]
    assert all(v <= 0 for v in info["token_logprobs"]) and all(1 <= len(t) <= 2 for t in info["top_logprobs"])
    with httpx.stream("POST", url, json={**body, "logprobs": 2, "stream": True,
                                         "stream_options": {"include_usage": True}}, timeout=60) as resp:
        chunks = [json.loads(ln[6:]) for ln in resp.iter_lines() if ln.startswith("data: {")]
    parts = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(p["text"] for p in parts) == text and parts[-1]["finish_reason"] == lp["finish_reason"]
    assert [t for p in parts if p["logprobs"] for t in p["logprobs"]["tokens"]] == info["tokens"]
    assert [t for p in parts if p["logprobs"] for t in p["logprobs"]["text_offset"]] == info["text_offset"]
    assert chunks[-1]["usage"] == out["usage"] and chunks[-1]["choices"] == []
    for bad in ({"prompt": ["a", "b"]}, {"prompt": [1, 2]}, {"prompt": "a", "logprobs": 6}, {"prompt": "a", "n": 2},
                {"prompt": "a", "echo": True}, {"prompt": "a", "suffix": "z"}, {"messages": FRANCE}, {}):
        r = httpx.post(url, json=bad, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (bad, r.text)
    openai = pytest.importorskip("openai")
    res = openai.OpenAI(base_url=f"{live.http}/v1", api_key="unused").completions.create(
        model="m", prompt="The capital of France is", temperature=0, max_tokens=12, logprobs=2)
    assert res.choices[0].text == text and res.choices[0].logprobs.tokens == info["tokens"]


def test_unfiltered_sampling_skips_the_sort_and_keeps_the_tokens(live) -> None:  # noqa: ANN001
    """Rows without top-k/top-p (the API default) are sampled without the vocabulary sort: the same
    tokens as the filtering path, greedy rows mixed in; the lane picks the mode from the requests."""
    from realtime.text_service import BatchDecoder

    model, tok = live.svc.model, live.svc.tokenizer
    runs = []
    for filtered in (True, False):
        dec = BatchDecoder(model, 3, 96)
        temps = (0.8, 0.0, 1.3)
        out = [[dec.start(s, tok.encode(tok.apply_chat_template(PROMPTS[s])), temps[s], 0, 1.0, seed=s)]
               for s in range(3)]
        for _ in range(8):
            for s, t in enumerate(dec.step([0, 1, 2], greedy=False, filtered=filtered)):
                out[s].append(t)
        runs.append(out)
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][2]  # the sampled rows really sampled (different seeds, temperatures)
    # through the server: a default request (temperature 1, no top-k/top-p) is seeded-reproducible
    # beside a filtered one in the same steps
    url = f"{live.ws}/v1/text"
    plain = {"messages": PROMPTS[1], "temperature": 1.0, "seed": 5, "max_tokens": 12}
    alone = _run(_ws_request(url, plain))[0]

    async def beside():  # noqa: ANN202
        return await asyncio.gather(_ws_request(url, plain), _ws_request(url, {**plain, "top_p": 0.9, "seed": 6}))

    assert _run(beside())[0][0] == alone and alone


@pytest.mark.gpu
def test_cuda_graph_step_equals_eager(tmp_path) -> None:  # noqa: ANN001
    """The CUDA-graphed step (padded to a bucket, static slot buffer) gives the eager step's tokens,
    with streams joining and leaving between steps, greedy and sampled. A random Llama saved with
    save_pretrained (head dim 32: the decode-attention kernel's path), so the device needs no model package."""
    import torch
    import transformers

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from realtime.engines.llama import TextModel
    from realtime.text_service import BatchDecoder

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
                                   num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    model = TextModel.from_pretrained(tmp_path, device="cuda", dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (12, 30, 7, 19)]
    runs = []
    # (the torch ops' token pick and bookkeeping, eager, then the one-launch advance_rows)
    for graphs, pipelined, fused in ((False, False, False), (False, False, True), (True, False, True), (True, True, True)):
        dec = BatchDecoder(model, 6, 256, cuda_graphs=graphs)
        assert dec.cuda_graphs is graphs
        dec.use_fused_advance(fused)
        out: dict[int, list[int]] = {s: [] for s in range(4)}
        for s, ids in enumerate(prompts):
            temp = 0.0 if s % 2 == 0 else 0.9
            out[s].append(dec.start(s, ids, temp, 0 if s < 2 else 40, 0.95, seed=100 + s))
        pending = None
        for step in range(24):
            # the batch changes shape: 4, 3 (slot 1 gone), then 2, then all four again
            active = [0, 1, 2, 3] if step < 6 or step >= 18 else [0, 2, 3] if step < 12 else [2, 3]
            greedy = all(s % 2 == 0 for s in active)
            if not pipelined:
                for s, t in zip(active, dec.step(active, greedy=greedy)):
                    out[s].append(t)
                continue
            # as the decode lane does: launch this step, then read the one before
            launched = (active, dec.launch(active, greedy=greedy))
            if pending is not None:
                for s, t in zip(pending[0], pending[1].result()):
                    out[s].append(t)
            pending = launched
        if pending is not None:
            for s, t in zip(pending[0], pending[1].result()):
                out[s].append(t)
        runs.append(out)
        if graphs:
            assert {k[0] for k in dec._graphs} >= {2, 4}  # buckets were captured and replayed
    assert runs[0] == runs[1] == runs[2] == runs[3]
    # rows without top-k/top-p: the graphed unsorted sampler gives the eager filtering path's tokens
    plain = []
    for graphs, filtered, fused in ((False, True, False), (True, False, False), (True, False, True)):
        dec = BatchDecoder(model, 6, 256, cuda_graphs=graphs)
        dec.use_fused_advance(fused)
        out = {s: [dec.start(s, ids, 0.9 if s % 2 else 0.0, 0, 1.0, seed=200 + s)] for s, ids in enumerate(prompts)}
        for _ in range(12):
            for s, t in zip(range(4), dec.step([0, 1, 2, 3], greedy=False, filtered=filtered)):
                out[s].append(t)
        plain.append(out)
    assert plain[0] == plain[1] == plain[2]
    # penalised rows (graphed "penalize" steps, beside eager steps with logprobs): the eager decoder's
    # tokens, through a batch change
    pen = []
    for graphs, lp in ((False, None), (True, None), (True, 2)):  # (lp: every other step eager, with logprobs)
        dec = BatchDecoder(model, 6, 256, cuda_graphs=graphs)
        rows = [(0.0, 1.5, 0.0), (0.9, 0.0, 0.0), (0.0, 0.0, -2.0), (0.9, 0.4, 1.0)]  # (temperature, freq, presence)
        out = {s: [dec.start(s, ids, t, 0, 1.0, 300 + s, f, p)] for s, (ids, (t, f, p)) in enumerate(zip(prompts, rows))}
        for step in range(16):
            active = [0, 1, 2, 3] if step < 8 else [0, 3]
            ask = lp if step % 2 else None
            res = dec.launch(active, greedy=False, filtered=False, penalized=True, logprobs=ask)
            for s, t in zip(active, res.result()):
                out[s].append(t)
            if ask:
                assert all(len(top) == 2 and c <= 0 for c, top in res.logprobs())
        pen.append(out)
    assert pen[0] == pen[1] == pen[2]
