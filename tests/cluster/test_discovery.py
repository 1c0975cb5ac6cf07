"""Discovery on the loopback interface: agents of one cluster (and one key) find each other, others are ignored,
and a stopped agent's mDNS removal is reported. With a key, adverts are sealed: unproven, foreign or stale ones
are ignored (and logged once), a leadership claim counts only once the claimant confirms it, and so does a
removal. Static peers work without multicast."""

import asyncio
import contextlib
import itertools
import re

import pytest

from flowspec_p2p.cluster import discovery
from flowspec_p2p.cluster.control import PeerInfo
from flowspec_p2p.cluster.device import DeviceProfile
from flowspec_p2p.cluster.discovery import (
    Discovery,
    PeerLost,
    PeerSeen,
    from_properties,
    resolve_interfaces,
    to_properties,
)
from flowspec_p2p.cluster.handshake import AdvertSeal
from flowspec_p2p.cluster.keys import ClusterKey
from flowspec_p2p.errors import ConfigError

LOOPBACK = ["127.0.0.1"]
_ports = itertools.count(20000)


def peer(aid: str, cluster: str = "t", role: str = "member", identity: str = "") -> PeerInfo:
    return PeerInfo(id=aid, cluster=cluster, role=role, host="127.0.0.1", port=next(_ports), pid=1, started=1.5,
                    profile=DeviceProfile(memory_bytes=1 << 30, gflops=9.5, threads=2, link_mbps=100.0),
                    model="f" * 32, identity=identity)


@contextlib.asynccontextmanager
async def running(*discos):
    tasks = [asyncio.create_task(d.run()) for d in discos]
    try:
        await asyncio.wait_for(asyncio.gather(*(d.registered.wait() for d in discos)), 10)
        yield
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def next_event(q: asyncio.Queue, kind, wait_s: float = 8.0):
    async def loop():
        while True:
            ev = await q.get()
            if isinstance(ev, kind):
                return ev
    return await asyncio.wait_for(loop(), wait_s)


def test_txt_properties_round_trip():
    me = peer("abc", identity="e" * 64)
    props = {k.encode(): v.encode() for k, v in to_properties(me).items()}
    assert from_properties(props, me.host, me.port) == me


def test_interfaces_resolve_ips_and_names():
    assert resolve_interfaces(["127.0.0.1"]) == ["127.0.0.1"]
    assert resolve_interfaces(["lo"]) == ["127.0.0.1"]
    with pytest.raises(ConfigError, match="no network interface"):
        resolve_interfaces(["no-such-if0"])


async def test_agents_of_one_cluster_find_each_other_and_see_removal():
    qa, qb, qc, qd = (asyncio.Queue() for _ in range(4))
    a, b = peer("a"), peer("b")
    da = Discovery(a, qa, addresses=LOOPBACK, interfaces=LOOPBACK)
    db = Discovery(b, qb, addresses=LOOPBACK, interfaces=LOOPBACK)
    other_cluster = Discovery(peer("c", cluster="other"), qc, addresses=LOOPBACK, interfaces=LOOPBACK)
    keyed = Discovery(peer("d"), qd, addresses=LOOPBACK, interfaces=LOOPBACK, seal=AdvertSeal(ClusterKey.generate()))
    async with running(da, other_cluster, keyed):
        async with running(db):
            seen_by_a = await next_event(qa, PeerSeen)
            seen_by_b = await next_event(qb, PeerSeen)
            assert seen_by_a.info == b
            assert seen_by_a.via == "mdns"
            assert seen_by_b.info == a
            await asyncio.sleep(0.5)
        lost = await next_event(qa, PeerLost)
        assert lost.agent_id == "b"
        seen = set()
        while not qa.empty():
            ev = qa.get_nowait()
            if isinstance(ev, PeerSeen):
                seen.add(ev.info.id)
        assert seen <= {"b"}  # never the other cluster's, nor a keyed cluster's agent (a's is open)


class StaleSeal(AdvertSeal):
    """Seals as if its clock were an hour behind (a recorded advert, replayed)."""

    def seal(self, props, port, now):
        return super().seal(props, port, now - 3600)


async def test_sealed_adverts_are_found_and_unproven_foreign_or_stale_ones_ignored_and_logged_once(caplog):
    key = ClusterKey.generate()
    qa, qb, qx = asyncio.Queue(), asyncio.Queue(), asyncio.Queue()
    a, b = peer("a" * 24, identity="a" * 64), peer("b" * 24, identity="b" * 64)  # ids their identities prove
    da = Discovery(a, qa, addresses=LOOPBACK, interfaces=LOOPBACK, seal=AdvertSeal(key))
    db = Discovery(b, qb, addresses=LOOPBACK, interfaces=LOOPBACK, seal=AdvertSeal(key))
    other = AdvertSeal(ClusterKey.generate())
    strangers = [
        Discovery(peer("other-key"), qx, addresses=LOOPBACK, interfaces=LOOPBACK, seal=other),
        Discovery(peer("unsealed"), qx, addresses=LOOPBACK, interfaces=LOOPBACK),
        Discovery(peer("stale"), qx, addresses=LOOPBACK, interfaces=LOOPBACK, seal=StaleSeal(key)),
    ]
    async with running(da, db, *strangers):
        seen = await next_event(qa, PeerSeen)
        assert seen.info == b
        await asyncio.sleep(1.0)
        logged = sum("mDNS: ignoring" in r.message for r in caplog.records)
        for d in (db, *strangers):  # a re-seal re-announces: nothing new is let in, nothing is logged again
            await d.update(d.me)
        await asyncio.sleep(1.0)
        assert sum("mDNS: ignoring" in r.message for r in caplog.records) == logged
    ids = {ev.info.id for ev in _drain(qa) if isinstance(ev, PeerSeen)}
    assert ids == {"b" * 24}
    why = {name.split(".")[0]: reason for name, reason in da.ignored.items()}
    assert why.keys() == {"t-other-key", "t-unsealed", "t-stale"}
    assert "does not match" in why["t-other-key"]
    assert "no proof" in why["t-unsealed"]
    assert re.search(r"sealed 36\d\d s ago", why["t-stale"])


def _drain(q: asyncio.Queue) -> list:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


REAL, FORGED = "1" * 24, "2" * 24  # ids their identities ("1" * 64, "2" * 64) prove


async def test_leadership_claims_and_removals_count_only_when_the_claimant_confirms_them():
    key = ClusterKey.generate()
    real, forged = peer(REAL, role="leader", identity="1" * 64), peer(FORGED, role="leader", identity="2" * 64)
    asked = []

    async def confirm(claim: PeerInfo) -> PeerInfo | None:
        asked.append(claim.id)
        return claim if claim.id == REAL else None

    q = asyncio.Queue()
    me = Discovery(peer("m"), q, addresses=LOOPBACK, interfaces=LOOPBACK, seal=AdvertSeal(key), confirm=confirm)
    both = [Discovery(x, asyncio.Queue(), addresses=LOOPBACK, interfaces=LOOPBACK, seal=AdvertSeal(key))
            for x in (real, forged)]
    async with running(me):
        async with running(*both):
            ev = await next_event(q, PeerSeen)
            assert ev.info.id == REAL
            await asyncio.sleep(1.0)
        await asyncio.sleep(1.0)  # both are removed; "real" still confirms it is there, so it stays
    events = _drain(q)
    assert not [e for e in events if isinstance(e, PeerSeen) and e.info.id == FORGED]
    assert not [e for e in events if isinstance(e, PeerLost)]
    assert {REAL, FORGED} <= set(asked)


async def test_static_peers_work_without_multicast(monkeypatch):
    monkeypatch.setattr(discovery, "STATIC_POLL_INTERVAL_S", 0.05)
    leader = peer("lead", role="leader")
    asked = []

    async def fetch_info(host, port):
        asked.append((host, port))
        return leader if port == 9 else None

    q = asyncio.Queue()
    d = Discovery(peer("m"), q, addresses=LOOPBACK, mdns=False, static_peers=[("10.0.0.1", 9), ("10.0.0.2", 10)],
                  fetch_info=fetch_info)
    async with running(d):
        ev = await next_event(q, PeerSeen, wait_s=2)
    assert ev.info == leader
    assert ev.via == "static"
    assert ("10.0.0.2", 10) in asked


def test_default_addresses_leave_out_docker_vpn_loopback_and_link_local(monkeypatch):
    from types import SimpleNamespace as NS

    adapters = [NS(nice_name=n, name=n, ips=[NS(ip=ip)]) for n, ip in [
        ("lo", "127.0.0.1"), ("docker0", "172.17.0.1"), ("br-3f2a", "172.18.0.1"), ("tun0", "10.8.0.2"),
        ("wg0", "10.9.0.2"), ("eth0", "192.168.1.5"), ("wlan0", "169.254.3.4"), ("eth1", ("fe80::1", 0, 2))]]
    monkeypatch.setattr(discovery, "_adapters", lambda: adapters)
    monkeypatch.setattr(discovery, "bindable", lambda a: True)
    assert discovery.default_addresses() == ["192.168.1.5"]
    monkeypatch.setattr(discovery, "bindable", lambda a: False)  # never advertise what cannot be bound
    assert discovery.default_addresses() == ["127.0.0.1"]


async def test_a_flood_of_mdns_changes_starts_a_bounded_number_of_resolves_and_remembers_a_bounded_number(monkeypatch):
    from zeroconf import ServiceStateChange

    monkeypatch.setattr(discovery, "MAX_IGNORED", 4)
    d = Discovery(peer("me"), asyncio.Queue(), addresses=["127.0.0.1"], mdns=False)
    gate = asyncio.Event()
    started = []

    async def slow_resolve(name):
        started.append(name)
        await gate.wait()

    monkeypatch.setattr(d, "_resolve_one", slow_resolve)
    for i in range(discovery.MAX_RESOLVING * 3):
        for _ in range(3):  # the same name changing again starts no second task
            d._on_change(None, discovery.SERVICE_TYPE, f"n{i}.{discovery.SERVICE_TYPE}", ServiceStateChange.Updated)
    await asyncio.sleep(0)
    assert len(started) == len(d._tasks) == discovery.MAX_RESOLVING
    gate.set()
    await asyncio.gather(*d._tasks)
    assert not d._resolving
    for i in range(10):
        d._ignore(f"bad{i}", "malformed")
    assert list(d.ignored) == [f"bad{i}" for i in range(6, 10)]
