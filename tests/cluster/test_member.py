"""A member's control loop against a fake network (no sockets): how it finds its leader lost and who takes over;
and the stage host's ring link of a superseded epoch."""

import asyncio
import socket
import time
from types import SimpleNamespace

import aiohttp
import pytest
import torch

from flowspec_p2p.cluster import member as member_mod
from flowspec_p2p.cluster import membership
from flowspec_p2p.cluster.control import Ack, Bye, Hello, PeerInfo, Welcome
from flowspec_p2p.cluster.device import DeviceProfile
from flowspec_p2p.cluster.member import MemberControl
from flowspec_p2p.cluster.stage_host import connect_with_retry
from flowspec_p2p.errors import PeerGone
from flowspec_p2p.pipeline.emulation import LinkEmulation
from flowspec_p2p.pipeline.messages import PROTOCOL_VERSION
from flowspec_p2p.pipeline.transport import RingHello

PROFILE = DeviceProfile(gflops=1.0, memory_bytes=1 << 30, threads=1)


def info(aid: str, role: str = "member", port: int = 4000) -> PeerInfo:
    return PeerInfo(id=aid, cluster="home", role=role, host="127.0.0.1", port=port, started=1.0, profile=PROFILE,
                    identity=aid * 4)


LEADER, STANDBY, OTHER = info("lead", "leader", 4001), info("stby", port=4002), info("othr", port=4003)


class FakeNet:
    """The leader answers every heartbeat, but is gone when probed (it froze, or died without closing its links)."""

    def __init__(self):
        self.posts: list[tuple[str, object]] = []
        self.probes: list[int] = []
        self.tasks: set[asyncio.Task] = set()

    async def post(self, url, msg):
        self.posts.append((url, msg))
        return Welcome(leader=LEADER, epoch=1) if isinstance(msg, Hello) else Ack(epoch=1)

    async def fetch_info(self, host, port, timeout_s=1.0):
        self.probes.append(port)
        return None

    def spawn(self, coro, name=None):
        t = asyncio.ensure_future(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)


class FakeStageHost:
    active = None

    def snapshot(self):
        return {}

    async def release(self):
        return None


def standby_member(net: FakeNet, took_over: list) -> MemberControl:
    m = MemberControl(STANDBY, net=net, stage_host=FakeStageHost(),
                      on_takeover=lambda u, why: took_over.append(why) or True)
    m.peer_seen(LEADER)
    m.last_update = SimpleNamespace(leader=LEADER, standby=STANDBY.id, standby_info=STANDBY,
                                    members=(STANDBY, OTHER))
    return m


async def joined(m: MemberControl) -> asyncio.Task:
    task = asyncio.create_task(m.run())
    async with asyncio.timeout(5):
        while m.leader is None:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    return task


async def test_the_standby_probes_its_leader_when_a_member_says_it_is_lost(monkeypatch):
    """A member that found the leader gone tells the standby (Hello); the standby, whose own links may not touch
    the leader, probes it at once instead of waiting for its heartbeats to fail."""
    monkeypatch.setattr(membership, "HEARTBEAT_INTERVAL_S", 30.0)
    net, took_over = FakeNet(), []
    m = standby_member(net, took_over)
    task = await joined(m)
    try:
        await m.handle(Hello(peer=info("stranger", port=4009)))  # not of the plan: no probe
        await asyncio.sleep(0.1)
        assert net.probes == []
        await m.handle(Hello(peer=OTHER))
        async with asyncio.timeout(2):
            while not took_over:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        assert net.probes == [LEADER.port]
        assert took_over == ["lost"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_leader_that_stops_hands_over_to_the_standby_its_bye_names(monkeypatch):
    """A leader's Bye naming its plan's standby: the standby takes over (the leader "stopped", for the plan
    history), and the member does not join that leader again until it restarts; a Bye naming none (the cluster
    stops on purpose) makes nobody take over."""
    monkeypatch.setattr(membership, "HEARTBEAT_INTERVAL_S", 30.0)
    for successor, expected in ((STANDBY.id, ["stopped"]), ("", []), (OTHER.id, [])):
        net, took_over = FakeNet(), []
        m = standby_member(net, took_over)
        task = await joined(m)
        try:
            await m.handle(Bye(agent_id=LEADER.id, successor=successor))
            await asyncio.sleep(0.2)
            assert took_over == expected
            m.peer_seen(LEADER)  # its advert, still there while it stops
            assert LEADER.id not in m.candidates
            m.peer_seen(LEADER.model_copy(update={"started": 2.0}))  # started again
            assert LEADER.id in m.candidates
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_a_ring_link_of_a_superseded_epoch_is_not_retried():
    """A stage (or the leader) opening its link for an epoch that a newer plan superseded stops retrying at once:
    the successor may have switched past it, and the newer epoch's activation waits for this one."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"ws://127.0.0.1:{s.getsockname()[1]}/ring"
    hello = RingHello(protocol=PROTOCOL_VERSION, cluster="home", epoch=2, sender="stby")
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as session:
        with pytest.raises(PeerGone, match="not wanted any more"):
            await connect_with_retry(url, hello, session, None, LinkEmulation(), torch.float32, wanted=lambda: False)
    assert time.monotonic() - t0 < 1.0


class SlowLeaderNet(FakeNet):
    """The leader misses heartbeats for a while (busy, not gone); the standby, finding it there, does not lead."""

    def __init__(self):
        super().__init__()
        self.slow = True

    async def post(self, url, msg):
        self.posts.append((url, msg))
        if url == STANDBY.url:
            return Ack()  # a member: it does not lead
        if isinstance(msg, Hello):
            return Welcome(leader=LEADER, epoch=1)
        if self.slow:
            raise PeerGone(f"{url} unreachable: timeout")
        return Ack(epoch=1)

    async def fetch_info(self, host, port, timeout_s=1.0):
        self.probes.append(port)
        return None if self.slow else LEADER


async def test_a_member_rejoins_a_leader_it_found_lost_when_the_standby_does_not_take_over(monkeypatch):
    monkeypatch.setattr(membership, "HEARTBEAT_INTERVAL_S", 0.05)
    monkeypatch.setattr(membership, "HEARTBEAT_TIMEOUT_S", 0.2)
    monkeypatch.setattr(member_mod, "RECHECK_S", 0.1)
    net = SlowLeaderNet()
    m = MemberControl(OTHER, net=net, stage_host=FakeStageHost())
    m.peer_seen(LEADER)
    m.last_update = SimpleNamespace(leader=LEADER, standby=STANDBY.id, standby_info=STANDBY, members=(STANDBY, OTHER))
    task = await joined(m)
    try:
        async with asyncio.timeout(5):
            while not any(url == STANDBY.url for url, _ in net.posts):  # noqa: ASYNC110 - it turned to the standby
                await asyncio.sleep(0.01)
        assert m.leader is None
        net.slow = False  # the leader answers again
        async with asyncio.timeout(5):
            while m.leader is None:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        assert m.leader.id == LEADER.id
        assert LEADER.port in net.probes
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
