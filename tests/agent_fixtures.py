"""Shared by the agent tests: agents in one process on the loopback interface with the tiny float64 model, and
timing constants shrunk (python-zeroconf's quick_timing idea). Import the fixtures by name.

``make`` gives every agent of a test the same fresh cluster key (TLS and authentication, the default); pass
``insecure=True`` for the open mode, or ``secret=``/``cluster_key=``/``cluster_key_file=`` for another key."""

import asyncio
import contextlib
import uuid

import aiohttp
import pytest

from flowspec_p2p.agent import Agent
from flowspec_p2p.cluster import coordinator, discovery
from flowspec_p2p.cluster import membership as cluster
from flowspec_p2p.cluster.keys import ClusterKey
from flowspec_p2p.config import AgentConfig

from .ring_fixtures import ByteTokenizer, tiny_parts

PROMPT = [1, 40, 41, 42, 10, 11, 12, 50, 51, 52, 60]


@pytest.fixture(name="quick_timing", autouse=True)
def quick_timing_fixture(monkeypatch):
    monkeypatch.setattr(coordinator, "LEADER_PROBE_S", 0.3)
    monkeypatch.setattr(coordinator, "INITIAL_PLAN_DELAY_S", 0.8)
    monkeypatch.setattr(cluster, "HEARTBEAT_INTERVAL_S", 0.2)
    monkeypatch.setattr(cluster, "HEARTBEAT_TIMEOUT_S", 1.0)
    monkeypatch.setattr(cluster, "REPLAN_DEBOUNCE_S", 0.2)
    monkeypatch.setattr(discovery, "STATIC_POLL_INTERVAL_S", 0.2)


@pytest.fixture(name="parts", scope="module")
def parts_fixture(tiny_llama):
    return tiny_parts(tiny_llama)


@pytest.fixture(name="make")
def make_fixture(tmp_path, tiny_llama):
    name = f"t-{uuid.uuid4().hex[:6]}"
    key = ClusterKey.generate().text

    def cfg(label: str, leader: bool = False, **kw) -> AgentConfig:
        keyed = not any(kw.get(k) for k in ("insecure", "secret", "cluster_key", "cluster_key_file"))
        data = dict(cluster=name, name=label, leader=leader, model=tiny_llama if leader else None,
                    cluster_key=key if keyed else None,
                    interfaces=("127.0.0.1",), state_dir=tmp_path / label, api_port=0, dtype="float64",
                    wire_dtype="float64", planning={"context": 128, "leader_layers": "always"},
                    profile={"gflops": 10.0, "memory_mb": 2000.0})
        data.update(kw)
        return AgentConfig.model_validate(data)

    return cfg


@contextlib.asynccontextmanager
async def running(*agents: Agent):
    tasks = {a: asyncio.create_task(a.run()) for a in agents}
    try:
        yield tasks
    finally:
        for a in agents:
            a.stop()
        await asyncio.wait_for(asyncio.gather(*tasks.values(), return_exceptions=True), 15)


async def start(tasks: dict, a: Agent):
    tasks[a] = asyncio.create_task(a.run())
    return tasks[a]


async def until(cond, timeout_s: float = 90.0):
    async with asyncio.timeout(timeout_s):
        while not cond():  # noqa: ASYNC110 - polling another component's state
            await asyncio.sleep(0.05)


def serving(leader: Agent, members: int, epoch_after: int = 0):
    def check() -> bool:
        c = leader.coordinator
        return (c is not None and c.update is not None and c.transition is None and c.broken is None
                and c.update.epoch > epoch_after and len(c.membership.members) == members
                and c.membership.changed_at is None and not c.planning)
    return check


async def complete(leader: Agent, prompt, n: int = 12) -> list[int]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        body = {"prompt": ByteTokenizer().decode(prompt[1:]), "max_tokens": n, "temperature": 0}
        async with s.post(leader.api_url + "/v1/completions", json=body) as r:
            data = await r.json()
            assert r.status == 200, data
            return data
