"""An N-stage pipeline in one process, on loopback websockets (port 0) or in-memory channels: the data path of a
cluster without its control plane. For tests and benchmarks (``flowspec bench-hop --pipeline``); the agent
wires the same pieces (RingServer, StageWorker, Link, Leader.set_pipeline) across processes.

    leader --Link--> stage 1 --Link--> ... stage N --Link--> leader's RingServer -> Leader.inbox

    async with LoopbackRing(shards, leader, hops="ws", wire_dtype=torch.float16) as ring:
        async for chunk in leader.generate(...): ...
"""

from __future__ import annotations

import asyncio
import logging

import torch
from aiohttp import web

from ..model.engine import Shard
from ..pipeline.emulation import NO_COMPUTE_EMULATION, NO_LINK_EMULATION, ComputeEmulation, LinkEmulation, device_for
from ..pipeline.messages import PROTOCOL_VERSION
from ..pipeline.ring_server import RingServer
from ..pipeline.stage import StageCore
from ..pipeline.transport import RING_PATH, Link, QueueSender, RingHello, Sender
from ..pipeline.worker import StageWorker
from .context import Pipeline
from .leader import Leader

log = logging.getLogger(__name__)


class LoopbackRing:
    """Stages ``shards[i]`` (index i + 1) feeding ``leader``. ``hops``: "ws" (real websockets on 127.0.0.1, port 0)
    or "memory" (QueueSenders that round-trip every frame through the codec). ``local_first``: the first stage
    runs "inside the leader" (an in-memory hop without the codec), as when the leader holds layers itself."""

    def __init__(self, shards: list[Shard], leader: Leader, *, hops: str = "ws", local_first: bool = False,
                 wire_dtype: torch.dtype = torch.float16, capacity: int | None = None,
                 link: LinkEmulation = NO_LINK_EMULATION, compute: ComputeEmulation = NO_COMPUTE_EMULATION,
                 cluster: str = "loopback", epoch: int = 0, run_leader: bool = True):
        assert hops in ("ws", "memory")
        self.leader = leader
        self.hops = hops
        self.local_first = local_first
        self.wire_dtype = wire_dtype
        self.link = link
        self.cluster = cluster
        self.epoch = epoch
        self.run_leader = run_leader  # False: someone else runs leader.run() (e.g. api.create_app)
        capacity = capacity or leader.settings.stage_capacity
        self.workers = [
            StageWorker(StageCore(s, index=i + 1, capacity=capacity, wire_dtype=wire_dtype), device=device_for(compute))
            for i, s in enumerate(shards)
        ]
        self.servers = [RingServer(f"stage{w.core.index}", cluster, epoch=epoch, inbox=w.inbox) for w in self.workers]
        self.servers.append(RingServer("leader", cluster, epoch=epoch, inbox=leader.inbox))
        self.runners: list[web.AppRunner] = []
        self.urls: list[str] = []
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: list[asyncio.Task] = []

    async def _serve(self, server: RingServer) -> str:
        app = web.Application()
        server.install(app)
        runner = web.AppRunner(app, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.runners.append(runner)
        port = runner.addresses[0][1]
        return f"ws://127.0.0.1:{port}{RING_PATH}"

    async def _hop(self, sender_id: str, index: int, events: asyncio.Queue | None) -> Sender:
        """A sender into ring position ``index`` (0..N-1 stages, N the leader)."""
        inbox = self.servers[index].inbox
        if self.hops == "memory":
            return QueueSender(inbox, self.servers[index].agent_id, roundtrip=True)
        hello = RingHello(protocol=PROTOCOL_VERSION, cluster=self.cluster, epoch=self.epoch, sender=sender_id)
        return await Link.connect(self.urls[index], hello, events=events, emulation=self.link)

    async def __aenter__(self) -> LoopbackRing:
        if self.hops == "ws":
            self.urls = [await self._serve(s) for s in self.servers]
        n = len(self.workers)
        for i, w in enumerate(self.workers):
            await w.set_successor(await self._hop(w.name, i + 1, w.inbox))
        if self.local_first and n:
            first: Sender = QueueSender(self.workers[0].inbox, "stage1")
        else:
            first = await self._hop("leader", 0, self.leader.inbox)
        takes = "tokens" if not n or self.workers[0].core.shard.has_embed else "hidden"
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        for w in self.workers:
            self._tasks.append(self._tg.create_task(w.run(), name=w.name))
        if self.run_leader:
            self._tasks.append(self._tg.create_task(self.leader.run(), name="leader"))
        await self.leader.set_pipeline(Pipeline(first, takes=takes, epoch=self.epoch, stages=n,
                                                info={"hops": self.hops, "emulation": self.link.describe()}))
        return self

    async def stop_stage(self, index: int) -> None:
        """Make stage ``index`` (1-based) vanish: its worker stops and its links close (tests)."""
        task = self._tasks[index - 1]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for link in list(self.servers[index - 1].links.values()):
            await link.ws.close()

    async def __aexit__(self, *exc) -> None:
        for t in self._tasks:
            t.cancel()
        try:
            if self._tg is not None:
                await self._tg.__aexit__(None, None, None)
        finally:
            for r in self.runners:
                await r.cleanup()
