"""The official `openai` client against the API on a port-0 server, streaming and not."""

import openai
import pytest
from aiohttp import web

from flowspec_p2p.api.app import create_app
from flowspec_p2p.decoding.ar import AR
from flowspec_p2p.decoding.chunk import CHUNK
from flowspec_p2p.decoding.leader import Leader
from flowspec_p2p.decoding.loopback import LoopbackRing
from flowspec_p2p.decoding.settings import LeaderSettings
from flowspec_p2p.speculative.drafter import OracleDrafter

from ..ring_fixtures import F64, ByteTokenizer, tiny_parts

TOK = ByteTokenizer()
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three"}]


@pytest.fixture(scope="module")
def parts(tiny_llama):
    return tiny_parts(tiny_llama)


@pytest.fixture
async def client(parts):
    leader = Leader(parts.head, TOK, drafter=OracleDrafter(parts.whole), modes=[AR, CHUNK], model_id="tiny",
                    settings=LeaderSettings(max_context=200))
    async with LoopbackRing(parts.stages, leader, hops="ws", wire_dtype=F64, run_leader=False):
        runner = web.AppRunner(create_app(leader))  # the app runs the leader's demultiplexer (cleanup_ctx)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                          max_retries=0, timeout=30) as c:
                yield c
        finally:
            await runner.cleanup()


def expected(parts, n):
    return TOK.decode(parts.reference(TOK.chat(MESSAGES), n, stop_ids=TOK.stop_ids))


async def test_chat_completion(client, parts):
    r = await client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=16,
                                             extra_body={"decoding": "ar"})
    assert r.choices[0].message.content == expected(parts, 16)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(TOK.chat(MESSAGES))
    assert r.model_extra["stats"]["mode"] == "ar"


async def test_chat_completion_streamed_with_chunk_pp(client, parts):
    stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=16,
                                                  stream=True, extra_body={"decoding": "chunk"})
    text, finish = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert text == expected(parts, 16)
    assert finish in ("stop", "length")


async def test_completion_and_models(client, parts):
    r = await client.completions.create(model="tiny", prompt="abc", max_tokens=5, temperature=0)
    assert r.choices[0].text == TOK.decode(parts.reference(TOK.encode("abc"), 5, stop_ids=TOK.stop_ids))
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


async def test_errors_surface_as_openai_exceptions(client):
    with pytest.raises(openai.BadRequestError, match="unknown decoding mode"):
        await client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body={"decoding": "warp"})
    with pytest.raises(openai.BadRequestError, match="context"):
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 400}])
