"""A member's control loop against a fake network (no sockets): how it finds its leader lost and who takes over."""

import asyncio
from types import SimpleNamespace

from flowspec_p2p.cluster import membership
from flowspec_p2p.cluster.control import Ack, Hello, PeerInfo, Welcome
from flowspec_p2p.cluster.device import DeviceProfile
from flowspec_p2p.cluster.member import MemberControl

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
                      on_takeover=lambda u: took_over.append(u) or True)
    m.peer_seen(LEADER)
    m.last_update = SimpleNamespace(leader=LEADER, standby=STANDBY.id, standby_info=STANDBY,
                                    members=(STANDBY, OTHER))
    return m


async def test_the_standby_probes_its_leader_when_a_member_says_it_is_lost(monkeypatch):
    """A member that found the leader gone tells the standby (Hello); the standby, whose own links may not touch
    the leader, probes it at once instead of waiting for its heartbeats to fail."""
    monkeypatch.setattr(membership, "HEARTBEAT_INTERVAL_S", 30.0)
    net, took_over = FakeNet(), []
    m = standby_member(net, took_over)
    task = asyncio.create_task(m.run())
    try:
        async with asyncio.timeout(5):
            while m.leader is None:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        await m.handle(Hello(peer=info("stranger", port=4009)))  # not of the plan: no probe
        await asyncio.sleep(0.1)
        assert net.probes == []
        await m.handle(Hello(peer=OTHER))
        async with asyncio.timeout(2):
            while not took_over:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        assert net.probes == [LEADER.port]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
