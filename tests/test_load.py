"""Load (bench/load.py) on an in-process cluster of a leader and a member: 16 clients for LOAD_S seconds, several
requests in flight and the rest queued, get only 200s while the queue has room, every 200 equals the single-client
reply, and RSS holds within 15% from the first to the last quarter; with the queue shrunk, the overflow gets 503s
with Retry-After. CI runs LOAD_S = 8 s; ``flowspec load --clients 16 --seconds 30`` against ``flowspec cluster up``
is the by-hand run (docs/experiments.md)."""

from flowspec_p2p.agent import Agent
from flowspec_p2p.bench.load import drift, percentile, run_load, second_turn

from .agent_fixtures import make_fixture, parts_fixture, quick_timing_fixture, running, serving, until
from .ring_fixtures import ByteTokenizer

__all__ = ["make_fixture", "parts_fixture", "quick_timing_fixture"]

LOAD_S = 8.0
CLIENTS = 16


async def test_sixteen_clients_are_served_while_the_queue_has_room_and_told_to_retry_beyond_it(make):
    leader = Agent(make("lead", leader=True, profile={"gflops": 1.0, "memory_mb": 2000.0}), tokenizer=ByteTokenizer())
    member = Agent(make("m", profile={"gflops": 50.0, "memory_mb": 2000.0}))
    async with running(leader, member):
        await until(serving(leader, 1))
        report = await run_load(leader.api_url, clients=CLIENTS, seconds=LOAD_S, max_tokens=8, sample_s=0.25)
        admission = leader.leader.admission
        admission.max_waiting = 2  # a small queue: one in flight, two waiting, the rest told to retry
        admission.set_limit(1)
        overflow = await run_load(leader.api_url, clients=CLIENTS, seconds=2.0, max_tokens=8, sample_s=0.25)
    statuses = report["statuses"]
    assert set(statuses) == {"200"}, statuses  # several in flight and a queue with room: nobody refused
    assert statuses["200"] >= 16
    assert report["tokens_per_s"] > 0
    assert report["generated_tokens"] == 8 * statuses["200"]
    assert report["ttft_s"]["p50"] is not None
    assert report["ttft_s"]["p99"] >= report["ttft_s"]["p50"]
    assert report["itl_s"]["p50"] is not None
    assert set(overflow["statuses"]) == {"200", "503"}, overflow["statuses"]
    assert overflow["503s_without_retry_after"] == 0
    assert overflow["mismatched_200s"] == 0
    assert report["mismatched_200s"] == 0
    assert report["latency_s"]["p50"] is not None
    assert len(report["rss_samples"]) >= 8
    assert report["rss_drift"], report["rss_samples"][:2]
    assert all(abs(d) <= 0.15 for d in report["rss_drift"].values()), report["rss_drift"]


def test_percentiles_and_drift():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([], 90) is None
    samples = [(float(t), {"a": 100 if t < 4 else 110}) for t in range(8)]
    assert drift(samples) == {"a": 0.1}


async def test_a_second_turn_is_measured_against_a_cold_prefill(make):
    leader = Agent(make("lead", leader=True, profile={"gflops": 1.0, "memory_mb": 2000.0},
                        planning={"context": 512, "leader_layers": "always"}), tokenizer=ByteTokenizer())
    member = Agent(make("m", profile={"gflops": 50.0, "memory_mb": 2000.0}))
    async with running(leader, member):
        await until(serving(leader, 1))
        report = await second_turn(leader.api_url, article="The river runs to the sea. " * 2, rounds=2,
                                   max_tokens=6)
    assert report["replies_agree"]
    assert report["cached_tokens"] >= report["prompt_tokens"] // 2  # the first turn's prompt and reply at least
    assert report["ttft_cold_s"] > 0
    assert report["ttft_second_turn_s"] > 0
