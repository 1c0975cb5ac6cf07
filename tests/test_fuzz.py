"""Fuzzing in CI (bench/fuzz.py; loopback, port 0, a few dozen inputs per target): hostile frames to a live stage,
hostile control messages to a live leader and member, hostile API bodies; every run ends with a correct greedy reply
from the same cluster, and no target died or answered 500."""

import logging

import pytest

from flowspec_p2p.agent import Agent
from flowspec_p2p.bench import fuzz
from flowspec_p2p.decoding.ar import AR
from flowspec_p2p.decoding.chunk import CHUNK
from flowspec_p2p.decoding.leader import Leader
from flowspec_p2p.decoding.loopback import LoopbackRing
from flowspec_p2p.decoding.settings import LeaderSettings
from flowspec_p2p.ledger import Ledger
from flowspec_p2p.model.sampling import SamplingParams
from flowspec_p2p.pipeline.messages import PROTOCOL_VERSION
from flowspec_p2p.pipeline.transport import RingHello
from flowspec_p2p.speculative.drafter import OracleDrafter

from .agent_fixtures import complete, make_fixture, parts_fixture, quick_timing_fixture, running, serving, until
from .ring_fixtures import F64, ByteTokenizer

__all__ = ["make_fixture", "parts_fixture", "quick_timing_fixture"]

PROMPT = [5, 17, 33, 8, 61, 9, 12, 40, 3, 77, 21]
FRAMES = 60  # per stage
MESSAGES = 50  # per agent
BODIES = 50


async def greedy(leader, mode, n=16):
    out = []
    async for chunk in leader.generate(PROMPT, params=SamplingParams(), max_tokens=n, stop_ids=frozenset(),
                                       mode=mode, stats=Ledger(mode="?")):
        out += chunk
    return out


@pytest.mark.parametrize("stage", [1, 2])
async def test_hostile_frames_to_a_live_stage_leave_it_serving(parts, stage, caplog):
    caplog.set_level(logging.ERROR)  # every refusal logs a warning
    leader = Leader(parts.head, None, drafter=OracleDrafter(parts.whole), modes=[AR, CHUNK],
                    settings=LeaderSettings(max_context=160, step_timeout_s=10.0))
    async with LoopbackRing(parts.stages, leader, hops="ws", wire_dtype=F64) as ring:
        assert await greedy(leader, "ar") == parts.reference(PROMPT, 16)
        target = fuzz.StageTarget(
            url=ring.urls[stage - 1], worker=ring.workers[stage - 1], server=ring.servers[stage - 1],
            hello=RingHello(protocol=PROTOCOL_VERSION, cluster=ring.cluster, epoch=0, sender="fuzzer",
                            wire_dtype="float64"))
        frames = fuzz.frames(hidden=64, takes="tokens" if stage == 1 else "hidden", wire="float64")
        counts = await fuzz.fuzz_stage(target, fuzz.draw(frames, FRAMES, seed=stage))
        assert sum(counts.values()) == FRAMES
        assert set(counts) <= {"link_closed", "request_error", "dropped_foreign", "applied"}, counts
        assert counts["link_closed"], counts
        assert counts["request_error"], counts
        assert all(w.running for w in ring.workers)
        for mode in ("ar", "chunk"):
            assert await greedy(leader, mode) == parts.reference(PROMPT, 16)


async def test_hostile_control_messages_and_api_bodies_leave_the_cluster_serving(make, parts, caplog):
    caplog.set_level(logging.ERROR)
    leader = Agent(make("lead", leader=True, insecure=True, profile={"gflops": 1.0, "memory_mb": 2000.0}),
                   tokenizer=ByteTokenizer())
    member = Agent(make("m", insecure=True, profile={"gflops": 50.0, "memory_mb": 2000.0}))
    prompt = ByteTokenizer().encode("fuzz")
    ref = ByteTokenizer().decode(parts.reference(prompt, 8))
    async with running(leader, member) as tasks:
        await until(serving(leader, 1))
        ids = [leader.id, member.id]
        cluster = leader.cfg.cluster
        control = {}
        for i, agent in enumerate((leader, member)):
            inputs = fuzz.control_inputs(ids, MESSAGES, seed=10 + i, cluster=cluster)
            control[agent.cfg.name] = await fuzz.fuzz_http(agent.info.url, inputs)
        api = await fuzz.fuzz_http(leader.api_url, fuzz.draw(fuzz.api_bodies(), BODIES, seed=3))
        assert not any(t.done() for t in tasks.values())
        for c in (*control.values(), api):
            assert not [k for k in c if (k.startswith("5") and k != "503") or k.startswith("error")], c
        assert sum(api.values()) == BODIES
        assert api["400"], api
        assert api["200"], api
        await until(serving(leader, 1))
        assert (await complete(leader, [1, *prompt], 8))["choices"][0]["text"] == ref
