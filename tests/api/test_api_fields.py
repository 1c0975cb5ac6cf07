"""The API does what it accepts: logprobs in every decoding mode, streamed and not, equal to the target's own and
leaving the tokens unchanged; fields it cannot honour refused with a 400 naming them; every number range-checked."""

import json

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from flowspec_p2p.api.app import create_app
from flowspec_p2p.decoding.leader import Leader
from flowspec_p2p.decoding.loopback import LoopbackRing
from flowspec_p2p.decoding.registry import builtin_modes
from flowspec_p2p.decoding.settings import LeaderSettings
from flowspec_p2p.speculative.drafter import HeadDrafter, OracleDrafter
from flowspec_p2p.speculative.head import DraftHead

from ..ring_fixtures import F64, ByteTokenizer, tiny_parts
from .test_api import read_sse

TOK = ByteTokenizer()
MODES = ("ar", "chunk", "pipedec", "flowspec")
CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "temperature": 0, "max_tokens": 14}


@pytest.fixture(scope="module")
def parts(tiny_llama):
    return tiny_parts(tiny_llama)


def drafter(parts, kind):
    if kind == "oracle":
        return OracleDrafter(parts.whole)  # every draft accepted
    torch.manual_seed(0)
    head = DraftHead(parts.whole.cfg).to(F64)
    head.block.reset_parameters(0.1)  # a random draft head: most drafts rejected
    return HeadDrafter(head, parts.head)


@pytest.fixture(params=["oracle", "random"])
async def served(request, parts):
    leader = Leader(parts.head, TOK, drafter=drafter(parts, request.param), modes=builtin_modes(), model_id="tiny",
                    settings=LeaderSettings(max_context=200, ready_timeout_s=0.05))
    app = create_app(leader, run_leader=False)
    async with (LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64, capacity=200 + 256),
                TestClient(TestServer(app)) as client):
        yield client


def target_logprobs(parts, prompt: list[int], reply: list[int]) -> torch.Tensor:
    """log_softmax of the whole model's logits at the position before each reply token. -> [len(reply), vocab]"""
    ids = torch.tensor([prompt + reply])  # [1, n]
    cache = parts.whole.new_cache(ids.shape[1])
    with torch.inference_mode():
        feats = parts.whole(ids, cache)[0]  # [n, hidden]
        logits = parts.whole.logits(feats[len(prompt) - 1 : -1])  # [len(reply), vocab]
    return torch.log_softmax(logits.double(), -1)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", MODES)
async def test_chat_logprobs_are_the_targets_in_every_mode_and_leave_the_tokens_unchanged(served, parts, mode,
                                                                                         stream):
    client = served
    plain = await (await client.post("/v1/chat/completions", json={**CHAT, "decoding": "ar",
                                                                    "return_token_ids": True})).json()
    body = {**CHAT, "decoding": mode, "logprobs": True, "top_logprobs": 3, "return_token_ids": True, "stream": stream}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status == 200, await r.text()
    if stream:
        events = [e for e in await read_sse(r) if e != "[DONE]"]
        content = [lp for e in events for c in e["choices"] if c["logprobs"] for lp in c["logprobs"]["content"]]
        text = "".join(c["delta"].get("content", "") for e in events for c in e["choices"])
        stats = next(e["stats"] for e in events if "stats" in e)
    else:
        reply = await r.json()
        content = reply["choices"][0]["logprobs"]["content"]
        text, stats = reply["choices"][0]["message"]["content"], reply["stats"]
    ids = stats["token_ids"]
    assert ids == plain["stats"]["token_ids"]  # asking for logprobs changes no token
    assert text == plain["choices"][0]["message"]["content"]
    assert len(content) == len(ids) == stats["new_tokens"]
    ref = target_logprobs(parts, TOK.chat(CHAT["messages"]), ids)
    for i, (entry, token) in enumerate(zip(content, ids, strict=True)):
        assert entry["token"] == TOK.decode([token])
        assert entry["bytes"] == list(entry["token"].encode())
        assert entry["logprob"] == pytest.approx(float(ref[i, token]), abs=1e-9)
        best = torch.topk(ref[i], 3)
        assert [e["logprob"] for e in entry["top_logprobs"]] == pytest.approx(best.values.tolist(), abs=1e-9)
        assert entry["top_logprobs"][0]["token"] == TOK.decode([int(best.indices[0])])


async def test_completion_logprobs_take_the_legacy_shape_and_seeded_sampling_keeps_its_tokens(served, parts):
    client = served
    body = {"prompt": "abc hello", "max_tokens": 10, "temperature": 0.8, "seed": 7, "decoding": "chunk",
            "return_token_ids": True}
    plain = await (await client.post("/v1/completions", json=body)).json()
    reply = await (await client.post("/v1/completions", json={**body, "logprobs": 2})).json()
    ids = reply["stats"]["token_ids"]
    assert ids == plain["stats"]["token_ids"]
    lp = reply["choices"][0]["logprobs"]
    assert lp["tokens"] == [TOK.decode([t]) for t in ids]
    assert [len(t) for t in lp["top_logprobs"]] == [2] * len(ids)
    assert lp["text_offset"] == [len(TOK.decode(ids[:i])) for i in range(len(ids))]
    ref = target_logprobs(parts, TOK.encode("abc hello"), ids)
    assert lp["token_logprobs"] == pytest.approx([float(ref[i, t]) for i, t in enumerate(ids)], abs=1e-9)
    assert plain["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"presence_penalty": -1}, "presence_penalty"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
async def test_fields_the_server_cannot_honour_are_refused_naming_the_field(served, extra, param):
    r = await served.post("/v1/chat/completions", json={**CHAT, **extra})
    assert r.status == 400
    err = (await r.json())["error"]
    assert err["param"] == param
    assert err["code"] == "unsupported_parameter"
    assert param in err["message"]


async def test_the_values_that_change_nothing_are_accepted(served):
    extra = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "frequency_penalty": 0,
             "presence_penalty": 0.0, "logit_bias": {}, "repetition_penalty": 1.0, "user": "me", "seed": -5}
    r = await served.post("/v1/chat/completions", json={**CHAT, **extra})
    assert r.status == 200, await r.text()
    r = await served.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "echo": True})
    assert r.status == 400
    assert (await r.json())["error"]["param"] == "echo"


BAD_NUMBERS = [-1, 1e308, -1e308, 2**63, 2**64, -(2**64), 10**40, 1.5, "7", True, None, [], 1e-320]
NUMERIC = {"max_tokens": [1, 12], "max_completion_tokens": [1, 12], "temperature": [0, 1.5], "top_p": [0.5, 1, 1e-320],
           "top_k": [0, 5], "seed": [0, -1, 2**63 - 1, -(2**63)], "n": [1], "frequency_penalty": [0],
           "presence_penalty": [0], "top_logprobs": [0, 20], "timeout": [1.5, 30, 86400]}


@pytest.mark.parametrize("field", sorted(NUMERIC))
async def test_every_numeric_field_is_range_checked_with_a_400_never_a_500(served, field):
    base = {**CHAT, "max_tokens": 3, "logprobs": True}
    for value in BAD_NUMBERS:
        if value in NUMERIC[field] or (value is None and field not in ("temperature", "top_p", "top_k", "n")):
            continue
        r = await served.post("/v1/chat/completions", data=json.dumps({**base, field: value}),
                              headers={"Content-Type": "application/json"})
        assert r.status == 400, (field, value, await r.text())
        assert (await r.json())["error"]["param"] == field, (field, value)
    for value in NUMERIC[field]:
        r = await served.post("/v1/chat/completions", json={**base, field: value})
        assert r.status == 200, (field, value, await r.text())


@pytest.mark.parametrize("value", [-1, 21, 2**64, 0.5])
async def test_completion_logprobs_are_range_checked(served, value):
    r = await served.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "logprobs": value})
    assert r.status == 400
    assert (await r.json())["error"]["param"] == "logprobs"


async def test_a_reply_past_its_timeout_ends_there_with_finish_reason_length(served):
    r = await served.post("/v1/chat/completions", json={**CHAT, "max_tokens": 150, "timeout": 0.001})
    assert r.status == 200, await r.text()
    data = await r.json()
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["stats"]["deadline_reached"] is True
    assert data["usage"]["completion_tokens"] < 150
    r = await served.post("/v1/chat/completions", json={**CHAT, "timeout": 60})  # time enough: the whole reply
    assert "deadline_reached" not in (await r.json())["stats"]
