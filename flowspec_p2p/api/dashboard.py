"""The dashboard at ``/`` of the leader's API: a static page shipped in the package (static/: HTML, JS, CSS; no
build step, nothing fetched from the internet) that the server keeps up to date by push.

    GET /                        static/index.html
    GET /dashboard/assets/...    its script and style sheet
    GET /dashboard/state         the dashboard's state once (JSON)
    GET /dashboard/events        the state, pushed: a server-sent ``state`` event every PUSH_INTERVAL_S

The state: the cluster as the control plane knows it (members, the plan, the stages with their counters, a
transition in progress, the plan history with each re-plan's trigger), the leader (pipeline, queue, counters), the
request in flight or else the last one (its ledger's summary, ledger.request_summary: tokens/s, tau, acceptance by
depth, each stage's busy time and bubbles, resumes), the requests before it, and every stage's busy intervals over the
last TIMELINE_WINDOW_S (``timelines``: cluster/telemetry.py) beside the leader's own compute.

The chat box on the page posts to /v1/chat/completions (streamed) like any client. Everything here is a route of the
API app, so a middleware of the app (an API key) covers the page, its assets and its event stream alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from ..decoding.leader import Leader
from ..ledger import Ledger, request_summary
from .metrics import View, cluster_state

STATIC_DIR = Path(__file__).with_name("static")
PUSH_INTERVAL_S = 0.5
TIMELINE_WINDOW_S = 20.0
RECENT_REQUESTS = 8
# the page loads nothing from elsewhere: no CDN, works on a LAN without internet
CONTENT_SECURITY_POLICY = ("default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                           "connect-src 'self'")

Timelines = Callable[[float], Awaitable[list[dict]]]  # since (time.time()) -> per stage: {stage, agent_id, intervals}


def _brief(led: Ledger, now: float) -> dict:
    s = request_summary(led, now)
    return {k: s[k] for k in ("id", "mode", "outcome", "tokens", "tokens_per_s", "tau", "elapsed_s", "started")}


def _live(led: Ledger, now: float) -> dict:
    s = request_summary(led, now)
    return {k: s[k] for k in ("id", "mode", "tokens", "tokens_per_s", "tau", "ttft_s", "elapsed_s")} | {
        "queued_s": round(led.queued_s, 3), "cached_tokens": led.cached_tokens}


def _stage_rows(known: dict) -> list[dict]:
    """Per stage of the plan: rows per engine call (requests batched and tree nodes) and forwards batched."""
    out = []
    for s in known.get("stages") or ():
        c = s.get("counters") or {}
        calls = c.get("engine_calls") or 0
        out.append({"stage": s["stage"], "rows_per_forward": round(c.get("engine_rows", 0) / calls, 2) if calls
                    else None, "batched_forwards": c.get("batched_forwards", 0)})
    return out


def _recent_busy(ledgers: list[Ledger], since: float, now: float) -> list[list[float]]:
    return [[round(a, 4), round(b, 4)] for led in ledgers if (led.finished or now) > since
            for a, b in led.leader_busy if b > since]


async def dashboard_state(leader: Leader, view: View | None, timelines: Timelines | None) -> dict:
    now = time.time()
    since = now - TIMELINE_WINDOW_S
    known = await cluster_state(view)
    ledgers = list(leader.ledgers)
    stages = await timelines(since) if timelines is not None else []
    return {
        "now": now,
        "window_s": TIMELINE_WINDOW_S,
        "cluster": known,
        "leader": leader.snapshot(),
        "request": request_summary(ledgers[-1], now) if ledgers else None,
        # every request decoding now (several share the pipeline), with what its user feels
        "in_flight": [_live(led, now) for led in ledgers if led.running],
        "stage_rows": _stage_rows(known),
        "recent": [_brief(led, now) for led in reversed(ledgers[:-1])][:RECENT_REQUESTS],
        "timeline": {"stages": stages, "leader": _recent_busy(ledgers, since, now)},
    }


class Dashboard:
    def __init__(self, leader: Leader, view: View | None, timelines: Timelines | None):
        self.leader, self.view, self.timelines = leader, view, timelines
        self.closing = asyncio.Event()  # the server is shutting down: end the event streams now

    async def close(self, app: web.Application) -> None:
        self.closing.set()

    async def state(self) -> dict:
        return await dashboard_state(self.leader, self.view, self.timelines)

    async def page(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "index.html", headers={
            "Content-Security-Policy": CONTENT_SECURITY_POLICY, "Cache-Control": "no-cache"})

    async def state_once(self, request: web.Request) -> web.Response:
        return web.json_response(await self.state())

    async def events(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            while not self.closing.is_set():
                data = json.dumps(await self.state(), separators=(",", ":"))
                await resp.write(f"event: state\ndata: {data}\n\n".encode())
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(PUSH_INTERVAL_S):
                        await self.closing.wait()
        except ConnectionResetError:  # the page closed
            pass
        return resp


def install_dashboard(app: web.Application, leader: Leader, view: View | None, timelines: Timelines | None) -> None:
    d = Dashboard(leader, view, timelines)
    app.router.add_get("/", d.page)
    app.router.add_get("/dashboard/state", d.state_once)
    app.router.add_get("/dashboard/events", d.events)
    app.router.add_static("/dashboard/assets", STATIC_DIR)
    app.on_shutdown.append(d.close)
