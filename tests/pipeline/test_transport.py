"""Websocket ring links on loopback (port 0): handshake, order, refusals, bad frames, emulation, dead peers."""

import asyncio
import logging
import time

import aiohttp
import pytest
import torch
from aiohttp import web

from flowspec_p2p.errors import PeerGone, ProtocolError
from flowspec_p2p.pipeline import codec
from flowspec_p2p.pipeline.emulation import LinkEmulation
from flowspec_p2p.pipeline.messages import PROTOCOL_VERSION, Forward, Prune
from flowspec_p2p.pipeline.ring_server import RingServer
from flowspec_p2p.pipeline.transport import (
    CLOSE_BAD_FRAME,
    CLOSE_REFUSED,
    CLOSE_STALE_EPOCH,
    Frame,
    Link,
    LinkDown,
    QueueSender,
    RingHello,
)


async def health(request):
    return web.json_response({"ok": True})


class Agent:
    """An aiohttp app with a /ring endpoint and a /health route, on 127.0.0.1 port 0."""

    def __init__(self, server: RingServer):
        self.server = server
        self.runner: web.AppRunner | None = None

    async def __aenter__(self):
        app = web.Application()
        self.server.install(app)
        app.router.add_get("/health", health)
        self.runner = web.AppRunner(app, handle_signals=False)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        port = self.runner.addresses[0][1]
        self.base = f"http://127.0.0.1:{port}"
        self.url = f"ws://127.0.0.1:{port}/ring"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


def hello(**kw):
    return RingHello(**{"protocol": PROTOCOL_VERSION, "cluster": "home", "epoch": 3, "sender": "a1", **kw})


def prune(seq):
    return Prune(request_id="r", seq=seq, accept=0, keep=[])


async def next_event(q: asyncio.Queue, wait_s=3.0):
    async with asyncio.timeout(wait_s):
        return await q.get()


async def test_frames_arrive_in_order_with_their_tensors_and_link_end_is_reported():
    inbox = asyncio.Queue()
    async with Agent(RingServer("b2", "home", epoch=3, inbox=inbox)) as agent:
        link = await Link.connect(agent.url, hello())
        assert link.peer == "b2"
        fwd = Forward(request_id="r", seq=0, first=0, parents=[-1, 0], positions=[4, 5])
        await link.send(fwd, {"hidden": torch.arange(8.0).view(2, 4)})
        for seq in range(1, 40):
            await link.send(prune(seq))
        first = await next_event(inbox)
        assert isinstance(first, Frame)
        assert first.peer == "a1"
        assert first.msg.parents == [-1, 0]
        assert torch.equal(first.tensors["hidden"], torch.arange(8.0).view(2, 4))
        seqs = [(await next_event(inbox)).msg.seq for _ in range(39)]
        assert seqs == list(range(1, 40))
        assert agent.server.snapshot()[0]["frames"] == 40
        await link.close()
        down = await next_event(inbox)
        assert isinstance(down, LinkDown)
        assert down.direction == "in"
        assert down.link == first.link
        assert down.epoch == 3


@pytest.mark.parametrize(("kw", "code", "reason"), [
    ({"cluster": "factory"}, CLOSE_REFUSED, "cluster 'factory'"),
    ({"protocol": PROTOCOL_VERSION + 1}, CLOSE_REFUSED, "protocol"),
    ({"epoch": 2}, CLOSE_STALE_EPOCH, "plan epoch 2 is not the current epoch 3"),
    ({"epoch": 9}, CLOSE_STALE_EPOCH, "plan epoch 9"),
    ({"sender": "intruder"}, CLOSE_REFUSED, "planned predecessor"),
])
async def test_handshake_refuses_other_clusters_protocols_senders_and_stale_epochs(kw, code, reason):
    server = RingServer("b2", "home", epoch=3, inbox=asyncio.Queue(), allowed=lambda h: h.sender == "a1")
    async with Agent(server) as agent:
        with pytest.raises(ProtocolError, match=f"code {code}.*{reason}"):
            await Link.connect(agent.url, hello(**kw))
        assert server.refused == 1
        assert server.inbox.empty()


async def test_a_new_plan_epoch_retires_older_links():
    inbox, events = asyncio.Queue(), asyncio.Queue()
    async with Agent(RingServer("b2", "home", epoch=3, inbox=inbox)) as agent:
        link = await Link.connect(agent.url, hello(), events=events)
        await agent.server.set_epoch(4)
        down = await next_event(events)
        assert isinstance(down, LinkDown)
        assert down.direction == "out"
        assert f"code {CLOSE_STALE_EPOCH}" in down.reason
        with pytest.raises(PeerGone):
            await link.send(prune(0))
        assert isinstance(await next_event(inbox), LinkDown)
        await (await Link.connect(agent.url, hello(epoch=4))).close()
        await link.close()


@pytest.mark.parametrize("garbage", [b"\x00garbage", codec.MAGIC + b"\xff\xff\xff\x7f", "a text frame"])
async def test_garbage_frames_close_that_link_with_a_logged_reason_and_the_agent_keeps_serving(garbage, caplog):
    inbox = asyncio.Queue()
    async with Agent(RingServer("b2", "home", epoch=3, inbox=inbox)) as agent, aiohttp.ClientSession() as s:
        ws = await s.ws_connect(agent.url)
        await ws.send_str(hello().model_dump_json())
        assert (await ws.receive()).type == aiohttp.WSMsgType.TEXT  # welcome
        with caplog.at_level(logging.WARNING, logger="flowspec_p2p.pipeline.transport"):
            await ws.send_bytes(garbage) if isinstance(garbage, bytes) else await ws.send_str(garbage)
            msg = await ws.receive(timeout=3)
            assert msg.type == aiohttp.WSMsgType.CLOSE
            assert msg.data == CLOSE_BAD_FRAME
            down = await next_event(inbox)
        assert isinstance(down, LinkDown)
        assert down.reason.startswith("bad frame")
        assert "closing the link from a1: bad frame" in caplog.text
        assert agent.server.bad_frames == 1
        async with s.get(agent.base + "/health") as r:
            assert r.status == 200
        link = await Link.connect(agent.url, hello())  # a well-behaved peer still gets in
        await link.send(prune(0))
        assert isinstance(await next_event(inbox), Frame)
        await link.close()


async def test_a_hello_that_is_not_json_is_refused():
    async with Agent(RingServer("b2", "home", inbox=asyncio.Queue())) as agent, aiohttp.ClientSession() as s:
        ws = await s.ws_connect(agent.url)
        await ws.send_bytes(b"\x00\x01")
        msg = await ws.receive(timeout=3)
        assert msg.type == aiohttp.WSMsgType.CLOSE
        assert msg.data == CLOSE_REFUSED


async def test_emulated_link_delays_frames_by_serialisation_and_latency_in_order():
    inbox = asyncio.Queue()
    emu = LinkEmulation(bandwidth_mbps=8.0, latency_ms=40.0)
    async with Agent(RingServer("b2", "home", epoch=3, inbox=inbox)) as agent:
        link = await Link.connect(agent.url, hello(), emulation=emu)
        hidden = torch.zeros(1, 1250, dtype=torch.float64)  # 10 kB: 10 ms at 8 Mbit/s
        t0 = time.time()
        for seq in range(5):
            await link.send(Forward(request_id="r", seq=seq, first=0, parents=[-1], positions=[0]),
                            {"hidden": hidden})
        assert time.time() - t0 < 0.045  # sending does not block (blocking: >= 5 x 10 ms on the wire alone)
        frames = [await next_event(inbox) for _ in range(5)]
        assert [f.msg.seq for f in frames] == list(range(5))
        size = link.counters.bytes / 5
        for i, f in enumerate(frames):  # lower bounds only: a loaded machine may add delay, never remove it
            assert f.received_at - t0 >= (i + 1) * size * 8 / 8e6 + 0.040 - 0.002
        await link.close()


async def test_a_dead_peer_is_reported_and_sending_raises_peer_gone():
    events = asyncio.Queue()
    agent = Agent(RingServer("b2", "home", epoch=3, inbox=asyncio.Queue()))
    await agent.__aenter__()
    link = await Link.connect(agent.url, hello(), events=events)
    await agent.__aexit__(None, None, None)  # the peer's agent stops
    down = await next_event(events)
    assert isinstance(down, LinkDown)
    assert down.peer == "b2"
    with pytest.raises(PeerGone, match="link to b2 is down"):
        await link.send(prune(0))
    await link.close()
    with pytest.raises(PeerGone, match="cannot open a link"):
        await Link.connect(agent.url, hello(), timeout_s=1)


async def test_queue_sender_round_trips_through_the_codec():
    q = asyncio.Queue()
    sender = QueueSender(q, "b2", roundtrip=True, float_dtype=torch.float16)
    await sender.send(Forward(request_id="r", seq=0, first=0, parents=[-1], positions=[0]),
                      {"hidden": torch.ones(1, 4, dtype=torch.float64)})
    frame = q.get_nowait()
    assert frame.tensors["hidden"].dtype == torch.float16
    assert frame.msg.tensors[0].dtype == "float16"
    await sender.close()
    with pytest.raises(PeerGone):
        await sender.send(prune(1))


async def test_bench_hop_times_a_real_loopback_hop():
    from flowspec_p2p.bench.hop import bench_hop

    r = await bench_hop(tokens=16, hidden=576, dtype="float16", iters=20, warmup=5)
    assert r["frame_bytes"] > 16 * 576 * 2
    assert 0 < r["median_ms"] <= r["p90_ms"]


async def test_bench_hop_times_tls_hops_beside_plain_ones():
    from flowspec_p2p.bench.hop import bench_hops

    ws, wss = await bench_hops(tokens=16, hidden=64, dtype="float16", iters=20, warmup=5)
    assert (ws["transport"], wss["transport"]) == ("ws", "wss")
    assert ws["frame_bytes"] == wss["frame_bytes"]
    assert 0 < wss["median_ms"] <= wss["p90_ms"]
