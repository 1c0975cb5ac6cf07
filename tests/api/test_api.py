"""The HTTP API over a 3-stage in-process ring: OpenAI shapes, SSE streaming, validation, 503s."""

import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from flowspec_p2p.api.app import create_app
from flowspec_p2p.decoding.ar import AR
from flowspec_p2p.decoding.chunk import CHUNK
from flowspec_p2p.decoding.leader import Leader
from flowspec_p2p.decoding.loopback import LoopbackRing
from flowspec_p2p.decoding.settings import LeaderSettings
from flowspec_p2p.speculative.drafter import OracleDrafter

from ..ring_fixtures import F64, ByteTokenizer, tiny_parts

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def parts(tiny_llama):
    return tiny_parts(tiny_llama)


def make_leader(parts, **settings):
    return Leader(parts.head, TOK, drafter=OracleDrafter(parts.whole), modes=[AR, CHUNK], model_id="tiny",
                  settings=LeaderSettings(**{"max_context": 200, "ready_timeout_s": 0.05, **settings}))


@pytest.fixture
async def served(parts):
    """(client, leader, ring): the API of a leader with a 3-stage in-memory ring."""
    leader = make_leader(parts)
    view = {"members": [{"id": "a1", "role": "leader"}], "plan": {"epoch": 0}}
    app = create_app(leader, lambda: view, run_leader=False)
    async with (LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64, capacity=200) as ring,
                TestClient(TestServer(app)) as client):
        yield client, leader, ring


def expected_text(parts, prompt_ids, n):
    ids = parts.reference(prompt_ids, n, stop_ids=TOK.stop_ids)
    return TOK.decode(ids), ids


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "temperature": 0, "max_tokens": 12}


async def test_chat_completion_returns_openai_shape_with_stats(served, parts):
    client, _, _ = served
    r = await client.post("/v1/chat/completions", json={**CHAT, "decoding": "ar"})
    assert r.status == 200, await r.text()
    body = await r.json()
    text, ids = expected_text(parts, TOK.chat(CHAT["messages"]), 12)
    assert body["object"] == "chat.completion"
    assert body["model"] == "tiny"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert body["choices"][0]["finish_reason"] == ("stop" if ids[-1] == 2 else "length")
    assert body["usage"]["completion_tokens"] == len(ids)
    stats = body["stats"]
    assert stats["mode"] == "ar"
    assert stats["new_tokens"] == len(ids)
    assert {"steps", "tau", "prefill_s", "decode_s"} <= set(stats)


async def test_the_default_mode_is_auto_and_every_mode_gives_the_same_text(served):
    client, _, _ = served
    a = await (await client.post("/v1/chat/completions", json={**CHAT, "decoding": "ar"})).json()
    c = await (await client.post("/v1/chat/completions", json={**CHAT, "decoding": "chunk"})).json()
    d = await (await client.post("/v1/chat/completions", json=CHAT)).json()
    assert c["stats"]["mode"] == "chunk"
    assert d["stats"]["mode"] == "auto"
    assert d["stats"]["auto"]["chose"] in ("ar", "flowspec")  # what ran, and why
    assert d["stats"]["auto"]["reason"]
    texts = {x["choices"][0]["message"]["content"] for x in (a, c, d)}
    assert len(texts) == 1


async def test_a_model_that_names_a_mode_picks_it_unless_decoding_does(served):
    client, _, _ = served
    modes = []
    for extra in ({"model": "ar"}, {"model": "ar", "decoding": "chunk"}, {"model": "tiny"}):
        body = await (await client.post("/v1/chat/completions", json={**CHAT, **extra})).json()
        modes.append(body["stats"]["mode"])
    assert modes == ["ar", "chunk", "auto"]


async def test_completions_accept_text_and_token_ids(served, parts):
    client, _, _ = served
    ids = [5, 17, 33, 8, 61]
    r = await client.post("/v1/completions", json={"prompt": ids, "max_tokens": 6, "temperature": 0})
    body = await r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == expected_text(parts, ids, 6)[0]
    r = await client.post("/v1/completions", json={"prompt": ["abc"], "max_tokens": 6, "temperature": 0.0})
    assert (await r.json())["choices"][0]["text"] == expected_text(parts, TOK.encode("abc"), 6)[0]


async def read_sse(resp) -> list:
    events = []
    async for line in resp.content:
        line = line.decode().strip()
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def test_streaming_sends_sse_chunks_then_done(served, parts):
    client, _, _ = served
    r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 20, "stream": True,
                                                        "stream_options": {"include_usage": True}})
    assert r.status == 200
    assert r.headers["Content-Type"].startswith("text/event-stream")
    events = await read_sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == expected_text(parts, TOK.chat(CHAT["messages"]), 20)[0]
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1
    assert finals[0]["stats"]["new_tokens"] > 0
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] > 0


async def test_stop_strings_cut_the_text(served, parts):
    client, _, _ = served
    text, _ = expected_text(parts, TOK.chat(CHAT["messages"]), 12)
    stop = text[3:5]
    assert stop
    assert text.find(stop) == 3
    body = await (await client.post("/v1/chat/completions", json={**CHAT, "stop": stop})).json()
    assert body["choices"][0]["message"]["content"] == text[:3]
    assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(("body", "status", "needle"), [
    (b"{not json", 400, "malformed JSON"),
    ({**CHAT, "temperature": "hot"}, 400, "temperature"),
    ({**CHAT, "max_tokens": "5"}, 400, "max_tokens"),
    ({**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ({**CHAT, "max_tokens": 10_000}, 400, "at most 200"),
    ({**CHAT, "messages": "hi"}, 400, "messages"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ({"model": "tiny"}, 400, "messages"),
    ({**CHAT, "n": 2}, 400, "n"),
    ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({**CHAT, "top_p": 0}, 400, "top_p"),
    ({**CHAT, "decoding": "warp"}, 400, "unknown decoding mode"),
    ({**CHAT, "messages": [{"role": "user", "content": "x" * 300}]}, 400, "context limit"),
])
async def test_bad_requests_get_4xx_with_a_reason(served, body, status, needle):
    client, _, _ = served
    kw = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = await client.post("/v1/chat/completions", **kw)
    assert r.status == status
    err = (await r.json())["error"]
    assert needle in err["message"] or needle == err["param"], err


async def test_completion_token_ids_out_of_vocabulary_are_rejected(served):
    client, _, _ = served
    r = await client.post("/v1/completions", json={"prompt": [5, 96], "max_tokens": 2})
    assert r.status == 400
    assert "[0, 96)" in (await r.json())["error"]["message"]


@pytest.mark.parametrize(("prompt", "needle", "code"), [
    ("", "empty", None),
    ([], "empty", None),
    ([5] * 300, "context limit", "context_length_exceeded"),
])
async def test_completion_prompt_errors_name_the_prompt_field(served, prompt, needle, code):
    client, _, _ = served
    r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.status == 400
    err = (await r.json())["error"]
    assert needle in err["message"], err
    assert (err["param"], err["code"]) == ("prompt", code)


async def test_models_health_and_cluster(served):
    client, leader, _ = served
    assert (await (await client.get("/v1/models")).json())["data"][0]["id"] == "tiny"
    r = await client.get("/health")
    assert r.status == 200
    assert (await r.json())["default_mode"] == "auto"
    cluster = await (await client.get("/cluster")).json()
    assert cluster["members"][0]["id"] == "a1"
    assert cluster["plan"] == {"epoch": 0}
    assert cluster["leader"]["ready"]
    assert cluster["leader"]["pipeline"]["stages"] == 3
    await leader.set_pipeline(None)
    r = await client.get("/health")
    assert r.status == 503
    assert (await r.json())["status"] == "not_ready"
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status == 503
    assert r.headers["Retry-After"] == "2"
    assert (await r.json())["error"]["code"] == "not_ready"


async def test_a_stage_failing_mid_stream_ends_the_stream_with_an_error_event(parts):
    leader = make_leader(parts)
    prompt = TOK.chat(CHAT["messages"])
    app = create_app(leader, run_leader=False)
    async with (LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64, capacity=len(prompt) + 4),
                TestClient(TestServer(app)) as client):
        r = await client.post("/v1/chat/completions", json={**CHAT, "decoding": "ar", "stream": True})
        assert r.status == 200
        events = await read_sse(r)
        assert events[-1] == "[DONE]"
        assert "KV capacity" in events[-2]["error"]["message"]
        r = await client.post("/v1/chat/completions", json={**CHAT, "decoding": "ar"})
        assert r.status == 500
        assert (await r.json())["error"]["type"] == "stage_failed"


async def test_a_client_leaving_mid_stream_frees_the_pipeline_for_the_next_request(served):
    client, leader, _ = served
    r = await client.post("/v1/chat/completions", json={**CHAT, "decoding": "ar", "max_tokens": 150, "stream": True})
    assert r.status == 200
    await r.content.readline()
    r.close()  # the client goes away after the first event
    body = await (await client.post("/v1/chat/completions", json={**CHAT, "decoding": "ar"})).json()
    assert body["stats"]["new_tokens"] > 0
    assert leader.counters["requests"] == 2
    assert leader.counters["cancelled"] == 1
    assert leader.counters["completed"] == 1


async def test_a_chats_second_turn_starts_from_the_first_turns_kv(served, parts):
    """A multi-turn chat: turn 2 reports the prompt tokens it took from the prompt cache and says what a cold
    prefill says; ``cache_prompt: false`` prefills cold and leaves nothing behind."""
    client, _, ring = served
    first = [{"role": "user", "content": "Tell me about the sea and the rivers that run into it."}]
    r = await client.post("/v1/chat/completions", json={**CHAT, "messages": first, "decoding": "ar"})
    turn1 = await r.json()
    assert turn1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second = [*first, turn1["choices"][0]["message"], {"role": "user", "content": "And the lakes?"}]
    cold = await (await client.post("/v1/chat/completions", json={**CHAT, "messages": second, "decoding": "ar",
                                                                  "cache_prompt": False})).json()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    warm = await (await client.post("/v1/chat/completions", json={**CHAT, "messages": second,
                                                                  "decoding": "chunk"})).json()
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= len(TOK.chat(first))  # at least the first turn's prompt
    assert warm["stats"]["cached_tokens"] == cached
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    assert warm["choices"][0]["message"]["content"] == expected_text(parts, TOK.chat(second), 12)[0]
    assert sum(w.core.counters["reused"] for w in ring.workers) == 3
