"""The dashboard's server side: the page and its assets come from the package (nothing from elsewhere), the state
carries the request just served, the event stream pushes it, and a middleware of the API app covers every dashboard
route and /metrics (an API key will), /health aside. The page itself is tested in a browser
(tests/cluster/test_dashboard_browser.py)."""

import re
from importlib import resources

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from flowspec_p2p.api import dashboard
from flowspec_p2p.api.app import create_app
from flowspec_p2p.decoding.leader import Leader
from flowspec_p2p.decoding.loopback import LoopbackRing
from flowspec_p2p.decoding.registry import builtin_modes
from flowspec_p2p.decoding.settings import LeaderSettings

from ..browser import Chromium, find_chromium
from ..ring_fixtures import F64, ByteTokenizer, tiny_parts
from .test_api_fields import drafter

TOK = ByteTokenizer()
STATIC = ("index.html", "dashboard.js", "dashboard.css")


@pytest.fixture(scope="module")
def parts(tiny_llama):
    return tiny_parts(tiny_llama)


def leader_for(parts) -> Leader:
    return Leader(parts.head, TOK, drafter=drafter(parts, "oracle"), modes=builtin_modes(), model_id="tiny",
                  settings=LeaderSettings(max_context=200, ready_timeout_s=0.05))


async def test_the_page_and_its_assets_ship_in_the_package_and_load_nothing_from_elsewhere(parts):
    files = resources.files("flowspec_p2p.api") / "static"
    for name in STATIC:
        text = (files / name).read_text()
        assert not re.search(r"""(src|href)=["']?(https?:)?//""", text), name
        assert "cdn" not in text.lower(), name
    async with TestClient(TestServer(create_app(leader_for(parts), run_leader=False))) as client:
        page = await client.get("/")
        assert page.status == 200
        assert "default-src 'self'" in page.headers["Content-Security-Policy"]
        html = await page.text()
        assert "/dashboard/assets/dashboard.js" in html
        for name, kind in (("dashboard.js", "javascript"), ("dashboard.css", "css")):
            r = await client.get(f"/dashboard/assets/{name}")
            assert r.status == 200
            assert kind in r.headers["Content-Type"]


async def test_the_state_carries_the_last_request_and_the_event_stream_pushes_it(parts, monkeypatch):
    monkeypatch.setattr(dashboard, "PUSH_INTERVAL_S", 0.05)
    leader = leader_for(parts)
    view = {"cluster": "home", "epoch": 1, "members": [{"id": "a", "role": "leader"}], "plan": None}
    app = create_app(leader, lambda: view, run_leader=False)
    async with (LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64, capacity=456),
                TestClient(TestServer(app)) as client):
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 9, "temperature": 0,
                "decoding": "chunk"}
        reply = await (await client.post("/v1/chat/completions", json=body)).json()
        state = await (await client.get("/dashboard/state")).json()
        assert state["cluster"] == view
        assert state["leader"]["ready"]
        r = state["request"]
        assert (r["mode"], r["tokens"], r["running"], r["outcome"]) == ("chunk", 9, False, "completed")
        assert r["walks"] == reply["stats"]["steps"] - 1
        assert [s["stage"] for s in r["stages"]] == [1, 2, 3]
        assert state["timeline"]["leader"]  # the leader's compute in the window
        resp = await client.get("/dashboard/events")
        assert resp.headers["Content-Type"] == "text/event-stream"
        events = []
        async for line in resp.content:
            if line.startswith(b"event: "):
                events.append(line.strip())
            if len(events) == 3:
                break
        assert events == [b"event: state"] * 3
        resp.close()


async def test_a_middleware_of_the_app_covers_the_dashboard_and_metrics_but_health_can_stay_open(parts):
    @web.middleware
    async def key_required(request, handler):
        if request.path != "/health" and request.headers.get("Authorization") != "Bearer k":
            raise web.HTTPUnauthorized()
        return await handler(request)

    app = create_app(leader_for(parts), run_leader=False)
    app.middlewares.append(key_required)
    async with TestClient(TestServer(app)) as client:
        for path in ("/", "/dashboard/assets/dashboard.js", "/dashboard/state", "/dashboard/events", "/metrics"):
            assert (await client.get(path)).status == 401, path
            assert (await client.get(path, headers={"Authorization": "Bearer k"})).status == 200, path
        assert (await client.get("/health")).status == 503  # open (and not ready: no pipeline)


async def test_a_server_shutting_down_ends_the_open_event_streams_at_once(parts):
    import asyncio
    import time

    import aiohttp

    runner = web.AppRunner(create_app(leader_for(parts), run_leader=False), shutdown_timeout=20)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/dashboard/events"
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert (await r.content.readline()).startswith(b"event: state")
        t0 = time.monotonic()
        await asyncio.wait_for(runner.cleanup(), 10)
        assert time.monotonic() - t0 < 3  # not the 20 s an open handler would be given


@pytest.mark.skipif(find_chromium() is None, reason="no chromium on PATH: `apt-get install -y chromium`")
async def test_behind_an_api_key_the_page_asks_once_and_then_follows_and_chats_in_a_real_browser(parts, tmp_path):
    leader = leader_for(parts)
    runner = web.AppRunner(create_app(leader, run_leader=False, api_key="sesame"))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/"
    try:
        async with (LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64, capacity=456),
                    Chromium.start(tmp_path / "chromium") as browser):
            page = await browser.new_page(1200, 800)
            await page.authenticate("", "sesame")  # the password of the Basic prompt is the key
            await page.goto(url)
            await page.wait_for("Number(document.body.dataset.updates || 0) >= 2", 20, "pushed state")
            await page.eval("document.querySelector('#chat-max').value = '6'; "
                            "document.querySelector('#chat-input').value = 'Hi'; "
                            "document.querySelector('#chat-form').requestSubmit(); true")
            await page.wait_for("!!document.querySelector('.msg.assistant.done')", 20, "the reply")
            assert not await page.eval("document.querySelector('.msg.assistant').classList.contains('error')")
            assert page.errors == []
    finally:
        await runner.cleanup()
