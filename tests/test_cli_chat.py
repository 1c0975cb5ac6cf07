"""``flowspec chat`` against a live API (the tiny model's in-process ring on a port-0 server): replies stream,
every turn carries the conversation so far, --decoding and the API key reach the server, errors are reported and the
conversation goes on."""

import asyncio
import io
import json

import pytest
from aiohttp import web

from flowspec_p2p.api.app import create_app
from flowspec_p2p.cli import main
from flowspec_p2p.commands.chat import ChatClient, converse
from flowspec_p2p.decoding.leader import Leader
from flowspec_p2p.decoding.loopback import LoopbackRing
from flowspec_p2p.decoding.registry import builtin_modes
from flowspec_p2p.decoding.settings import LeaderSettings

from .api.test_api_fields import drafter
from .ring_fixtures import F64, ByteTokenizer, tiny_parts

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def parts(tiny_llama):
    return tiny_parts(tiny_llama)


@pytest.fixture
async def api(parts):
    """(URL, the request bodies and Authorization headers the server got)"""
    leader = Leader(parts.head, TOK, drafter=drafter(parts, "oracle"), modes=builtin_modes(), model_id="tiny",
                    settings=LeaderSettings(max_context=200))
    seen: list[tuple[dict, str | None]] = []

    @web.middleware
    async def record(request, handler):
        if request.method == "POST":
            seen.append((json.loads(await request.read()), request.headers.get("Authorization")))
        return await handler(request)

    app = create_app(leader, run_leader=False)
    app.middlewares.append(record)
    async with LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64, capacity=456):
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen
        finally:
            await runner.cleanup()


async def test_a_conversation_streams_each_reply_and_sends_the_history_with_every_turn(api):
    url, seen = api
    client = ChatClient(url, decoding="chunk", max_tokens=8, api_key="k")
    out, err = io.StringIO(), io.StringIO()
    stdin = io.StringIO("Hello\n\nAgain\n/reset\nThird\n")
    replies = await asyncio.to_thread(converse, client, stdin, out, err, system="Be brief.", stats=True)
    assert replies == 3
    bodies = [b for b, _ in seen]
    assert [len(b["messages"]) for b in bodies] == [2, 4, 2]  # system + user; + reply + user; reset
    assert bodies[1]["messages"][2]["role"] == "assistant"
    assert bodies[1]["messages"][2]["content"] == out.getvalue().splitlines()[0]
    assert all(b["stream"] and b["decoding"] == "chunk" and b["max_tokens"] == 8 for b in bodies)
    assert {auth for _, auth in seen} == {"Bearer k"}
    assert err.getvalue().count("[chunk: 8 tokens, tau") == 3
    assert "(a new conversation)" in err.getvalue()


async def test_an_error_is_reported_and_the_conversation_goes_on(api, caplog):
    url, seen = api
    client = ChatClient(url, max_tokens=10_000)
    out = io.StringIO()
    replies = await asyncio.to_thread(converse, client, io.StringIO("Hi\n"), out, io.StringIO())
    assert replies == 0
    assert "answered 400: max_tokens must be at most 200" in caplog.text
    client.max_tokens = 4
    assert await asyncio.to_thread(converse, client, io.StringIO("Hi\n/exit\nnever sent\n"), out, io.StringIO()) == 1
    assert [len(b["messages"]) for b, _ in seen] == [1, 1]  # the refused message was not kept
    unreachable = ChatClient("http://127.0.0.1:9", max_tokens=4)
    assert await asyncio.to_thread(converse, unreachable, io.StringIO("Hi\n"), out, io.StringIO()) == 0
    assert "cannot reach the API at http://127.0.0.1:9" in caplog.text


async def test_the_command_sends_one_message_with_the_key_from_the_environment(api, capsys, monkeypatch):
    url, seen = api
    monkeypatch.setenv("FLOWSPEC_API_KEY", "from-env")
    rc = await asyncio.to_thread(main, ["chat", "--url", url, "--decoding", "flowspec", "--max-tokens", "5",
                                        "--stats", "Hello", "there"])
    assert rc == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "[flowspec: 5 tokens" in captured.err
    body, auth = seen[-1]
    assert body["messages"] == [{"role": "user", "content": "Hello there"}]
    assert auth == "Bearer from-env"
