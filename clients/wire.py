"""What every realtime client shares: the server's error, and reading one message off the socket."""

from __future__ import annotations

import asyncio
from typing import Any

import websockets

from realtime.protocol.frames import decode_frame

__all__ = ["ServerError", "recv_message"]


class ServerError(Exception):
    """The server sent an ``error`` message (or closed abnormally)."""

    def __init__(self, code: str, message: str, close_code: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.close_code = code, message, close_code


async def recv_message(ws: Any, max_size: int) -> dict[str, Any]:
    """The next message (JSON or msgpack frame). An ``error`` message or an abnormal close raises
    ServerError; after an error it waits up to 2 s for the close, to report the close code."""
    try:
        data = await ws.recv()
    except websockets.ConnectionClosed as exc:
        rcv = exc.rcvd
        raise ServerError("closed", rcv.reason if rcv else "connection closed", rcv.code if rcv else None) from None
    msg, _ = decode_frame(data, max_size=max_size)
    if msg.get("type") == "error":
        close_code = None
        try:
            await asyncio.wait_for(ws.wait_closed(), 2.0)
            close_code = ws.close_code
        except asyncio.TimeoutError:
            pass
        raise ServerError(msg.get("code", "error"), msg.get("message", ""), close_code)
    return msg
