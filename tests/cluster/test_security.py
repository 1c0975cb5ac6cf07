"""Attacks on a keyed cluster: a leader and a member serving on loopback (one process, tiny float64 model), and
attackers beside them. A stranger without the key reads nothing (info, timeline, manifest, tensor) and forges
nothing (Hello, Bye, plan, activation, ring link): every try is a 401 that says nothing. A holder of the key cannot
speak for another agent. A wrong certificate behind a member's address is refused. Forged and replayed "older
leader" adverts change nothing. After every attack the cluster serves as before, with the same greedy output."""

import asyncio
import socket
import time

import aiohttp
import pytest
from aiohttp import web
from zeroconf import IPVersion
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from flowspec_p2p.agent import Agent
from flowspec_p2p.cluster.control import (
    CONTROL_PATH,
    INFO_PATH,
    TIMELINE_PATH,
    Activate,
    Bye,
    Heartbeat,
    Hello,
    encode_message,
)
from flowspec_p2p.cluster.discovery import SERVICE_TYPE, to_properties
from flowspec_p2p.cluster.guard import REFUSAL, Guard
from flowspec_p2p.cluster.handshake import AdvertSeal
from flowspec_p2p.cluster.identity import Identity, client_context
from flowspec_p2p.cluster.keys import ClusterKey
from flowspec_p2p.cluster.pinning import AuthClient
from flowspec_p2p.cluster.stage_host import ws_url
from flowspec_p2p.errors import PeerGone, ProtocolError
from flowspec_p2p.pipeline.messages import PROTOCOL_VERSION
from flowspec_p2p.pipeline.transport import CLOSE_REFUSED, Link, RingHello

from ..agent_fixtures import complete, make_fixture, parts_fixture, quick_timing_fixture, running, serving, start, until
from ..ring_fixtures import ByteTokenizer

__all__ = ["make_fixture", "parts_fixture", "quick_timing_fixture"]

PROMPT = ByteTokenizer().encode("attack")


def two_stages(make):
    leader = Agent(make("lead", leader=True, planning={"context": 128, "stages": 2, "leader_layers": "always"}),
                   tokenizer=ByteTokenizer())
    return leader, Agent(make("m"))


async def still_serving(leader: Agent, member: Agent, epoch: int, parts) -> None:
    """The attacks changed nothing: same epoch, same member, same greedy output."""
    assert leader.coordinator.update.epoch == epoch
    assert member.id in leader.coordinator.membership.members
    assert member.member.latest_update.epoch == epoch
    data = await complete(leader, [1, *PROMPT], 6)
    assert data["choices"][0]["text"] == ByteTokenizer().decode(parts.reference(PROMPT, 6))


async def test_a_stranger_without_the_key_reads_nothing_and_forges_nothing(make, parts):
    leader, member = two_stages(make)
    async with running(leader, member):
        await until(serving(leader, 1))
        epoch = leader.coordinator.update.epoch
        lead, mem = leader.info.url, member.info.url
        reads = [lead + INFO_PATH, lead + TIMELINE_PATH, mem + INFO_PATH, mem + TIMELINE_PATH,
                 lead + "/weights/manifest?start=0&end=1&embed=1&norm=0", lead + "/weights/tensor/model.norm.weight"]
        plan = leader.coordinator.update.model_copy(update={"epoch": epoch + 1})
        hello = Hello(peer=member.info.model_copy(update={"id": "stranger"}))
        forged = [(lead, hello), (lead, Bye(agent_id=member.id)), (mem, plan), (mem, Activate(epoch=epoch + 1)),
                  (mem, Bye(agent_id=leader.id))]
        connector = aiohttp.TCPConnector(ssl=client_context())
        async with aiohttp.ClientSession(connector=connector) as http:
            for url in reads:
                async with http.get(url) as r:
                    assert (r.status, await r.text()) == (401, REFUSAL), url
            for url, msg in forged:
                async with http.post(url + CONTROL_PATH, data=encode_message(msg)) as r:
                    assert (r.status, await r.text()) == (401, REFUSAL), msg.kind
            for url in (lead, mem):
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await http.ws_connect(ws_url(url))
                assert refused.value.status == 401
        async with aiohttp.ClientSession() as http:  # plain http: the agent port speaks TLS only
            with pytest.raises(aiohttp.ClientError):
                await http.get(lead.replace("https", "http") + INFO_PATH)
        with pytest.raises(ProtocolError, match="does not hold this cluster's key"):  # another key's client
            async with AuthClient(ClusterKey.generate(), Identity.generate()).open() as http:
                await http.get(lead + INFO_PATH)
        assert leader.security.guard.refused >= len(reads) // 2
        await still_serving(leader, member, epoch, parts)


async def test_a_holder_of_the_key_cannot_speak_for_another_agent(make, parts, caplog):
    leader, member = two_stages(make)
    async with running(leader, member) as tasks:
        await until(serving(leader, 1))
        epoch = leader.coordinator.update.epoch
        lead, mem = leader.info.url, member.info.url
        insider = AuthClient(leader.security.key, Identity.generate())
        me = member.info.model_copy(update={"id": insider.agent_id, "identity": insider.identity.fingerprint})
        update = leader.coordinator.update
        forged = [(lead, Bye(agent_id=member.id)), (lead, Heartbeat(agent_id=member.id, epoch=epoch, state="idle")),
                  (lead, Hello(peer=member.info)),  # its id and identity, not ours
                  (mem, update.model_copy(update={"epoch": epoch + 1})),  # a plan naming the leader
                  (mem, update.model_copy(update={"epoch": epoch + 1, "leader": me})),  # naming ourselves
                  (mem, Activate(epoch=epoch + 1)), (mem, Bye(agent_id=leader.id)), (mem, Bye(agent_id=me.id))]
        async with insider.open() as http:
            for url, msg in forged:
                async with http.post(url + CONTROL_PATH, data=encode_message(msg)) as r:
                    assert r.status == 403, (msg.kind, await r.text())
            for sender in (leader.id, insider.agent_id):  # the member's planned predecessor is the leader
                hello = RingHello(protocol=PROTOCOL_VERSION, cluster=leader.cfg.cluster, epoch=epoch, sender=sender)
                with pytest.raises(ProtocolError, match=f"code {CLOSE_REFUSED}"):
                    await Link.connect(ws_url(mem), hello, session=http)
        for victim in (leader, member):  # claiming another agent's id: the handshake itself is refused
            for url in (lead, mem):
                posing = AuthClient(leader.security.key, Identity.generate(), victim.id)
                with pytest.raises(ProtocolError, match="refused this agent's proof"):
                    async with posing.open() as http:
                        await http.get(url + INFO_PATH)
        assert f"claims agent id {leader.id}" in caplog.text
        assert f"claims agent id {member.id}" in caplog.text
        assert not any(t.done() for t in tasks.values())
        await still_serving(leader, member, epoch, parts)


async def test_an_older_leader_claim_neither_ends_the_leader_nor_takes_a_member_that_was_given_its_leader(
        make, parts, caplog):
    """A holder of the key starts an older leader of the cluster (its claim is real: sealed, confirmed). The
    leader keeps serving, and a member told its leader's identity ($FLOWSPEC_LEADER_IDENTITY) never joins the
    impostor."""
    impostor = Agent(make("impostor", leader=True), tokenizer=ByteTokenizer())
    leader = Agent(make("lead", leader=True), tokenizer=ByteTokenizer())
    async with running(impostor) as tasks:
        await until(lambda: impostor.started.is_set())
        await start(tasks, leader)
        await until(lambda: leader.started.is_set())
        member = Agent(make("m", leader_identity=leader.security.fingerprint))
        await start(tasks, member)
        await until(serving(leader, 1))
        await until(lambda: f"another leader of cluster {leader.cfg.cluster!r} claims to lead: agent {impostor.id}"
                    in caplog.text)
        assert impostor.info.started < leader.info.started
        assert member.member.leader.id == leader.id
        assert not impostor.coordinator.membership.members
        assert not any(t.done() for t in tasks.values())
        await still_serving(leader, member, leader.coordinator.update.epoch, parts)
        member.stop()
        leader.stop()
    assert f"ignoring leader {impostor.id}" in caplog.text


async def test_a_wrong_certificate_behind_a_members_address_is_refused(make):
    leader, member = two_stages(make)
    async with running(leader, member) as tasks:
        await until(serving(leader, 1))
        info = member.info
        member.stop()
        await asyncio.wait_for(tasks[member], 15)
        impostor = Guard(leader.security.key, Identity.load_or_create(make("x").state_path), "impostor")
        app = web.Application(middlewares=[impostor.middleware])
        impostor.install(app)
        served = []

        async def control(request: web.Request) -> web.Response:
            served.append(request)
            return web.Response(status=500)

        app.router.add_post(CONTROL_PATH, control)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:  # it holds the key even; only its certificate differs
            await web.TCPSite(runner, info.host, info.port, ssl_context=impostor.identity.server_context()).start()
            with pytest.raises((ProtocolError, PeerGone), match="presents certificate"):
                await leader.post(info.url, Bye(agent_id=leader.id))
        finally:
            await runner.cleanup()
        assert not served
        assert impostor.refused == 0  # not even the handshake reached it


async def register(zc: AsyncZeroconf, name: str, port: int, props: dict[str, str]) -> AsyncServiceInfo:
    svc = AsyncServiceInfo(SERVICE_TYPE, f"{name}.{SERVICE_TYPE}", port=port, properties=props,
                           addresses=[socket.inet_aton("127.0.0.1")], server=f"{name}.local.")
    await zc.async_register_service(svc)
    return svc


async def test_forged_and_replayed_older_leader_adverts_change_nothing(make, caplog):
    old = Agent(make("old", leader=True), tokenizer=ByteTokenizer())
    async with running(old):
        await until(lambda: old.started.is_set())
        sealed = AdvertSeal(old.security.key).seal(to_properties(old.info), old.info.port, time.time())
        port = old.info.port
    # the old leader is gone; its advert (a valid seal, recorded minutes ago) is replayed beside a forgery that
    # copies the seal onto an even older start time under another id
    forged = {**sealed, "id": "forged", "st": "0.0"}
    leader, member = Agent(make("new", leader=True), tokenizer=ByteTokenizer()), Agent(make("m"))
    zc = AsyncZeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    try:
        async with running(leader, member) as tasks:
            await until(lambda: leader.started.is_set())
            fakes = [await register(zc, f"{old.cfg.cluster}-replayed", port, sealed),
                     await register(zc, f"{old.cfg.cluster}-forged", port, forged)]
            await until(serving(leader, 1))  # the member joined the real (younger) leader
            await asyncio.sleep(1.0)
            assert not tasks[leader].done()
            assert member.member.leader.id == leader.id
            for svc in fakes:
                await zc.async_unregister_service(svc)
    finally:
        await zc.async_close()
    log = "\n".join(r.message for r in caplog.records)
    assert "-replayed" in log
    assert "did not confirm its leadership claim" in log
    assert "-forged" in log
    assert "does not match" in log


async def test_cluster_up_gives_its_agents_a_fresh_key_and_reads_their_timelines_with_it(make, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from flowspec_p2p.cluster.local_cluster import ClusterOptions, LocalCluster

    monkeypatch.setenv("FLOWSPEC_SECRET", "a stale secret in the shell")
    keyed = LocalCluster(1, ClusterOptions(state_root=tmp_path / "c"))
    environ = keyed.agent_environment()
    assert ClusterKey.parse(environ["FLOWSPEC_CLUSTER_KEY"]) == keyed.key
    assert "FLOWSPEC_SECRET" not in environ
    open_cluster = LocalCluster(2, ClusterOptions(state_root=tmp_path / "o", insecure=True))
    assert "FLOWSPEC_CLUSTER_KEY" not in open_cluster.agent_environment()
    assert all("--insecure" in a.args for a in open_cluster.agents)

    agent = Agent(make("agent0", leader=True, cluster_key=keyed.key.text, state_dir=keyed.agents[0].state_dir),
                  tokenizer=ByteTokenizer())
    keyed.agents[0].popen = SimpleNamespace(poll=lambda: None, pid=0)  # "alive": the agent runs in this process
    async with running(agent):
        await until(lambda: agent.started.is_set())
        [timeline] = await keyed._timelines(None)
        assert timeline["agent_id"] == agent.id
        stranger = LocalCluster(1, ClusterOptions(state_root=tmp_path / "s"))  # another key
        stranger.agents = keyed.agents
        with pytest.raises(ProtocolError):
            await stranger._timelines(None)
