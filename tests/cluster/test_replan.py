"""Re-planning in one process (tiny float64 model, loopback, shrunk timing): a join, a graceful stop and a member
that vanishes each yield a new plan, and serving continues with the same greedy output."""

import asyncio
import json

import aiohttp

from flowspec_p2p.agent import Agent

from ..agent_fixtures import complete, make_fixture, parts_fixture, quick_timing_fixture, running, serving, start, until
from ..ring_fixtures import ByteTokenizer

__all__ = ["make_fixture", "parts_fixture", "quick_timing_fixture"]


async def test_replans_on_join_graceful_leave_and_a_vanished_member(make, parts):
    leader = Agent(make("lead", leader=True), tokenizer=ByteTokenizer())
    a = Agent(make("a"))
    prompt = ByteTokenizer().encode("join")
    ref = ByteTokenizer().decode(parts.reference(prompt, 6))
    async with running(leader, a) as tasks:
        await until(serving(leader, 1))
        e1 = leader.coordinator.update.epoch
        b = Agent(make("b"))
        await start(tasks, b)  # a join
        await until(serving(leader, 2, e1))
        e2 = leader.coordinator.update.epoch
        assert b.id in leader.coordinator.plan.agents
        assert (await complete(leader, [1, *prompt], 6))["choices"][0]["text"] == ref
        b.stop()  # graceful: Bye
        await until(lambda: b.id not in leader.coordinator.membership.members)
        # a request arriving while the cluster re-plans waits for the new pipeline (bounded) and is served
        assert (await complete(leader, [1, *prompt], 6))["choices"][0]["text"] == ref
        await tasks[b]
        await until(serving(leader, 1, e2))
        e3 = leader.coordinator.update.epoch
        assert b.id not in leader.coordinator.plan.agents
        assert leader.coordinator.membership.members.keys() == {a.id}
        assert (await complete(leader, [1, *prompt], 6))["choices"][0]["text"] == ref
        a._goodbye = _silent  # vanish: no Bye (its sockets and mDNS record still go away)
        tasks[a].cancel()
        await asyncio.gather(tasks[a], return_exceptions=True)
        await until(serving(leader, 0, e3))
        assert leader.coordinator.plan.agents == (leader.id,)
        assert (await complete(leader, [1, *prompt], 6))["choices"][0]["text"] == ref
        c = leader.coordinator
        assert [r["epoch"] for r in c.recoveries][-3:] == [e2, e3, c.update.epoch]


async def _silent():
    return None


async def test_a_request_in_flight_when_its_stage_vanishes_resumes_on_the_new_plan(make, parts):
    """The stage vanishes mid-stream; the cluster re-plans without it and the stream continues from the tokens it
    already sent, with the same greedy text as single-device decoding."""
    leader = Agent(make("lead", leader=True, profile={"gflops": 1.0, "memory_mb": 2000.0}), tokenizer=ByteTokenizer())
    slow = Agent(make("slow", profile={"gflops": 50.0, "memory_mb": 2000.0}, emulation={"slowdown": 40.0}))
    async with running(leader, slow) as tasks:
        await until(serving(leader, 1))
        assert slow.id in leader.coordinator.plan.agents
        epoch = leader.coordinator.update.epoch
        body = {"prompt": "abc", "max_tokens": 120, "temperature": 0, "stream": True, "decoding": "ar"}
        events = []
        timeout = aiohttp.ClientTimeout(total=30)
        url = leader.api_url + "/v1/completions"
        async with aiohttp.ClientSession(timeout=timeout) as s, s.post(url, json=body) as r:
            assert r.status == 200
            t0 = asyncio.get_running_loop().time()
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:  # mid-stream: the stage vanishes without a goodbye
                    slow._goodbye = _silent
                    tasks[slow].cancel()
            took = asyncio.get_running_loop().time() - t0
        assert took < 20  # ended, did not hang
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks), chunks[-1]
        prompt = ByteTokenizer().encode("abc")
        text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
        assert text == ByteTokenizer().decode(parts.reference(prompt, 120, stop_ids=ByteTokenizer.stop_ids))
        assert chunks[-1]["stats"]["resumed"] == 1
        await until(serving(leader, 0, epoch))
        assert leader.coordinator.plan.agents == (leader.id,)
        data = await complete(leader, [1, *prompt], 8)
        assert data["choices"][0]["text"] == ByteTokenizer().decode(parts.reference(prompt, 8))


async def test_a_stage_whose_compute_hangs_is_planned_around_and_the_request_resumes(make, parts, monkeypatch):
    """The stage's forward hangs with its sockets and heartbeats alive: once it has run past the stall bound the
    leader marks it failed, re-plans without it, and the request resumes with the single-device text."""
    import threading

    from flowspec_p2p.cluster import coordinator

    monkeypatch.setattr(coordinator, "STALL_MIN_S", 1.0)
    leader = Agent(make("lead", leader=True, profile={"gflops": 1.0, "memory_mb": 2000.0}), tokenizer=ByteTokenizer())
    hung = Agent(make("hung", profile={"gflops": 50.0, "memory_mb": 2000.0}))
    release = threading.Event()
    async with running(leader, hung):
        await until(serving(leader, 1))
        assert hung.id in leader.coordinator.plan.agents
        epoch = leader.coordinator.update.epoch
        core = hung.stage_host.active.worker.core
        real = core.handle
        calls = []

        def handle(msg, *a, **k):
            calls.append(msg.kind)
            if msg.kind == "forward" and len(calls) > 4:
                release.wait(30)  # the compute hangs; the agent's event loop goes on
            return real(msg, *a, **k)

        core.handle = handle
        prompt = ByteTokenizer().encode("abc")
        try:
            t0 = asyncio.get_running_loop().time()
            data = await complete(leader, [1, *prompt], 40)
            took = asyncio.get_running_loop().time() - t0
        finally:
            release.set()
        assert data["choices"][0]["text"] == ByteTokenizer().decode(parts.reference(prompt, 40))
        assert data["stats"]["resumed"] == 1
        assert took < 15
        assert leader.coordinator.membership.members[hung.id].failed
        assert leader.coordinator.plan.agents == (leader.id,)
        assert leader.coordinator.update.epoch > epoch
