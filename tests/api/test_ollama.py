"""The Ollama-compatible routes with the official `ollama` client against a leader over a 3-stage in-process ring
on a port-0 server: chat and generate, streamed and not, the same text as greedy decoding; tags, show, ps, version;
``model`` naming a mode; options mapped or refused with a 400 naming them; the API key."""

import json

import httpx
import ollama
import pytest
from aiohttp import web

from flowspec_p2p.api.app import create_app
from flowspec_p2p.api.ollama import DEFAULTS, GenerateRequest, to_body
from flowspec_p2p.decoding.ar import AR
from flowspec_p2p.decoding.chunk import CHUNK
from flowspec_p2p.decoding.leader import Leader
from flowspec_p2p.decoding.loopback import LoopbackRing
from flowspec_p2p.decoding.settings import LeaderSettings
from flowspec_p2p.speculative.drafter import OracleDrafter

from ..ring_fixtures import F64, ByteTokenizer, tiny_parts

TOK = ByteTokenizer()
KEY = "sk-ollama-test-key"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three"}]
GREEDY = {"temperature": 0, "num_predict": 16}


@pytest.fixture(scope="module")
def parts(tiny_llama):
    return tiny_parts(tiny_llama)


async def _serve(parts, **app_kw):
    leader = Leader(parts.head, TOK, drafter=OracleDrafter(parts.whole), modes=[AR, CHUNK], model_id="tiny",
                    settings=LeaderSettings(max_context=200))
    ring = LoopbackRing(parts.stages, leader, hops="ws", wire_dtype=F64, run_leader=False)
    await ring.__aenter__()
    runner = web.AppRunner(create_app(leader, **app_kw))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return ring, runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.fixture
async def server(parts):
    ring, runner, url = await _serve(parts)
    try:
        yield url
    finally:
        await runner.cleanup()
        await ring.__aexit__(None, None, None)


@pytest.fixture
def client(server):
    return ollama.AsyncClient(host=server, timeout=30)


async def raw(server: str, path: str, body: dict) -> dict:
    """A non-streamed reply as JSON, extensions included (the client's models drop the ``stats`` object)."""
    async with httpx.AsyncClient(base_url=server, timeout=30) as http:
        return (await http.post(path, json={**body, "stream": False})).json()


def expected(parts, prompt_ids, n=16):
    ids = parts.reference(prompt_ids, n, stop_ids=TOK.stop_ids)
    return TOK.decode(ids), ids


async def test_chat_gives_greedy_text_with_ollamas_counters(client, parts):
    r = await client.chat(model="tiny", messages=MESSAGES, options=GREEDY, stream=False)
    text, ids = expected(parts, TOK.chat(MESSAGES))
    assert r.message.role == "assistant"
    assert r.message.content == text
    assert r.done
    assert r.done_reason == ("stop" if ids[-1] == 2 else "length")
    assert (r.eval_count, r.prompt_eval_count) == (len(ids), len(TOK.chat(MESSAGES)))
    assert r.total_duration >= r.eval_duration > 0
    assert r.model == "tiny"


async def test_chat_streams_ndjson_parts_to_the_same_text(client, parts):
    stream = await client.chat(model="tiny", messages=MESSAGES, options=GREEDY, stream=True)
    chunks = [c async for c in stream]
    assert all(not c.done for c in chunks[:-1])
    assert chunks[-1].done
    assert "".join(c.message.content for c in chunks) == expected(parts, TOK.chat(MESSAGES))[0]
    assert chunks[-1].eval_count == len(expected(parts, TOK.chat(MESSAGES))[1])


async def test_generate_streamed_and_not_and_its_context_continues_a_conversation(client, server, parts):
    r = await client.generate(model="tiny", prompt="Count to three", system="Be brief.", options=GREEDY)
    prompt = TOK.chat(MESSAGES)
    text, ids = expected(parts, prompt)
    assert r.response == text
    assert list(r.context) == prompt + ids
    streamed = [c async for c in await client.generate(model="tiny", prompt="Count to three", system="Be brief.",
                                                       options=GREEDY, stream=True)]
    assert "".join(c.response for c in streamed) == text
    assert list(streamed[-1].context) == prompt + ids
    follow = await raw(server, "/api/generate", {"model": "tiny", "prompt": "again", "context": r.context,
                                                 "options": GREEDY})
    then = list(r.context) + TOK.chat([{"role": "user", "content": "again"}])
    # prompt_eval_count: the prompt tokens evaluated, those the prompt cache held (the first reply's) not counted
    assert follow["prompt_eval_count"] + follow["stats"].get("cached_tokens", 0) == len(then)
    assert follow["response"] == expected(parts, then)[0]


async def test_raw_generate_continues_the_text_itself(client, parts):
    r = await client.generate(model="tiny", prompt="abc", raw=True, options={"temperature": 0, "num_predict": 5})
    assert r.response == expected(parts, TOK.encode("abc"), 5)[0]


async def test_tags_show_ps_and_version(client, server):
    tags = await client.list()
    assert [m.model for m in tags.models] == ["tiny:latest"]
    assert tags.models[0].details.family == "llama"
    shown = await client.show("tiny")
    assert shown.details.family == "llama"
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == 200
    assert shown.capabilities == ["completion"]
    running = await client.ps()
    assert [m.model for m in running.models] == ["tiny:latest"]
    async with httpx.AsyncClient(base_url=server) as http:
        assert (await http.get("/api/version")).json()["version"]


async def test_a_model_that_names_a_mode_picks_it(server, parts):
    for model, mode in (("chunk", "chunk"), ("ar:latest", "ar"), ("whatever-model:7b", "auto")):
        r = await raw(server, "/api/chat", {"model": model, "messages": MESSAGES, "options": GREEDY})
        assert r["stats"]["mode"] == mode, model
        assert r["message"]["content"] == expected(parts, TOK.chat(MESSAGES))[0]


async def test_what_we_cannot_do_gets_a_400_naming_it(client, server):
    cases = [
        (dict(options={"repeat_penalty": 1.3}), "options.repeat_penalty"),
        (dict(options={"mirostat": 2}), "options.mirostat"),
        (dict(options={"temperature": 5.0}), "options.temperature"),
        (dict(options={"num_predict": 500}), "options.num_predict must be at most 200"),
        (dict(format="json"), "format"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "description": "", "parameters": {}}}]),
         "tools"),
        (dict(think=True), "think"),
    ]
    for kw, named in cases:
        with pytest.raises(ollama.ResponseError) as e:
            await client.chat(model="tiny", messages=MESSAGES, **kw)
        assert e.value.status_code == 400, kw
        assert named in e.value.error, (kw, e.value.error)
    with pytest.raises(ollama.ResponseError, match="images") as e:
        await client.chat(model="tiny", messages=[{"role": "user", "content": "x", "images": ["aGk="]}])
    with pytest.raises(ollama.ResponseError, match="not supported by flowspec_p2p"):
        await client.pull("tiny")
    with pytest.raises(ollama.ResponseError, match="context"):
        await client.generate(model="tiny", prompt="x" * 400)
    r = await raw(server, "/api/chat", {"model": "tiny", "messages": MESSAGES, "decoding": "warp"})
    assert "unknown decoding mode" in r["error"]


async def test_runtime_options_are_accepted_and_an_empty_request_loads(client, parts):
    r = await client.chat(model="tiny", messages=MESSAGES, keep_alive="5m",
                          options={**GREEDY, "num_ctx": 8192, "num_thread": 4, "repeat_penalty": 1.0})
    assert r.message.content == expected(parts, TOK.chat(MESSAGES))[0]
    loaded = await client.generate(model="tiny")
    assert (loaded.done, loaded.done_reason, loaded.response) == (True, "load", "")


async def test_logprobs_come_per_part(server, parts):
    body = {"model": "tiny", "prompt": "abc", "raw": True, "options": {"temperature": 0, "num_predict": 4},
            "logprobs": True, "top_logprobs": 2}
    async with httpx.AsyncClient(base_url=server) as http:
        lines = [json.loads(x) for x in (await http.post("/api/generate", json=body)).text.splitlines()]
    entries = [e for part in lines for e in part.get("logprobs", [])]
    assert [e["token"] for e in entries] == [TOK.decode([t]) for t in expected(parts, TOK.encode("abc"), 4)[1]]
    assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in entries)


def test_options_map_onto_the_openai_sampling_with_ollamas_defaults(parts):
    leader = Leader(parts.head, TOK, modes=[AR], model_id="tiny", settings=LeaderSettings(max_context=200))
    b = to_body(GenerateRequest(prompt="x"), leader)
    assert (b.temperature, b.top_k, b.top_p) == (DEFAULTS["temperature"], DEFAULTS["top_k"], DEFAULTS["top_p"])
    assert (b.max_tokens, b.seed) == (200, None)  # until a stop or the context limit; a random seed
    b = to_body(GenerateRequest(prompt="x", options={"temperature": 0, "seed": -1, "num_predict": 7, "top_k": 0,
                                                     "stop": ["\n"]}), leader)
    assert (b.temperature, b.seed, b.max_tokens, b.top_k, b.stop_strings()) == (0.0, None, 7, 0, ["\n"])
    assert to_body(GenerateRequest(prompt="x", options={"seed": 42}), leader).seed == 42


async def test_the_api_key_covers_the_ollama_routes(parts):
    ring, runner, url = await _serve(parts, api_key=KEY)
    try:
        with pytest.raises(ollama.ResponseError) as e:
            await ollama.AsyncClient(host=url).list()
        assert e.value.status_code == 401
        keyed = ollama.AsyncClient(host=url, headers={"Authorization": f"Bearer {KEY}"})
        r = await keyed.chat(model="tiny", messages=MESSAGES, options=GREEDY)
        assert r.message.content == expected(parts, TOK.chat(MESSAGES))[0]
    finally:
        await runner.cleanup()
        await ring.__aexit__(None, None, None)
