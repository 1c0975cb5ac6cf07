"""The API's key and CORS rules: 401 in OpenAI's shape without the key, 200 with it (Bearer, as the openai client
sends it, or a browser's Basic password); /health stays open; routes added later are covered too; the official
client works with the key; a leader refuses to serve the API beyond loopback without one."""

import base64

import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from flowspec_p2p.api.app import create_app
from flowspec_p2p.config import AgentConfig, load
from flowspec_p2p.decoding.loopback import LoopbackRing
from flowspec_p2p.errors import ConfigError

from ..ring_fixtures import F64
from .test_api import CHAT, make_leader, parts  # noqa: F401 - the module fixture

KEY = "sk-test-0123456789"


@pytest.fixture
async def keyed(parts):  # noqa: F811
    leader = make_leader(parts)
    app = create_app(leader, lambda: {"members": []}, run_leader=False, api_key=KEY, cors=("https://app.example",))

    async def later(request):  # a route added after create_app (as the dashboard's and /metrics are)
        return web.json_response({"ok": True})

    app.router.add_get("/metrics", later)
    async with (LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64, capacity=200),
                TestClient(TestServer(app)) as client):
        yield client


async def test_every_route_but_health_answers_401_without_the_key_and_200_with_it(keyed):
    client = keyed
    for method, path, body in [("POST", "/v1/chat/completions", CHAT), ("GET", "/v1/models", None),
                               ("GET", "/cluster", None), ("GET", "/metrics", None)]:
        r = await client.request(method, path, json=body)
        assert r.status == 401, path
        err = (await r.json())["error"]
        assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_api_key")
        r = await client.request(method, path, json=body, headers={"Authorization": "Bearer sk-wrong-key-000"})
        assert r.status == 401, path
        assert "Incorrect API key" in (await r.json())["error"]["message"]
        r = await client.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status == 200, (path, await r.text())
    assert (await client.get("/health")).status == 200
    r = await client.get("/cluster")
    assert r.headers["WWW-Authenticate"].startswith("Basic")  # a browser asks for it
    basic = base64.b64encode(f"me:{KEY}".encode()).decode()
    assert (await client.get("/cluster", headers={"Authorization": f"Basic {basic}"})).status == 200
    assert (await client.post("/v1/chat/completions", json=CHAT)).headers["WWW-Authenticate"] == "Bearer"


async def test_cors_answers_preflights_of_allowed_origins_and_marks_their_answers(keyed):
    client = keyed
    pre = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    r = await client.options("/v1/chat/completions", headers=pre)
    assert r.status == 204
    assert r.headers["Access-Control-Allow-Origin"] == "https://app.example"
    assert "Authorization" in r.headers["Access-Control-Allow-Headers"]
    r = await client.options("/v1/chat/completions", headers={**pre, "Origin": "https://evil.example"})
    assert r.status == 403
    r = await client.get("/v1/models", headers={"Origin": "https://app.example", "Authorization": f"Bearer {KEY}"})
    assert r.headers["Access-Control-Allow-Origin"] == "https://app.example"
    r = await client.get("/v1/models", headers={"Origin": "https://app.example"})  # refusals readable by the page
    assert r.status == 401
    assert r.headers["Access-Control-Allow-Origin"] == "https://app.example"
    r = await client.get("/v1/models", headers={"Origin": "https://evil.example", "Authorization": f"Bearer {KEY}"})
    assert "Access-Control-Allow-Origin" not in r.headers


async def test_the_openai_client_works_with_the_key_and_raises_authentication_error_without(keyed):
    client = keyed
    base = str(client.make_url("/v1"))
    good = openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0)
    reply = await good.chat.completions.create(model="tiny", messages=CHAT["messages"], temperature=0, max_tokens=4)
    assert reply.choices[0].message.content is not None
    bad = openai.AsyncOpenAI(base_url=base, api_key="sk-wrong-key-000", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.models.list()


def test_a_leader_serves_the_api_beyond_loopback_only_with_a_key_or_api_insecure():
    with pytest.raises(ConfigError, match="without a key"):
        load(None, {"leader": True, "api_host": "0.0.0.0"}, env={})
    assert load(None, {"leader": True, "api_host": "0.0.0.0"}, env={"FLOWSPEC_API_KEY": KEY}).api_key_text == KEY
    assert load(None, {"leader": True, "api_host": "0.0.0.0", "api_insecure": True}, env={}).api_insecure
    assert AgentConfig(leader=True, api_host="::1").api_key is None  # loopback needs none
    assert AgentConfig(leader=False, api_host="0.0.0.0").api_key is None  # members serve no API
    with pytest.raises(ValueError, match="at least 8"):
        AgentConfig(api_key="short")
