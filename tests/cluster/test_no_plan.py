"""Agents offering too little memory: the leader does not load and fail, it says "no plan: short by N MB" (log,
/health, /cluster and the dashboard), and serves once an agent with room joins."""

import aiohttp

from flowspec_p2p.agent import Agent

from ..agent_fixtures import make_fixture, parts_fixture, quick_timing_fixture, running, serving, start, until
from ..ring_fixtures import ByteTokenizer

__all__ = ["make_fixture", "parts_fixture", "quick_timing_fixture"]


async def test_too_little_memory_says_no_plan_short_by_n_mb_until_an_agent_with_room_joins(make):
    tiny = {"gflops": 10.0, "memory_mb": 0.1}  # less than one layer of the tiny model and its KV
    leader = Agent(make("lead", leader=True, planning={"context": 128, "leader_layers": "never"}),
                   tokenizer=ByteTokenizer())
    small = Agent(make("small", profile=tiny))
    async with running(leader, small) as tasks:
        await until(lambda: leader.coordinator is not None and "short by" in (leader.coordinator.no_plan or "")
                    and len(leader.coordinator.membership.members) == 1)
        async with aiohttp.ClientSession() as s:
            async with s.get(leader.api_url + "/health") as r:
                assert r.status == 503
                health = await r.json()
            async with s.get(leader.api_url + "/cluster") as r:
                view = await r.json()
        assert health["no_plan"].startswith("no plan: short by ")
        assert view["no_plan"] == health["no_plan"]
        assert leader.coordinator.update is None  # nothing was loaded
        roomy = Agent(make("roomy", profile={"gflops": 10.0, "memory_mb": 2000.0}))
        await start(tasks, roomy)
        await until(serving(leader, 2))
        assert leader.coordinator.no_plan is None
        assert roomy.id in leader.coordinator.plan.agents
        roomy.stop()
