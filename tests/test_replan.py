"""Re-planning in one process (tiny float64 model, loopback, shrunk timing): a join, a graceful stop and a member
that vanishes each yield a new plan, and serving continues with the same greedy output."""

import asyncio

from flowspec_p2p.agent import Agent

from .agent_fixtures import complete, make_fixture, parts_fixture, quick_timing_fixture, running, serving, start, until
from .ring_fixtures import ByteTokenizer

__all__ = ["make_fixture", "parts_fixture", "quick_timing_fixture"]


async def test_replans_on_join_graceful_leave_and_a_vanished_member(make, parts):
    leader = Agent(make("lead", leader=True), tokenizer=ByteTokenizer())
    a = Agent(make("a"))
    prompt = ByteTokenizer().encode("join")
    ref = ByteTokenizer().decode(parts.reference(prompt, 6))
    async with running(leader, a) as tasks:
        await until(serving(leader, 1))
        e1 = leader.update.epoch
        b = Agent(make("b"))
        await start(tasks, b)  # a join
        await until(serving(leader, 2, e1))
        e2 = leader.update.epoch
        assert b.id in leader.plan.agents
        assert (await complete(leader, [1, *prompt], 6))["choices"][0]["text"] == ref
        b.stop()  # graceful: Bye
        await tasks[b]
        await until(serving(leader, 1, e2))
        e3 = leader.update.epoch
        assert b.id not in leader.plan.agents
        assert leader.membership.members.keys() == {a.id}
        assert (await complete(leader, [1, *prompt], 6))["choices"][0]["text"] == ref
        a._goodbye = _silent  # vanish: no Bye (its sockets and mDNS record still go away)
        tasks[a].cancel()
        await asyncio.gather(tasks[a], return_exceptions=True)
        await until(serving(leader, 0, e3))
        assert leader.plan.agents == (leader.id,)
        assert (await complete(leader, [1, *prompt], 6))["choices"][0]["text"] == ref
        assert [r["epoch"] for r in leader.recoveries][-3:] == [e2, e3, leader.update.epoch]


async def _silent():
    return None
