"""A small Chrome DevTools Protocol driver over websockets (no Node, no Playwright).

Why CDP from Python: the test process already runs the uvicorn server and owns the event loop,
`websockets` is already a dependency, and the few things the tests need (open a page, evaluate
JS, wait for a condition, click, screenshot, collect console errors) are a handful of CDP calls.
It works with the Debian `chromium` package as it is; there is no driver/browser version pinning.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import websockets

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

# This machine has no network: keep Chromium from trying to reach anything, and give it a fake
# microphone (a WAV file) and autoplay without a user gesture.
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-default-apps", "--disable-extensions",
    "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
    "--autoplay-policy=no-user-gesture-required",
    "--window-size=1200,900",
]


class CDPError(RuntimeError):
    pass


class Page:
    """One tab, attached in flat mode (commands carry its sessionId)."""

    def __init__(self, browser: "Browser", session: str) -> None:
        self.browser = browser
        self.session = session
        self.console: list[str] = []
        self.errors: list[str] = []

    async def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return await self.browser.send(method, params, session=self.session)

    async def eval(self, expr: str, gesture: bool = False) -> Any:
        """Evaluate ``expr`` (promises awaited) and return its JSON value."""
        r = await self.send("Runtime.evaluate", {"expression": expr, "awaitPromise": True,
                                                 "returnByValue": True, "userGesture": gesture})
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            raise CDPError(f"{expr[:80]!r} threw: {d.get('exception', {}).get('description') or d.get('text')}")
        return r["result"].get("value")

    async def wait_for(self, expr: str, timeout: float, what: str = "") -> Any:
        """Poll ``expr`` until truthy; on timeout fail with the page's state and console."""
        deadline = time.monotonic() + timeout
        while True:
            value = await self.eval(expr)
            if value:
                return value
            if time.monotonic() > deadline:
                state = await self.eval("JSON.stringify(window.realtimeStats)")
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what or expr}\n"
                                     f"realtimeStats={state}\nconsole={self.console[-20:]}\n"
                                     f"errors={self.errors}")
            await asyncio.sleep(0.1)

    async def click(self, selector: str) -> None:
        # userGesture: the click counts as user activation (AudioContext, getUserMedia)
        await self.eval(f"document.querySelector({json.dumps(selector)}).click()", gesture=True)

    async def goto(self, url: str, timeout: float = 20.0) -> None:
        await self.send("Page.navigate", {"url": url})
        await self.wait_for("document.readyState === 'complete' && window.realtimeStats && window.realtimeStats.ready",
                            timeout, "the page to load")

    async def screenshot(self, path: Path) -> None:
        """PNG of the viewport, cut just below the page's content."""
        bottom = await self.eval("Math.ceil(Math.max(...[...document.querySelectorAll('main > section:not([hidden])')]"
                                 ".map(e => e.getBoundingClientRect().bottom), 200))")
        width = await self.eval("document.documentElement.clientWidth")
        clip = {"x": 0, "y": 0, "width": width, "height": min(bottom + 10, 2000), "scale": 1}
        r = await self.send("Page.captureScreenshot", {"format": "png", "clip": clip})
        path.write_bytes(base64.b64decode(r["data"]))

    def on_event(self, msg: dict[str, Any]) -> None:
        method, p = msg["method"], msg.get("params", {})
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
            self.console.append(f"{p.get('type')}: {text}")
        elif method == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            self.errors.append(d.get("exception", {}).get("description") or d.get("text", "?"))
        elif method == "Log.entryAdded":
            e = p.get("entry", {})
            if e.get("level") == "error":
                self.errors.append(f"{e.get('source')}: {e.get('text')} {e.get('url', '')}")


class Browser:
    """Headless Chromium with a fake microphone playing ``fake_audio`` (a 16-bit PCM WAV)."""

    def __init__(self, fake_audio: Path | None = None, loop_audio: bool = False) -> None:
        self.fake_audio = fake_audio
        self.loop_audio = loop_audio
        self.proc: subprocess.Popen[bytes] | None = None
        self.ws: Any = None
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.pages: dict[str, Page] = {}
        self.reader: asyncio.Task[None] | None = None
        self.profile = tempfile.TemporaryDirectory(prefix="rt-chromium-")

    async def __aenter__(self) -> "Browser":
        # No skip without a browser: these tests are the browser client's only check.
        if not Path(CHROMIUM).exists():
            raise RuntimeError(f"{CHROMIUM} not found: apt-get update && apt-get install -y chromium")
        flags = FLAGS + [f"--user-data-dir={self.profile.name}", "--remote-debugging-port=0"]
        if self.fake_audio is not None:
            # Chromium loops the file unless the path ends in %noloop; after the end it captures silence.
            suffix = "" if self.loop_audio else "%noloop"
            flags.append(f"--use-file-for-fake-audio-capture={self.fake_audio}{suffix}")
        self.proc = subprocess.Popen([CHROMIUM, *flags, "about:blank"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        port_file = Path(self.profile.name) / "DevToolsActivePort"
        t0 = time.monotonic()
        while not port_file.is_file() or len(port_file.read_text().splitlines()) < 2:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace")[-2000:] if self.proc.stderr else ""
                raise RuntimeError(f"chromium exited with {self.proc.returncode}: {err}")
            if time.monotonic() - t0 > 30:
                raise RuntimeError("chromium did not open its DevTools port in 30 s")
            await asyncio.sleep(0.05)
        port, path = port_file.read_text().splitlines()[:2]
        self.ws = await websockets.connect(f"ws://127.0.0.1:{port}{path}", max_size=64 << 20)
        self.reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self.ws is not None:
                try:
                    await asyncio.wait_for(self.send("Browser.close"), 5)
                except Exception:
                    pass
                await self.ws.close()
            if self.reader is not None:
                self.reader.cancel()
        finally:
            if self.proc is not None:
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(5)
                if self.proc.stderr:
                    self.proc.stderr.close()
            self.profile.cleanup()

    async def _read(self) -> None:
        async for raw in self.ws:
            msg = json.loads(raw)
            if "id" in msg:
                fut = self.pending.pop(msg["id"], None)
                if fut is not None and not fut.done():
                    if "error" in msg:
                        fut.set_exception(CDPError(f"{msg['error'].get('message')} ({msg['error'].get('data', '')})"))
                    else:
                        fut.set_result(msg.get("result", {}))
            elif "method" in msg:
                page = self.pages.get(msg.get("sessionId", ""))
                if page is not None:
                    page.on_event(msg)

    async def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
                   timeout: float = 60.0) -> dict[str, Any]:
        i = next(self.ids)
        msg: dict[str, Any] = {"id": i, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending[i] = fut
        await self.ws.send(json.dumps(msg))
        return await asyncio.wait_for(fut, timeout)

    async def new_page(self, width: int = 1200, height: int = 900) -> Page:
        target = (await self.send("Target.createTarget", {"url": "about:blank"}))["targetId"]
        session = (await self.send("Target.attachToTarget", {"targetId": target, "flatten": True}))["sessionId"]
        page = Page(self, session)
        self.pages[session] = page
        for domain in ("Page", "Runtime", "Log"):
            await page.send(f"{domain}.enable")
        await page.send("Emulation.setDeviceMetricsOverride",
                        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        return page
