"""A real uvicorn server on loopback, in a thread, for the server tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn
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


@contextmanager
def serve(app: Starlette, ws_max_size: int = 4 << 20) -> Iterator[Live]:
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", ws_max_size=ws_max_size,
                            lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
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


