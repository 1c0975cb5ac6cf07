"""One request, three views of its ledger: the reply's ``stats``, the dashboard's request summary and /metrics agree
(tokens, steps, tau, accepted tokens by depth, drafted tokens) in every mode, on the in-process 3-stage ring with the
tiny float64 models; and a request resumed on a new pipeline reports the sum over its attempts in all three."""

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import generate_latest

from flowspec_p2p.api.app import create_app
from flowspec_p2p.api.dashboard import dashboard_state
from flowspec_p2p.api.metrics import ApiMetrics
from flowspec_p2p.decoding.context import Pipeline
from flowspec_p2p.decoding.leader import Leader
from flowspec_p2p.decoding.loopback import LoopbackRing
from flowspec_p2p.decoding.registry import builtin_modes
from flowspec_p2p.decoding.settings import LeaderSettings
from flowspec_p2p.ledger import Ledger, reply_stats, request_summary
from flowspec_p2p.model.sampling import SamplingParams
from flowspec_p2p.pipeline.transport import QueueSender

from ..ring_fixtures import F64, ByteTokenizer, tiny_parts
from .test_api_fields import drafter
from .test_metrics import scrape_values, value

TOK = ByteTokenizer()
MODES = ("ar", "chunk", "pipedec", "flowspec", "auto")


@pytest.fixture(scope="module")
def parts(tiny_llama):
    return tiny_parts(tiny_llama)


def leader_for(parts, kind: str, **settings) -> Leader:
    """``kind``: "oracle" (every draft accepted: walks confirm deep drafts) or "random" (most drafts rejected)."""
    return Leader(parts.head, TOK, drafter=drafter(parts, kind), modes=builtin_modes(), model_id="tiny",
                  settings=LeaderSettings(max_context=200, ready_timeout_s=0.05, **settings))


def assert_views_agree(stats: dict, summary: dict, m: dict, mode: str) -> None:
    """``stats`` (the reply's), ``summary`` (the dashboard's) and ``m`` (scraped /metrics, this request alone under
    label ``mode``) say the same about one request."""
    tokens, steps = stats["new_tokens"], stats["steps"]
    assert summary["tokens"] == tokens == value(m, "flowspec_generation_tokens_total", mode=mode)
    assert summary["prompt_tokens"] == stats["prompt_tokens"] == value(m, "flowspec_prompt_tokens_total", mode=mode)
    assert summary["steps"] == steps
    assert stats["tau"] == round(tokens / steps, 4)
    walks = summary["walks"]
    assert walks == value(m, "flowspec_accepted_tokens_per_walk_count", mode=mode)
    emitted = value(m, "flowspec_accepted_tokens_per_walk_sum", mode=mode)
    prefills = 1 + stats.get("resumed", 0)  # each attempt's prefill decided one token in one step
    drafted = stats.get("drafted", 0)
    assert summary["drafted"] == drafted == value(m, "flowspec_draft_tokens_total", mode=mode)
    by_depth = stats.get("accepted_by_depth", [])
    assert by_depth == [value(m, "flowspec_accepted_draft_tokens_total", mode=mode, depth=str(d))
                        for d in range(1, len(by_depth) + 1)]
    assert value(m, "flowspec_accepted_draft_tokens_total", mode=mode, depth=str(len(by_depth) + 1)) == 0
    if walks:  # speculative: every step after the prefills is a walk, and its tokens are the walks' tokens
        assert walks == steps - prefills
        assert emitted == tokens - prefills
        assert summary["tau"] == round(emitted / walks, 3)
        assert summary["acceptance_by_depth"] == [round(n / prev, 3) if prev else 0.0
                                                  for n, prev in zip(by_depth, [walks, *by_depth], strict=False)]
    else:  # autoregressive: one token per step, no draft
        assert steps == tokens
        assert (summary["tau"], drafted, by_depth, summary["acceptance_by_depth"]) == (None, 0, [], [])
    assert summary["resumes"] == stats.get("resumed", 0)


@pytest.mark.parametrize("kind", ["oracle", "random"])
async def test_the_reply_stats_the_dashboard_and_metrics_agree_in_every_mode(parts, kind):
    leader = leader_for(parts, kind)
    app = create_app(leader, lambda: {}, run_leader=False)
    body = {"messages": [{"role": "user", "content": "Hello there"}], "temperature": 0, "max_tokens": 24}
    seen = {}
    async with (LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64, capacity=456),
                TestClient(TestServer(app)) as client):
        for mode in MODES:
            reply = await (await client.post("/v1/chat/completions", json={**body, "decoding": mode})).json()
            stats = reply["stats"]
            summary = (await (await client.get("/dashboard/state")).json())["request"]
            m = scrape_values(await (await client.get("/metrics")).text())
            assert (stats["mode"], summary["mode"], summary["outcome"]) == (mode, mode, "completed")
            assert stats["new_tokens"] == reply["usage"]["completion_tokens"] == 24
            assert_views_agree(stats, summary, m, mode)
            seen[mode] = stats
    speculative = ("chunk", "pipedec", "flowspec")
    assert all(seen[m]["drafted"] > 0 for m in ("chunk", "pipedec"))  # fixed trees (flowspec's adapts to none)
    if kind == "oracle":  # every walk but maybe the last (cut by the budget) confirmed the draft; chunk's deep
        assert all(seen[m]["accepted_by_depth"][0] >= seen[m]["steps"] - 2 for m in speculative)
        assert len(seen["chunk"]["accepted_by_depth"]) >= 2
    assert seen["auto"]["auto"]["chose"] in ("ar", "flowspec")
    assert seen["flowspec"]["walks"] == seen["flowspec"]["steps"] - 1  # the mode's own count, from the same record


@pytest.mark.parametrize("mode", ["ar", "flowspec"])
async def test_a_resumed_request_reports_the_sum_over_its_attempts_in_every_view(parts, mode):
    leader = leader_for(parts, "oracle", prefill_chunk=4, step_timeout_s=10.0, resume_timeout_s=5.0)
    prompt, n = TOK.encode("Hello there"), 40
    ledger = Ledger(mode=mode)
    async with LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64) as ring:
        gen = leader.generate(prompt, params=SamplingParams(), max_tokens=n, stop_ids=frozenset(), mode=mode,
                              stats=ledger)
        out = list(await anext(gen))
        out += await anext(gen)
        before = len(out)
        first = reply_stats(ledger)  # the first attempt, broken below
        await leader.set_pipeline(None)  # a re-plan: the request's pipeline is gone
        nxt = asyncio.get_running_loop().create_task(anext(gen))
        await asyncio.sleep(0.05)
        await leader.set_pipeline(Pipeline(QueueSender(ring.workers[0].inbox, "stage1"), epoch=1, stages=3))
        out += await nxt
        async for chunk in gen:
            out += chunk
    assert out == parts.reference(prompt, n)
    assert 0 < before < n

    stats = reply_stats(ledger)
    assert (stats["new_tokens"], stats["resumed"]) == (n, 1)
    assert [tokens for tokens, _ in ledger.prefills] == [len(prompt), len(prompt) + before]
    first_attempt, second = ledger.attempts
    assert second.new_tokens == before  # where the second attempt began: after what the first committed
    assert stats["prefill_s"] == round(sum(s for _, s in ledger.prefills), 4)
    assert stats["decode_s"] == round(first_attempt.decode_s + second.decode_s, 4)
    assert first_attempt.decode_s > 0
    assert second.decode_s > 0
    assert sum(k for _, k in ledger.chunks) == n  # every chunk of both attempts, stamped in one record
    if mode == "ar":
        assert stats["steps"] == n  # one token per step in both attempts, both prefills included
    else:
        assert stats["steps"] == 2 + len(ledger.walk_tokens)  # two prefills, then the walks of both attempts
        assert stats["walks"] == len(ledger.walk_tokens) - second.walks  # the mode's figures: the last attempt's
        assert first["walks"] == second.walks
        assert stats["drafted"] >= first["drafted"]
        assert stats["drafted"] > 0
    metrics = ApiMetrics(leader)
    metrics.reply(200, None, ledger, True)
    m = scrape_values(generate_latest(metrics.registry).decode())
    summary = (await dashboard_state(leader, None, None))["request"]
    assert summary["resumes"] == 1
    assert_views_agree(stats, summary, m, mode)
    assert value(m, "flowspec_inter_token_latency_seconds_count", mode=mode) == n - 1


DETERMINISTIC = ("new_tokens", "steps", "tau", "prompt_tokens", "drafted", "accepted_by_depth", "tree_nodes",
                 "segments")  # chunk verifies whole trees: what it does depends on the tokens alone, not on timing


@pytest.mark.parametrize("mode", ["ar", "chunk"])
async def test_requests_decoded_at_once_each_keep_their_own_ledger(parts, mode):
    """Four requests in flight together: each ledger holds its own request's figures, the ones it gets alone."""
    leader = leader_for(parts, "random", max_requests=4, prefill_chunk=4)
    prompts = [TOK.encode(t) for t in ("Hi", "Hello there", "A longer prompt here", "Yo")]

    async def one(prompt: list[int]) -> Ledger:
        ledger = Ledger(mode="?")
        async for _ in leader.generate(prompt, params=SamplingParams(), max_tokens=12 + len(prompt) % 5,
                                       stop_ids=frozenset(), mode=mode, stats=ledger):
            pass
        return ledger

    def figures(led: Ledger) -> dict:
        s = reply_stats(led)
        return {k: s[k] for k in DETERMINISTIC if k in s}

    async with LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64):
        alone = [await one(p) for p in prompts]
        together = await asyncio.gather(*(one(p) for p in prompts))
    assert [figures(led) for led in together] == [figures(led) for led in alone]
    assert [led.new_tokens for led in together] == [12 + len(p) % 5 for p in prompts]
    assert [sum(n for _, n in led.chunks) for led in together] == [led.new_tokens for led in together]
    assert len({led.id for led in together}) == len(prompts)
    for led in together:  # and the views of each agree with one another
        metrics = ApiMetrics(leader)
        metrics.reply(200, None, led, True)
        m = scrape_values(generate_latest(metrics.registry).decode())
        assert_views_agree(reply_stats(led), request_summary(led), m, mode)
