"""No agent ends, or stops serving, over what a peer or a stranger does (issue 33, item 3): a stranger holding
1,100 idle connections and flooding the handshake while the agent may open only 1024 files; an mDNS name someone
else holds; the leader vanishing while its members fetch their layers."""

import asyncio
import json
import resource
import sys
import time
from pathlib import Path

import pytest
from zeroconf import IPVersion
from zeroconf.asyncio import AsyncZeroconf

from flowspec_p2p import agent as agent_mod
from flowspec_p2p.agent import Agent
from flowspec_p2p.cluster import gate as gate_mod
from flowspec_p2p.cluster import stage_host as stage_host_mod
from flowspec_p2p.cluster.identity import Identity

from ..agent_fixtures import complete, make_fixture, parts_fixture, quick_timing_fixture, running, serving, start, until
from ..ring_fixtures import ByteTokenizer
from .test_security import register

__all__ = ["make_fixture", "parts_fixture", "quick_timing_fixture"]

PROMPT = ByteTokenizer().encode("flood")
STRANGER = Path(__file__).with_name("stranger.py")


@pytest.fixture
def fd_limit_1024(monkeypatch):
    """The agent runs on a device whose open-files limit is 1024 (soft and hard, as many devices ship)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def lowered() -> int:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
        return 1024

    monkeypatch.setattr(agent_mod, "raise_fd_limit", lowered)
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_idle_connections_and_a_challenge_flood_from_a_stranger_do_not_stop_serving(make, parts, fd_limit_1024):
    leader = Agent(make("lead", leader=True, planning={"context": 128, "stages": 2, "leader_layers": "always"}),
                   tokenizer=ByteTokenizer())
    member = Agent(make("m"))
    async with running(leader, member):
        await until(serving(leader, 1))
        attacker = await asyncio.create_subprocess_exec(
            sys.executable, str(STRANGER), "127.0.0.1", str(leader.info.port), "1100", "127.0.0.2",
            stdout=asyncio.subprocess.PIPE)
        try:
            line = await asyncio.wait_for(attacker.stdout.readline(), 60)
            assert json.loads(line)["idle"] + json.loads(line)["refused"] == 1100
            await asyncio.sleep(0.5)  # the flood is on
            t0 = time.monotonic()
            data = await complete(leader, [1, *PROMPT], 8)
            took = time.monotonic() - t0
            assert data["choices"][0]["text"] == ByteTokenizer().decode(parts.reference(PROMPT, 8))
            assert took < 10
            gate = leader.security.gate
            assert gate.refused > 0
            assert gate.counts()["127.0.0.2"] <= gate_mod.MAX_UNVOUCHED  # what the stranger holds at most
            assert member.id in leader.coordinator.membership.members  # heartbeats go on
        finally:
            attacker.kill()
            await attacker.wait()


async def test_an_agent_whose_mdns_name_is_squatted_starts_and_is_found_under_another(make, caplog):
    cfg = make("lead", leader=True)
    aid = Identity.load_or_create(cfg.state_path).agent_id  # the id the agent will have: its name is predictable
    zc = AsyncZeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    try:
        await register(zc, f"{cfg.cluster}-{aid}", 9, {"squatter": "1"})  # the agent's instance name
        leader, member = Agent(cfg, tokenizer=ByteTokenizer()), Agent(make("m"))
        async with running(leader, member):
            await until(serving(leader, 1))
        assert "is taken; advertising as" in caplog.text
    finally:
        await zc.async_close()


async def test_the_leader_vanishing_while_members_fetch_their_layers_ends_no_member(make, parts, monkeypatch):
    """The members are fetching their layers when the leader vanishes (no goodbye): each logs it and stays up; when
    the leader comes back (same state folder, same id) they serve its next plan."""
    fetching = asyncio.Event()
    real = stage_host_mod.fetch_range

    async def slow_fetch(*a, **k):
        fetching.set()
        await asyncio.sleep(1.0)  # the leader vanishes meanwhile
        return await real(*a, **k)

    monkeypatch.setattr(stage_host_mod, "fetch_range", slow_fetch)
    plan = {"context": 128, "stages": 2, "leader_layers": "never"}
    cfg = make("lead", leader=True, planning=plan)
    leader = Agent(cfg, tokenizer=ByteTokenizer())
    a, b = Agent(make("a")), Agent(make("b"))
    async with running(a, b) as tasks:
        await start(tasks, leader)
        await asyncio.wait_for(fetching.wait(), 60)
        leader._goodbye = _silent
        tasks[leader].cancel()  # vanishes as under kill -9
        await asyncio.gather(tasks[leader], return_exceptions=True)
        await asyncio.sleep(1.5)  # the members' reports fail, their heartbeats time out
        assert not tasks[a].done()
        assert not tasks[b].done()
        monkeypatch.setattr(stage_host_mod, "fetch_range", real)
        again = Agent(cfg, tokenizer=ByteTokenizer())
        tasks[again] = asyncio.create_task(again.run())
        await until(serving(again, 2))
        assert again.id == leader.id
        data = await complete(again, [1, *PROMPT], 6)
        assert data["choices"][0]["text"] == ByteTokenizer().decode(parts.reference(PROMPT, 6))
        assert not tasks[a].done()
        assert not tasks[b].done()
        again.stop()


async def _silent():
    return None
