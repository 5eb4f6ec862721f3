"""A real uvicorn server on loopback, in a thread, for the server tests (and a one-request client)."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import msgpack
import uvicorn
import websockets
from starlette.applications import Starlette


@dataclass
class Live:
    host: str
    port: int
    app: Starlette

    @property
    def ws(self) -> str:
        return f"ws://{self.host}:{self.port}"

    @property
    def http(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def state(self):  # noqa: ANN201 - realtime.server.AppState
        return self.app.state.realtime

    async def wait_idle(self, timeout: float = 3.0) -> float:
        """Seconds until no job is left on the scheduler (ended jobs are reaped between worker steps,
        so one may outlive its client's last message by a step), or ``timeout``."""
        t0 = time.monotonic()
        while self.state.scheduler.active and time.monotonic() - t0 < timeout:
            await asyncio.sleep(0.005)
        return time.monotonic() - t0


@contextmanager
def serve(app: Starlette, ws_max_size: int = 4 << 20, deflate: bool = False,
          run: Callable[[Callable[[], None]], None] | None = None) -> Iterator[Live]:
    """uvicorn on 127.0.0.1, an ephemeral port, in a thread named "uvicorn". ``deflate`` offers
    permessage-deflate (off, as `realtime serve`); ``run(server_run)``, if given, runs the server
    loop in that thread (e.g. under a profiler)."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", ws_max_size=ws_max_size,
                            lifespan="on", ws_per_message_deflate=deflate)
    server = uvicorn.Server(config)
    target = server.run if run is None else (lambda: run(server.run))
    thread = threading.Thread(target=target, name="uvicorn", daemon=True)
    thread.start()
    t0 = time.monotonic()
    while not server.started:
        if not thread.is_alive() or time.monotonic() - t0 > 120:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield Live("127.0.0.1", port, app)
    finally:
        server.should_exit = True
        thread.join(30)


async def session(url: str, start: dict, json_frames: bool = False, on_msg=None) -> tuple[list[dict], int]:  # noqa: ANN001
    """Send one ``start`` over a real WebSocket and collect every message until the server closes;
    returns (messages, close code). JSON frames: binary fields (image, video) come back as bytes."""
    msgs = []
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps(start) if json_frames else msgpack.packb(start, use_bin_type=True))
        try:
            async for frame in ws:
                msg = json.loads(frame) if json_frames else msgpack.unpackb(frame, raw=False)
                for key in ("image", "video"):
                    if json_frames and key in msg:
                        msg[key] = base64.b64decode(msg[key])
                msg["_t"] = time.monotonic()
                msgs.append(msg)
                if on_msg is not None:
                    await on_msg(ws, msg)
        except websockets.ConnectionClosed:
            pass
        code = ws.close_code
    return msgs, code
