"""Python streaming client for /v1/text: one connection, any number of replies, one at a time.

    async with TextClient("ws://127.0.0.1:8000/v1/text") as c:
        async for d in c.generate(messages=[{"role": "user", "content": "Hi!"}], max_tokens=64):
            print(d.text, end="", flush=True)
        print(c.done["usage"], c.done["ttft_ms"])
        text, done = await c.complete(prompt="Once upon a time", max_tokens=32, temperature=0)

``generate`` takes the ``start`` fields of docs/protocol.md (``max_tokens``, ``temperature``,
``top_p``, ``top_k``, ``stop``, ``seed``, ``frequency_penalty``, ``presence_penalty``,
``logprobs``, ``top_logprobs``). ``cancel()`` (from another task) ends the running reply; its
``done`` then has ``finish_reason`` "cancelled".
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import websockets

from realtime.clients.wire import ServerError, recv_message
from realtime.protocol.frames import WireFormat, encode_frame

__all__ = ["TextClient", "Delta", "ServerError"]


@dataclass
class Delta:
    text: str
    tokens: int  # completion tokens this piece of text covers
    logprobs: list[dict[str, Any]] | None = None  # with logprobs: OpenAI's entries of those tokens


class TextClient:
    def __init__(self, url: str, *, api_key: str | None = None, wire: WireFormat = WireFormat.JSON,
                 open_timeout: float = 30.0) -> None:
        self.url, self.api_key, self.wire, self.open_timeout = url, api_key, wire, open_timeout
        self.ws: Any = None
        self.ready: dict[str, Any] | None = None  # the last reply's ``ready`` (model, context, prompt tokens)
        self.done: dict[str, Any] | None = None  # the last reply's ``done`` (finish_reason, usage, timings)
        self._busy = False

    async def __aenter__(self) -> "TextClient":
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        self.ws = await websockets.connect(self.url, additional_headers=headers, open_timeout=self.open_timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.ws.close()

    async def _recv(self) -> dict[str, Any]:
        return await recv_message(self.ws, 1 << 26)

    async def generate(self, messages: list[dict[str, Any]] | None = None, prompt: str | None = None,
                       **params: Any) -> AsyncIterator[Delta]:
        """Stream one reply to ``messages`` (chat) or ``prompt`` (raw text). Raises ServerError for
        a refused request (the server then closes the connection)."""
        if self._busy:
            raise RuntimeError("a reply is still running on this connection: read it to the end or cancel() it")
        start: dict[str, Any] = {"type": "start", **params}
        if messages is not None:
            start["messages"] = messages
        if prompt is not None:
            start["prompt"] = prompt
        self._busy = True
        self.ready = self.done = None
        try:
            await self.ws.send(encode_frame(start, self.wire))
            while True:
                msg = await self._recv()
                kind = msg.get("type")
                if kind == "ready":
                    self.ready = msg
                elif kind == "delta":
                    yield Delta(msg["text"], msg["tokens"], msg.get("logprobs"))
                elif kind == "done":
                    self.done = msg
                    return
        finally:
            self._busy = False

    async def complete(self, messages: list[dict[str, Any]] | None = None, prompt: str | None = None,
                       **params: Any) -> tuple[str, dict[str, Any]]:
        """The whole reply and its ``done``."""
        parts = [d.text async for d in self.generate(messages, prompt, **params)]
        assert self.done is not None
        return "".join(parts), self.done

    async def cancel(self) -> None:
        """End the running reply (the server answers ``done`` with finish_reason "cancelled")."""
        await self.ws.send(encode_frame({"type": "cancel"}, self.wire))
