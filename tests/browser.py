"""A real headless Chromium driven from the tests over the Chrome DevTools Protocol (a websocket, spoken with
aiohttp): no browser download, no driver. ``Page`` collects what the console says (console.error, uncaught
exceptions, failed loads) so tests can insist there is nothing.

    async with Chromium.start(tmp_path) as browser:
        page = await browser.new_page(1400, 1000)
        await page.goto(url)
        assert await page.eval("document.title") == "..."
        page.errors  # [] when all went well
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import re
import shutil
from pathlib import Path

import aiohttp

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ("--headless", "--remote-debugging-port=0", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--mute-audio", "--hide-scrollbars")
START_TIMEOUT_S = 30.0
COMMAND_TIMEOUT_S = 30.0


def find_chromium() -> str | None:
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


class CdpError(Exception):
    pass


class Page:
    """One tab: commands go to its target's websocket; events are collected."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws = ws
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future] = {}
        self.errors: list[str] = []  # console errors, uncaught exceptions, failed loads
        self.console: list[str] = []
        self.loaded = asyncio.Event()
        self.credentials: tuple[str, str] | None = None  # answers HTTP Basic prompts (``authenticate``)
        self.tasks: set[asyncio.Task] = set()
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        async for m in self.ws:
            if m.type != aiohttp.WSMsgType.TEXT:
                continue
            msg = json.loads(m.data)
            if "id" in msg:
                fut = self.pending.pop(msg["id"], None)
                if fut is not None and not fut.done():
                    fut.set_exception(CdpError(msg["error"])) if "error" in msg else fut.set_result(msg["result"])
            else:
                self._event(msg["method"], msg.get("params", {}))
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(CdpError("the browser closed the page"))

    def _event(self, method: str, p: dict) -> None:
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
            self.console.append(f"{p['type']}: {text}")
            if p["type"] in ("error", "assert"):
                self.errors.append(f"console.{p['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            self.errors.append(f"exception: {d.get('exception', {}).get('description') or d.get('text')}")
        elif method == "Log.entryAdded" and p["entry"]["level"] == "error":
            self.errors.append(f"log: {p['entry']['text']} {p['entry'].get('url', '')}")
        elif method == "Page.loadEventFired":
            self.loaded.set()
        elif method == "Fetch.requestPaused":
            self._reply("Fetch.continueRequest", requestId=p["requestId"])
        elif method == "Fetch.authRequired":
            user, password = self.credentials or ("", "")
            self._reply("Fetch.continueWithAuth", requestId=p["requestId"], authChallengeResponse={
                "response": "ProvideCredentials" if self.credentials else "CancelAuth", "username": user,
                "password": password})

    def _reply(self, method: str, **params) -> None:
        task = asyncio.get_running_loop().create_task(self.send(method, **params))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def authenticate(self, user: str, password: str) -> None:
        """Answer every HTTP Basic prompt of this page with these credentials (a user typing them once)."""
        self.credentials = (user, password)
        await self.send("Fetch.enable", handleAuthRequests=True, patterns=[{"urlPattern": "*"}])

    async def send(self, method: str, **params) -> dict:
        i = next(self.ids)
        fut = self.pending[i] = asyncio.get_running_loop().create_future()
        await self.ws.send_str(json.dumps({"id": i, "method": method, "params": params}))
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            return await fut

    async def goto(self, url: str) -> None:
        self.loaded.clear()
        await self.send("Page.navigate", url=url)
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            await self.loaded.wait()

    async def eval(self, expression: str):
        """The value of a JavaScript expression (awaited if it is a promise)."""
        r = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise CdpError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float, what: str, poll_s: float = 0.2):
        """Poll ``expression`` until it is truthy -> its value."""
        try:
            async with asyncio.timeout(timeout_s):
                while not (value := await self.eval(expression)):  # noqa: ASYNC110 - polling the page
                    await asyncio.sleep(poll_s)
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what} ({expression})") from None
        return value

    async def screenshot(self) -> bytes:
        """The page as it shows now (PNG)."""
        r = await self.send("Page.captureScreenshot", format="png")
        return base64.b64decode(r["data"])

    async def close(self) -> None:
        await self.ws.close()
        self.reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.reader


class Chromium:
    def __init__(self, port: int, session: aiohttp.ClientSession):
        self.port, self.session = port, session
        self.pages: list[Page] = []

    @classmethod
    @contextlib.asynccontextmanager
    async def start(cls, profile_dir: Path):
        exe = find_chromium()
        assert exe, "no chromium on PATH"
        proc = await asyncio.create_subprocess_exec(
            exe, *FLAGS, f"--user-data-dir={profile_dir}", "about:blank", stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        stderr: list[str] = []
        drain = None
        try:
            port = await cls._port(proc, stderr)
            drain = asyncio.get_running_loop().create_task(cls._drain(proc, stderr))
            async with aiohttp.ClientSession() as session:
                browser = cls(port, session)
                try:
                    yield browser
                finally:
                    for p in browser.pages:
                        await p.close()
        finally:
            if proc.returncode is None:
                proc.terminate()
            try:
                async with asyncio.timeout(10):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
            if drain is not None:
                drain.cancel()

    @staticmethod
    async def _port(proc: asyncio.subprocess.Process, stderr: list[str]) -> int:
        """Chromium prints ``DevTools listening on ws://127.0.0.1:PORT/...`` on stderr once it serves."""
        async with asyncio.timeout(START_TIMEOUT_S):
            while line := (await proc.stderr.readline()).decode(errors="replace"):
                stderr.append(line)
                m = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
                if m:
                    return int(m.group(1))
        raise CdpError(f"chromium exited ({await proc.wait()}): {''.join(stderr)[-2000:]}")

    @staticmethod
    async def _drain(proc: asyncio.subprocess.Process, stderr: list[str]) -> None:
        while line := await proc.stderr.readline():
            stderr.append(line.decode(errors="replace"))

    async def new_page(self, width: int, height: int) -> Page:
        async with self.session.put(f"http://127.0.0.1:{self.port}/json/new?about:blank") as r:
            target = await r.json()
        ws = await self.session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=64 * 2**20)
        page = Page(ws)
        self.pages.append(page)
        for domain in ("Page", "Runtime", "Log"):
            await page.send(f"{domain}.enable")
        await page.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                        mobile=False)
        return page
