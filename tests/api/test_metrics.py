"""/metrics after real requests, scraped with prometheus-client's own parser: the counts match the replies. And the
access log: one line per request."""

import logging

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from flowspec_p2p.api.app import create_app
from flowspec_p2p.decoding.leader import Leader
from flowspec_p2p.decoding.loopback import LoopbackRing
from flowspec_p2p.decoding.registry import builtin_modes
from flowspec_p2p.decoding.settings import LeaderSettings

from ..ring_fixtures import F64, ByteTokenizer, tiny_parts
from .test_api import read_sse
from .test_api_fields import drafter

TOK = ByteTokenizer()
MESSAGES = [{"role": "user", "content": "Hello there"}]
SPECULATIVE = ("chunk", "pipedec", "flowspec")


@pytest.fixture(scope="module")
def parts(tiny_llama):
    return tiny_parts(tiny_llama)


@pytest.fixture
async def served(parts):
    leader = Leader(parts.head, TOK, drafter=drafter(parts, "oracle"), modes=builtin_modes(), model_id="tiny",
                    settings=LeaderSettings(max_context=200, ready_timeout_s=0.05))
    view = {"members": [{"id": "a"}, {"id": "b"}], "epoch": 3}
    app = create_app(leader, lambda: view, run_leader=False)
    async with (LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64, capacity=200 + 256),
                TestClient(TestServer(app)) as client):
        yield client


def scrape_values(text: str) -> dict:
    """{(sample name, frozenset of labels): value}"""
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def one(client, mode: str, stream: bool, max_tokens: int) -> dict:
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": max_tokens, "decoding": mode, "stream": stream,
            "stream_options": {"include_usage": True}}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status == 200, await r.text()
    if not stream:
        data = await r.json()
        return {"usage": data["usage"], "stats": data["stats"]}
    events = [e for e in await read_sse(r) if e != "[DONE]"]
    return {"usage": events[-1]["usage"], "stats": next(e["stats"] for e in events if "stats" in e)}


async def test_metrics_count_requests_tokens_walks_and_errors_as_the_replies_say(served, caplog):
    client = served
    caplog.set_level(logging.INFO, logger="flowspec_p2p.api.access")
    replies = {"ar": await one(client, "ar", False, 12), "chunk": await one(client, "chunk", True, 20),
               "pipedec": await one(client, "pipedec", True, 16), "flowspec": await one(client, "flowspec", False, 24)}
    bad = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "decoding": "warp"})
    refused = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": [{"type": "x"}]})
    assert (bad.status, refused.status) == (400, 400)
    r = await client.get("/metrics")
    assert r.status == 200
    assert r.headers["Content-Type"].startswith("text/plain")
    m = scrape_values(await r.text())

    for mode, reply in replies.items():
        usage, stats = reply["usage"], reply["stats"]
        assert value(m, "flowspec_requests_total", mode=mode, status="200") == 1
        assert value(m, "flowspec_prompt_tokens_total", mode=mode) == usage["prompt_tokens"]
        assert value(m, "flowspec_generation_tokens_total", mode=mode) == usage["completion_tokens"]
        assert value(m, "flowspec_time_to_first_token_seconds_count", mode=mode) == 1
        assert value(m, "flowspec_inter_token_latency_seconds_count", mode=mode) == usage["completion_tokens"] - 1
        assert value(m, "flowspec_request_duration_seconds_count", mode=mode) == 1
        walks = value(m, "flowspec_accepted_tokens_per_walk_count", mode=mode)
        if mode in SPECULATIVE:
            assert walks == stats["steps"] - 1  # steps count the prefill too
            assert value(m, "flowspec_accepted_tokens_per_walk_sum", mode=mode) == stats["new_tokens"] - 1
            assert value(m, "flowspec_draft_tokens_total", mode=mode) > 0
            assert 0 < value(m, "flowspec_accepted_draft_tokens_total", mode=mode, depth="1") <= walks  # oracle
        else:
            assert walks == 0
    assert value(m, "flowspec_requests_total", mode="none", status="400") == 2
    assert value(m, "flowspec_errors_total", status="400", reason="invalid_request_error") == 1
    assert value(m, "flowspec_errors_total", status="400", reason="unsupported_parameter") == 1
    assert value(m, "flowspec_leader_requests_total", outcome="completed") == 4
    for stage in ("1", "2", "3"):
        assert value(m, "flowspec_pipeline_stage_busy_seconds_total", stage=stage) > 0
        assert value(m, "flowspec_pipeline_stage_bubble_seconds_total", stage=stage) >= 0
    assert value(m, "flowspec_ring_round_trip_seconds_count") > 0
    assert value(m, "flowspec_link_bytes_total", direction="in") > 0
    assert value(m, "flowspec_queue_depth") == 0
    assert value(m, "flowspec_requests_in_flight") == 0
    assert value(m, "flowspec_pipeline_ready") == 1
    assert value(m, "flowspec_pipeline_stages") == 3
    assert value(m, "flowspec_cluster_members") == 2
    assert value(m, "flowspec_replans_total") == 2
    assert value(m, "flowspec_resumes_total") == 0

    lines = [r.getMessage() for r in caplog.records if r.name == "flowspec_p2p.api.access"]
    assert len(lines) == 7  # six completions and the scrape
    assert lines[0].startswith("POST /v1/chat/completions 200 12 tokens (ar) ")
    assert lines[0].endswith(" s")
    assert lines[4].startswith("POST /v1/chat/completions 400 ")
    assert lines[6].startswith("GET /metrics 200 ")


async def test_requests_in_flight_their_wait_and_the_prompt_cache_are_on_metrics_and_the_dashboard(parts):
    """Four requests at once: the dashboard lists those in flight with their time to first token and wait; /metrics
    has the plan's requests in flight, the queue wait histogram, the stages' rows per forward (from their counters
    in the cluster view) and the tokens a second turn took from the prompt cache."""
    import asyncio

    leader = Leader(parts.head, TOK, modes=builtin_modes(), model_id="tiny",
                    settings=LeaderSettings(max_context=200, ready_timeout_s=0.05, max_requests=4))
    view = {"members": [{"id": "a"}], "epoch": 1,
            "stages": [{"stage": 1, "counters": {"engine_calls": 4, "engine_rows": 10, "batched_forwards": 3}}]}
    app = create_app(leader, lambda: view, run_leader=False)
    async with (LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64, capacity=456),
                TestClient(TestServer(app)) as client):
        seen = []

        async def watch():
            while not seen or len(seen[-1]) < 2:
                seen.append((await (await client.get("/dashboard/state")).json())["in_flight"])
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(one(client, "ar", False, 40) for _ in range(4)))
        await asyncio.wait_for(watcher, 5)
        first = [{"role": "user", "content": "Hello there, tell me a long story about the sea."}]
        r = await client.post("/v1/chat/completions", json={"messages": first, "max_tokens": 8, "temperature": 0})
        turn1 = await r.json()
        second = [*first, turn1["choices"][0]["message"], {"role": "user", "content": "More!"}]
        r = await client.post("/v1/chat/completions", json={"messages": second, "max_tokens": 8, "temperature": 0})
        cached = (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
        state = (await (await client.get("/dashboard/state")).json())
        text = await (await client.get("/metrics")).text()
    assert max(len(x) for x in seen) >= 2
    assert {"id", "mode", "tokens", "ttft_s", "queued_s", "cached_tokens"} <= set(seen[-1][0])
    assert state["stage_rows"] == [{"stage": 1, "rows_per_forward": 2.5, "batched_forwards": 3}]
    samples = scrape_values(text)
    assert value(samples, "flowspec_max_requests") == 4
    assert value(samples, "flowspec_queue_wait_seconds_count") == 6
    assert cached > 0
    assert cached > turn1["usage"]["prompt_tokens_details"]["cached_tokens"]  # the whole first turn, this time
    assert value(samples, "flowspec_prompt_cached_tokens_total") == cached + turn1["usage"]["prompt_tokens_details"][
        "cached_tokens"]
    assert value(samples, "flowspec_pipeline_stage_rows_per_forward", stage="1") == 2.5
