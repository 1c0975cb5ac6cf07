"""The stage an agent hosts: the control plane's handle on the data path (worker.py, transport.py) of one agent.

A re-plan reaches a stage in two phases (control.py), so the old pipeline keeps serving while the new ranges load:

    prepare(update)   phase 1: get the shard of this agent's range -- kept from the running epoch when unchanged,
                      else built from the agent's own model copy when its range fingerprint matches, else
                      fetched tensor by tensor from the leader (weight_server.py) -- then report "loaded"
    activate(epoch)   phase 2: retire the old worker and inbound links, start a StageWorker on the new shard,
                      open the link to the successor (retrying while the successor is still switching), report
                      "ready"; an agent the plan leaves out releases its shard instead
    release()         drop the worker and shard (the leader left, or the agent stops)

Every task is owned by ``run()``'s TaskGroup (the agent gives ``run`` to its own TaskGroup). Inbound and outbound
link failures pass through ``TapQueue`` so the control plane hears of them at once (a killed peer's sockets close
long before its heartbeats time out).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import psutil
import torch

from ..errors import ConfigError, FlowSpecError, PeerGone, ProtocolError
from ..model.dtypes import parse_dtype
from ..model.engine import Engine, Shard
from ..model.load import get_engine
from ..pipeline.codec import wire_dtype as wire_torch_dtype
from ..pipeline.emulation import Device, LinkEmulation
from ..pipeline.messages import PROTOCOL_VERSION
from ..pipeline.ring_server import RingServer
from ..pipeline.stage import StageCore
from ..pipeline.transport import (
    CLOSE_SHUTDOWN,
    RING_PATH,
    Inbox,
    Link,
    LinkDown,
    QueueSender,
    RingHello,
    Sender,
)
from ..pipeline.worker import StageWorker
from .control import PlanUpdate, RingNode, StageStatus
from .weight_server import fetch_range, stage_fingerprint

log = logging.getLogger(__name__)

LINK_RETRY_S = 0.05  # first pause between attempts to open the successor link (doubles, up to 1 s)
LINK_CONNECT_TIMEOUT_S = 15.0  # the successor must accept the new epoch within this
CLOSE_TIMEOUT_S = 1.0  # closing an inbound link does not wait longer for the peer's close frame
# worker and core counters that totals() sums over every epoch the agent served (stage_metrics.py)
SUMMED = ("compute_s", "busy_s", "frames_in", "frames_out", "dropped_out", "forwards", "tokens", "prunes", "errors",
          "sent_bytes", "engine_calls", "engine_rows", "batched_forwards", "reused")


class TapQueue(Inbox):
    """A stage's bounded inbox (transport.Inbox) that also shows every ``LinkDown`` it carries to ``tap`` (the
    control plane)."""

    def __init__(self, tap: Callable[[LinkDown], None]):
        super().__init__()
        self._tap = tap

    def put_nowait(self, item) -> None:
        if isinstance(item, LinkDown):
            self._tap(item)
        super().put_nowait(item)


@dataclass
class Prepared:
    epoch: int
    update: PlanUpdate
    node: RingNode | None  # None: this agent holds no layers in that plan
    shard: Shard | None
    source: str = ""
    load_s: float = 0.0
    fetched_bytes: int = 0

    @property
    def model(self) -> str:
        return self.update.model_fingerprint


@dataclass
class Active:
    epoch: int
    node: RingNode | None
    shard: Shard | None
    worker: StageWorker | None
    task: asyncio.Task | None
    model: str = ""


def ws_url(http_url: str) -> str:
    return "ws" + http_url.removeprefix("http") + RING_PATH


def _same_range(a: RingNode | None, b: RingNode | None) -> bool:
    return a is not None and b is not None and (a.layers, a.embed, a.head, a.fingerprint) == (
        b.layers, b.embed, b.head, b.fingerprint)


class StageHost:
    def __init__(
        self,
        *,
        agent_id: str,
        cluster: str,
        ring: RingServer,
        session: aiohttp.ClientSession,
        cache_dir: Path,
        cache_max_bytes: int | None = None,
        local_source=None,
        link: LinkEmulation | None = None,
        device: Callable[[], Device] = Device,
        tap: Callable[[LinkDown], None] = lambda ev: None,
        leader_inbox: asyncio.Queue | None = None,
    ):
        self.agent_id = agent_id
        self.cluster = cluster
        self.ring = ring
        self.session = session
        self.cache_dir = cache_dir
        self.cache_max_bytes = cache_max_bytes  # fetched tensors kept at most (weight_server.trim_cache)
        self.local_source = local_source
        self.link = link or LinkEmulation()
        self.device = device  # makes each new stage's device (an emulated one when the agent emulates one)
        self.tap = tap
        self.leader_inbox = leader_inbox  # set on the leader: its RingServer is the return path, not a stage inbox
        # (model fingerprint, shards) this agent holds outside any stage (the leader's head shard): a stage of that
        # model shares their tensors (the embedding) instead of loading them again
        self.shared: tuple[str, list[Shard]] = ("", [])
        self.prepared: Prepared | None = None
        self.active: Active | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._prepare_task: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._retired: Counter[str] = Counter()  # SUMMED counts of the workers of earlier epochs

    async def run(self) -> None:
        """Own the worker and loading tasks until cancelled; release everything on the way out."""
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                await asyncio.Event().wait()
        finally:
            self._tg = None
            await self._retire(self.active)
            self.active = None
            self.prepared = None

    # ------------------------------------------------------------------------------------------ phase 1

    def prepare(self, update: PlanUpdate, report: Callable[[StageStatus], object]) -> None:
        """Start loading this agent's range of ``update`` (a newer call cancels an older one's load);
        ``report`` gets the "loaded"/"failed" StageStatus (it may be a coroutine function)."""
        if self._tg is None:
            raise FlowSpecError("this agent's stage is stopping")
        if self._prepare_task is not None and not self._prepare_task.done():
            self._prepare_task.cancel()
        self._prepare_task = self._tg.create_task(self._prepare(update, report), name=f"prepare-{update.epoch}")

    async def _prepare(self, update: PlanUpdate, report) -> None:
        node = update.node(self.agent_id)
        t0 = time.perf_counter()
        try:
            prepared = await self._load(update, node)
            prepared.load_s = time.perf_counter() - t0
            self.prepared = prepared
            status = StageStatus(agent_id=self.agent_id, epoch=update.epoch, state="loaded", source=prepared.source,
                                 load_s=round(prepared.load_s, 3), fetched_bytes=prepared.fetched_bytes)
            if node is not None:
                log.info("epoch %d: layers %s ready to serve (%s, %.2f s, %.1f MB fetched)", update.epoch,
                         node.layers, prepared.source, prepared.load_s, prepared.fetched_bytes / 1e6)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.error("epoch %d: cannot load layers %s: %s: %s", update.epoch, node and node.layers,
                      type(e).__name__, e)
            status = StageStatus(agent_id=self.agent_id, epoch=update.epoch, state="failed", detail=str(e))
        try:  # the report goes to the leader: its fault (gone, refusing) is logged, never this agent's end
            result = report(status)
            if asyncio.iscoroutine(result):
                await result
        except (PeerGone, ProtocolError) as e:
            log.warning("epoch %d: could not report %s: %s", update.epoch, status.state, e)

    async def _load(self, update: PlanUpdate, node: RingNode | None) -> Prepared:
        if node is None:
            return Prepared(update.epoch, update, None, None, source="")
        engine = get_engine(update.engine, parse_dtype(update.dtype))  # the plan's: every stage runs the same one
        cfg = update.config
        kv_bytes = engine.kv_bytes_per_token(cfg) * len(node.layers) * update.context  # one request's K and V
        if kv_bytes * update.max_requests > psutil.virtual_memory().total:
            raise ConfigError(f"a KV capacity of {update.context} positions needs {kv_bytes / 2**20:.0f} MiB per "
                              f"request on layers {node.layers}, more than this device holds")
        for held in (self.active, self.prepared):
            if held is not None and held.shard is not None and _same_range(held.node, node) \
                    and held.shard.engine == engine:
                return Prepared(update.epoch, update, node, held.shard, source="kept")
        src, how, fetched = None, "local", 0
        if self.local_source is not None:
            local = self.local_source
            fp = await asyncio.to_thread(_fingerprint_or_empty, local, node)
            if fp == node.fingerprint:
                src = local
            else:
                log.warning("own model copy does not match the leader's layers %s; fetching them", node.layers)
        if src is None:
            src, fetched = await fetch_range(self.session, update.leader.url, node.layers, embed=node.embed,
                                             norm=node.head, cache_dir=self.cache_dir,
                                             expected_fingerprint=node.fingerprint,
                                             cache_max_bytes=self.cache_max_bytes)
            how = "fetched" if fetched else "cache"
        donors = [h.shard for h in (self.active, self.prepared)
                  if h is not None and h.shard is not None and h.model == update.model_fingerprint]
        if self.shared[0] == update.model_fingerprint:
            donors += self.shared[1]
        shard = await asyncio.to_thread(build_shard, src, node, engine, donors)
        return Prepared(update.epoch, update, node, shard, source=how, fetched_bytes=fetched)

    # ------------------------------------------------------------------------------------------ phase 2

    async def activate(self, epoch: int, *, leader_sender: Callable[[], Sender] | None = None) -> StageStatus:
        """Switch to ``epoch`` (prepared before). Returns the "ready" (or "failed"/"idle") status."""
        async with self._lock:
            p = self.prepared
            if p is None or p.epoch != epoch:
                return StageStatus(agent_id=self.agent_id, epoch=epoch, state="failed",
                                   detail=f"epoch {epoch} was not prepared here")
            old, self.active = self.active, None
            if self.leader_inbox is None:  # the old inbound links belong to the old worker
                self.ring.inbox = None
                await self.ring.set_epoch(epoch)
            await self._retire(old)
            if p.node is None:
                self.active = Active(epoch, None, None, None, None, model=p.model)
                log.info("epoch %d: this agent holds no layers", epoch)
                return StageStatus(agent_id=self.agent_id, epoch=epoch, state="idle")
            u, node = p.update, p.node
            index = [n.agent_id for n in u.ring].index(self.agent_id) + 1
            wire = wire_torch_dtype(u.wire_dtype)
            inbox = TapQueue(self.tap)
            # off the event loop: the requests' KV caches are made and touched here (GBs on a large model), and
            # heartbeats must go on meanwhile
            core = await asyncio.to_thread(StageCore, p.shard, index=index, capacity=u.context, wire_dtype=wire,
                                           caches=u.max_requests)
            worker = StageWorker(core, inbox=inbox, device=self.device(), name=f"stage{index}")
            if self.leader_inbox is None:
                pred = u.predecessor_id(self.agent_id)
                self.ring.allowed = lambda hello, pred=pred: hello.sender == pred
                self.ring.wire_dtype = u.wire_dtype
                self.ring.inbox = inbox
            assert self._tg is not None
            task = self._tg.create_task(self._guard(worker), name=f"worker-{epoch}")
            self.active = Active(epoch, node, p.shard, worker, task, model=p.model)
            try:
                succ = await self._successor(u, wire, inbox)
            except PeerGone as e:
                return StageStatus(agent_id=self.agent_id, epoch=epoch, state="failed", detail=str(e))
            await worker.set_successor(succ)
            log.info("epoch %d: stage %d (layers %s) running, sending to %s", epoch, index, node.layers, succ.peer)
            return StageStatus(agent_id=self.agent_id, epoch=epoch, state="ready", source=p.source,
                               load_s=round(p.load_s, 3), fetched_bytes=p.fetched_bytes)

    def local_sender(self) -> Sender | None:
        """An in-memory first hop into this agent's own worker (the leader as stage 1)."""
        a = self.active
        if a is None or a.worker is None:
            return None
        return QueueSender(a.worker.inbox, self.agent_id)

    async def _successor(self, u: PlanUpdate, wire: torch.dtype, events: asyncio.Queue) -> Sender:
        nxt = u.successor(self.agent_id)
        target = nxt.agent_id if isinstance(nxt, RingNode) else nxt.id
        if target == self.agent_id:  # the leader is the only stage: straight back into its own inbox
            assert self.leader_inbox is not None
            return QueueSender(self.leader_inbox, target)
        hello = RingHello(protocol=PROTOCOL_VERSION, cluster=self.cluster, epoch=u.epoch, sender=self.agent_id)
        return await connect_with_retry(ws_url(nxt.url), hello, self.session, events, self.link, wire,
                                        wanted=lambda: self.prepared is not None and self.prepared.epoch == u.epoch)

    async def release(self) -> None:
        async with self._lock:
            old, self.active, self.prepared = self.active, None, None
            if self.leader_inbox is None:
                self.ring.inbox = None
                for inbound in list(self.ring.links.values()):
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(CLOSE_TIMEOUT_S):
                            await inbound.ws.close(code=CLOSE_SHUTDOWN, message=b"stage released")
            await self._retire(old)

    async def _retire(self, a: Active | None) -> None:
        if a is None or a.task is None:
            return
        a.task.cancel()
        await asyncio.wait([a.task])  # never swallows a cancellation of the caller itself
        self._retired.update(_worker_counts(a.worker))

    async def _guard(self, worker: StageWorker) -> None:
        try:
            await worker.run()
        except asyncio.CancelledError:
            raise
        except Exception:  # a worker bug must not take the agent down; the leader sees the stage fail
            log.exception("%s stopped", worker.name)

    def snapshot(self) -> dict | None:
        a = self.active
        if a is None or a.worker is None:
            return None
        sent = _worker_counts(a.worker)["sent_bytes"]
        return {"epoch": a.epoch, **a.worker.snapshot(), "sent_bytes": sent, "cache_bytes": _cache_bytes(a.worker),
                "rss_bytes": psutil.Process().memory_info().rss}

    def totals(self) -> dict[str, float]:
        """The stage's SUMMED counters over every epoch this agent served, and the current stage's gauges
        (cache_bytes, open_requests, queued, stage)."""
        out = dict(self._retired)
        a = self.active
        if a is not None and a.worker is not None:
            for k, v in _worker_counts(a.worker).items():
                out[k] = out.get(k, 0.0) + v
            core = a.worker.core
            out.update(cache_bytes=_cache_bytes(a.worker), open_requests=len(core.requests),
                       queued=a.worker.inbox.qsize(), stage=core.index)
        return out


def _worker_counts(worker: StageWorker) -> dict[str, float]:
    c = {**worker.core.counters, **worker.counters}
    link = getattr(worker.successor, "counters", None)
    c["sent_bytes"] = link.bytes if link is not None else 0
    return {k: float(c.get(k, 0)) for k in SUMMED}


def _cache_bytes(worker: StageWorker) -> int:
    """Bytes of the tensors of every open request's K/V cache on this stage."""
    caches = [st.cache for st in list(worker.core.requests.values()) if st.cache is not None]
    return sum(t.nbytes for c in caches for t in vars(c).values() if isinstance(t, torch.Tensor))


async def connect_with_retry(url: str, hello: RingHello, session: aiohttp.ClientSession, events: asyncio.Queue | None,
                             link: LinkEmulation, wire: torch.dtype, *,
                             wanted: Callable[[], bool] = lambda: True) -> Link:
    """Open a ring link, retrying while the successor has not switched to ``hello.epoch`` yet -- and while
    ``wanted()``: a newer plan supersedes the epoch (its successor may have switched past it already)."""
    deadline = time.monotonic() + LINK_CONNECT_TIMEOUT_S
    pause = LINK_RETRY_S
    while True:
        try:
            return await Link.connect(url, hello, session=session, events=events, emulation=link, float_dtype=wire)
        except (PeerGone, ProtocolError) as e:
            if not wanted():
                raise PeerGone(f"the ring link to {url} for epoch {hello.epoch} is not wanted any more (a newer "
                               f"plan came): {e}") from e
            if time.monotonic() + pause > deadline:
                raise PeerGone(f"cannot open the ring link to {url} for epoch {hello.epoch}: {e}") from e
            await asyncio.sleep(pause)
            pause = min(1.0, pause * 2)


def _fingerprint_or_empty(source, node: RingNode) -> str:
    try:
        return stage_fingerprint(source, node.layers, embed=node.embed, norm=node.head)
    except FlowSpecError:
        return ""


def build_shard(source, node: RingNode, engine: Engine, donors: Sequence[Shard] = ()) -> Shard:
    """The shard of ``node`` on ``engine`` (``node.head``: it applies the final norm and returns features; it holds
    no LM head). Tensors a donor shard (this agent's running or prepared one, of the same model) already holds are
    shared, not loaded again: a re-plan that moves a range boundary loads only the layers that are new here.
    Weights are read-only at inference, so sharing is safe."""
    shard = engine.load(source, node.layers, embed=node.embed, head=node.head, lm_head=False, donors=donors,
                        progress=True)
    shard.warm_up()  # scratch buffers, the weights' pages and each tree size set up now, not at the first request
    return shard
