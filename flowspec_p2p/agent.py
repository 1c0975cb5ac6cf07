"""The agent, one per device: the composition root. ``Agent(cfg).run()`` owns everything in one TaskGroup.

    discovery (mDNS + static peers) --events--> membership (cluster.apply) --debounced--> planner.plan
         leader: PlanUpdate to members ---------> StageHost.prepare (load / fetch weights) --"loaded"--+
         leader: Activate once all loaded <------------------------------------------------------------+
                 StageHost.activate (worker + ring links) --"ready"--> Leader.set_pipeline(new ring)
    leader also: weight server, the Leader (decoding modes) and its OpenAI-compatible API (api.py)

Roles. The leader (``--leader``) plans, serves weights and the API; every other agent is a member that joins the
oldest leader of its cluster, heartbeats to it and hosts whatever stage the plan gives it. A second leader of the
same cluster stops at start with a clear message (the older one wins; ties by id).

Re-planning (leader). A join, a graceful stop (Bye), an mDNS removal, missed heartbeats, a member that failed to
load, or a ring link that broke (the peer is probed at once) changes the membership; ``REPLAN_DEBOUNCE_S`` later
the planner runs. An unchanged layout keeps the running pipeline. Otherwise a new *epoch* starts in two phases:
members load their new ranges while the old pipeline (if intact) keeps serving; once all have loaded, the request
in flight may finish (at most ``DRAIN_TIMEOUT_S``), the leader switches every stage at once and installs the new
ring. Requests that arrive while no pipeline is ready wait (``LeaderSettings.ready_timeout_s``) and then get 503
with Retry-After; a request whose stage vanished ends with PeerGone (api.py: 503) and never hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import torch
from aiohttp import web

from . import cluster as membership_mod
from .cluster import Heard, Joined, Left, Membership, Planned, Tick
from .config import AgentConfig, split_host_port
from .control import (
    AUTH_HEADER,
    CONTROL_PATH,
    INFO_PATH,
    MAX_CONTROL_BYTES,
    TIMELINE_PATH,
    Ack,
    Activate,
    Bye,
    Heartbeat,
    Hello,
    PeerInfo,
    PlanUpdate,
    Refused,
    RingNode,
    StageStatus,
    Welcome,
    auth_tag,
    decode,
    encode,
    sign,
    verify,
)
from .discovery import Discovery, PeerLost, PeerSeen, bindable, default_addresses, resolve_interfaces
from .emulation import ComputeEmulation, LinkEmulation
from .errors import ConfigError, FlowSpecError, PeerGone, PlanInfeasible, ProtocolError
from .messages import PROTOCOL_VERSION
from .planner import Plan, PlanOptions, describe_model, render
from .profile import DeviceProfile, measure
from .stage_host import StageHost, TapQueue, connect_with_retry, ws_url
from .transport import Hello as RingHello
from .transport import LinkDown, RingServer
from .types import LayerRange

log = logging.getLogger(__name__)

LEADER_PROBE_S = 1.5  # a new leader listens this long for an older leader of its cluster before it plans
INITIAL_PLAN_DELAY_S = 2.5  # the first plan waits for agents started at the same time
TICK_S = 0.1  # the leader's membership clock
CONTROL_TIMEOUT_S = 3.0
PROBE_TIMEOUT_S = 1.0  # a peer whose ring link broke must answer GET /control/info within this
LOAD_TIMEOUT_S = 300.0  # phase 1: a member that has not loaded its range by then is left out
ACTIVATE_TIMEOUT_S = 30.0  # phase 2: a member that has not opened its links by then is left out
DRAIN_TIMEOUT_S = 20.0  # a join lets the request in flight finish for at most this long before switching
BYE_TIMEOUT_S = 1.5
SHUTDOWN_TIMEOUT_S = 2.0  # open HTTP handlers (ring links, streamed responses) get this long to end
STATE_FILE = "agent.json"


class _Stopped(Exception):
    """Raised inside the TaskGroup to end it after stop()."""


@dataclass
class Transition:
    """A re-plan in progress (see the module docstring)."""

    update: PlanUpdate
    trigger: str
    started: float
    ring: set[str]  # agent ids holding layers in the new plan
    deadline: float  # of the current phase
    starts: dict[str, float]  # PeerInfo.started of each ring member: a restarted member breaks the ring
    loaded: set[str] = field(default_factory=set)
    ready: set[str] = field(default_factory=set)
    phase: str = "prepare"

    @property
    def epoch(self) -> int:
        return self.update.epoch


class Agent:
    def __init__(self, cfg: AgentConfig, *, profile: DeviceProfile | None = None, tokenizer=None):
        """``profile`` replaces the start-up measurement and ``tokenizer`` the model's own (tests)."""
        self.cfg = cfg
        self._tokenizer = tokenizer
        self.secret = cfg.secret_bytes
        self._profile = profile
        self.id = ""
        self.info: PeerInfo | None = None
        self.api_url: str | None = None
        self.started = asyncio.Event()  # the agent server and discovery run
        self.serving = asyncio.Event()  # (leader) a pipeline is installed
        self._stop = asyncio.Event()
        self._tg: asyncio.TaskGroup | None = None
        self._events: asyncio.Queue = asyncio.Queue()
        self.source = None
        self.session: aiohttp.ClientSession | None = None
        self.ring: RingServer | None = None
        self.stage_host: StageHost | None = None
        # leader state
        self.leader = None
        self.weights = None
        self.model_spec = None
        self.model_fp = ""
        self.membership: Membership | None = None
        self.plan: Plan | None = None
        self.update: PlanUpdate | None = None  # of the serving epoch
        self.epoch = 0  # last epoch started
        self.transition: Transition | None = None
        self.planning = False
        self.broken: str | None = None  # why the serving pipeline is unusable
        self.recoveries: list[dict] = []
        self.ring_starts: dict[str, float] = {}
        self._broken_at = 0.0
        self.statuses: dict[str, StageStatus] = {}
        self.counters: dict[str, dict] = {}
        # member state
        self.leader_info: PeerInfo | None = None
        self.candidates: dict[str, PeerInfo] = {}
        self.latest_update: PlanUpdate | None = None
        self.suspects: set[str] = set()
        self._wake = asyncio.Event()

    # =========================================================================================== lifecycle

    def stop(self) -> None:
        """Ask ``run()`` to say goodbye and return (safe from signal handlers)."""
        self._stop.set()

    async def run(self) -> None:
        cfg = self.cfg
        state = cfg.state_path
        state.mkdir(parents=True, exist_ok=True)
        with _locked(state):
            self.id = _agent_id(state)
            if cfg.threads:
                torch.set_num_threads(cfg.threads)
            addresses = resolve_interfaces(cfg.interfaces) if cfg.interfaces else default_addresses()
            bad = [a for a in addresses if not bindable(a)]
            if bad:
                raise ConfigError(f"cannot bind {', '.join(bad)}: pass --interface with an address of this host")
            if cfg.model is not None or cfg.leader:
                from .weights import open_source

                self.source = await asyncio.to_thread(open_source, cfg.model)
            profile = self._profile or await asyncio.to_thread(self._measure)
            async with aiohttp.ClientSession(middlewares=(self._sign,)) as session:
                self.session = session
                await self._serve(addresses, profile)

    def _measure(self) -> DeviceProfile:
        cfg, o = self.cfg, self.cfg.profile
        return measure(self.source.config if self.source is not None else None, threads=cfg.threads,
                       memory_bytes=int(o.memory_mb * 2**20) if o.memory_mb else None, gflops=o.gflops,
                       link_mbps=o.link_mbps or cfg.emulation.link_mbps,
                       latency_ms=o.latency_ms if o.latency_ms is not None else cfg.emulation.link_latency_ms,
                       slowdown=cfg.emulation.slowdown)

    async def _serve(self, addresses: list[str], profile: DeviceProfile) -> None:
        cfg = self.cfg
        app = web.Application(middlewares=[self._auth], client_max_size=MAX_CONTROL_BYTES)
        self.ring = RingServer(self.id, cfg.cluster)
        self.ring.install(app)
        app.router.add_get(INFO_PATH, self._http_info)
        app.router.add_get(TIMELINE_PATH, self._http_timeline)
        app.router.add_post(CONTROL_PATH, self._http_control)
        if cfg.leader:
            from .weight_server import WeightServer

            self.weights = WeightServer(self.source)
            self.weights.install(app)
        runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await runner.setup()
        api_runner = None
        try:
            port = await _bind(runner, addresses if cfg.interfaces else ["0.0.0.0"], cfg.port)
            if cfg.leader:
                self.model_fp = await asyncio.to_thread(
                    self.weights.range_fingerprint, LayerRange(start=0, end=self.source.config.num_layers),
                    embed=True, head=True)
            elif self.source is not None:
                from .weights import model_fingerprint

                self.model_fp = await asyncio.to_thread(model_fingerprint, self.source)
            self.info = PeerInfo(id=self.id, name=cfg.name or socket.gethostname(), cluster=cfg.cluster,
                                 role="leader" if cfg.leader else "member", host=addresses[0], port=port,
                                 pid=os.getpid(), started=time.time(), profile=profile, model=self.model_fp)
            self.stage_host = StageHost(
                agent_id=self.id, cluster=cfg.cluster, ring=self.ring, session=self.session,
                cache_dir=cfg.state_path, local_source=self.source,
                link=LinkEmulation(bandwidth_mbps=cfg.emulation.link_mbps, latency_ms=cfg.emulation.link_latency_ms),
                compute=ComputeEmulation(slowdown=cfg.emulation.slowdown), tap=self._on_link_down)
            if cfg.leader:
                api_runner = await self._start_leader()
            discovery = Discovery(
                self.info, self._events, addresses=addresses, interfaces=addresses, auth=auth_tag(self.secret,
                cfg.cluster), mdns=cfg.mdns, static_peers=[split_host_port(p) for p in cfg.peers],
                fetch_info=self._fetch_info)
            self._write_state()
            log.info("agent %s (%s) of cluster %r at %s, %.1f GFLOP/s, %.0f MB offered%s", self.id, self.info.role,
                     cfg.cluster, self.info.url, profile.gflops, profile.memory_bytes / 2**20,
                     f", API at {self.api_url}" if self.api_url else "")
            try:
                async with asyncio.TaskGroup() as tg:
                    self._tg = tg
                    tg.create_task(discovery.run(), name="discovery")
                    tg.create_task(self._discovery_events(), name="discovery-events")
                    tg.create_task(self.stage_host.run(), name="stage-host")
                    if cfg.leader:
                        tg.create_task(self.leader.run(), name="leader-demux")
                        tg.create_task(self._leader_loop(), name="leader-loop")
                    else:
                        tg.create_task(self._member_loop(), name="member-loop")
                    tg.create_task(self._until_stopped(), name="stop")
                    self.started.set()
            except BaseExceptionGroup as eg:
                _, rest = eg.split(_Stopped)
                if rest is not None:
                    first = rest.exceptions[0]
                    while isinstance(first, BaseExceptionGroup):
                        first = first.exceptions[0]
                    raise first from None
        finally:
            self._tg = None
            if self.leader is not None:
                self.leader.close()
            if api_runner is not None:
                await api_runner.cleanup()
            await runner.cleanup()
            with contextlib.suppress(OSError):
                (self.cfg.state_path / STATE_FILE).unlink()
            log.info("agent %s stopped", self.id)

    async def _until_stopped(self) -> None:
        await self._stop.wait()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(BYE_TIMEOUT_S):
                await self._goodbye()
        raise _Stopped

    async def _goodbye(self) -> None:
        bye = Bye(agent_id=self.id)
        if self.cfg.leader and self.membership is not None:
            targets = [m.info.url for m in self.membership.members.values()]
        else:
            targets = [self.leader_info.url] if self.leader_info is not None else []
        await asyncio.gather(*(self._post(url, bye) for url in targets), return_exceptions=True)

    def spawn(self, coro, name: str | None = None) -> None:
        """Start a task owned by the agent's TaskGroup (ignored once the agent is stopping)."""
        wrapped = self._guarded(coro)
        try:
            if self._tg is None:
                raise RuntimeError("not running")
            self._tg.create_task(wrapped, name=name)
        except RuntimeError:  # the agent is stopping: drop the work
            wrapped.close()
            coro.close()

    async def _guarded(self, coro) -> None:
        try:
            await coro
        except (FlowSpecError, aiohttp.ClientError, OSError, TimeoutError) as e:
            log.warning("%s", e)

    def _write_state(self) -> None:
        data = {"id": self.id, "pid": os.getpid(), "cluster": self.cfg.cluster, "role": self.info.role,
                "url": self.info.url, "api_url": self.api_url}
        (self.cfg.state_path / STATE_FILE).write_text(json.dumps(data) + "\n")

    # ============================================================================================== HTTP

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.secret is not None:
            body = await request.read() if request.method == "POST" else b""
            try:
                verify(self.secret, request.headers.get(AUTH_HEADER), request.method, request.raw_path, body)
            except ProtocolError as e:
                log.warning("refused %s %s from %s: %s", request.method, request.path, request.remote, e)
                raise web.HTTPUnauthorized(text=str(e)) from None
        return await handler(request)

    async def _sign(self, req: aiohttp.ClientRequest, handler):
        if self.secret is not None and AUTH_HEADER not in req.headers:
            req.headers[AUTH_HEADER] = sign(self.secret, req.method, req.url.raw_path_qs)
        return await handler(req)

    async def _http_info(self, request: web.Request) -> web.Response:
        return web.Response(text=self.info.model_dump_json(), content_type="application/json")

    async def _http_timeline(self, request: web.Request) -> web.Response:
        """This agent's stage: busy intervals (worker.timeline) ending after ``?since=`` (unix time), for charts."""
        try:
            since = float(request.query["since"]) if "since" in request.query else None
        except ValueError:
            raise web.HTTPBadRequest(text="since must be a unix time") from None
        active = self.stage_host.active if self.stage_host else None
        worker = active.worker if active else None
        body = {"agent_id": self.id, "epoch": active.epoch if active else None,
                "stage": worker.core.index if worker else None,
                "layers": str(active.node.layers) if active and active.node else None,
                "intervals": worker.timeline(since) if worker else []}
        return web.json_response(body)

    async def _http_control(self, request: web.Request) -> web.Response:
        if self.cfg.leader and self.membership is None:
            raise web.HTTPServiceUnavailable(text="the leader is starting")
        try:
            msg = decode(await request.read())
            reply = await (self._leader_control(msg) if self.cfg.leader else self._member_control(msg))
        except ProtocolError as e:
            raise web.HTTPBadRequest(text=str(e)) from None
        return web.Response(body=encode(reply), content_type="application/json")

    async def _post(self, url: str, msg) -> object:
        body = encode(msg)
        headers = {"Content-Type": "application/json"}
        if self.secret is not None:
            headers[AUTH_HEADER] = sign(self.secret, "POST", CONTROL_PATH, body)
        try:
            async with self.session.post(url + CONTROL_PATH, data=body, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=CONTROL_TIMEOUT_S)) as r:
                data = await r.read()
                if r.status == 401:
                    raise ProtocolError(f"{url} refused our signature: {data.decode(errors='replace')}")
                if r.status != 200:
                    raise PeerGone(f"{url} answered {r.status}: {data[:200].decode(errors='replace')}")
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise PeerGone(f"{url} unreachable: {e or type(e).__name__}") from e
        return decode(data)

    async def _fetch_info(self, host: str, port: int, timeout_s: float = CONTROL_TIMEOUT_S) -> PeerInfo | None:
        url = f"http://{host}:{port}{INFO_PATH}"
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                if r.status != 200:
                    return None
                return PeerInfo.model_validate_json(await r.read())
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return None

    # ========================================================================================= discovery

    async def _discovery_events(self) -> None:
        while True:
            ev = await self._events.get()
            if isinstance(ev, PeerSeen):
                await self._peer_seen(ev.info, ev.via)
            elif isinstance(ev, PeerLost):
                self._peer_lost(ev.agent_id, ev.via)

    async def _peer_seen(self, info: PeerInfo, via: str) -> None:
        if info.role == "leader":
            if self.cfg.leader:
                self._check_leader_conflict(info)
            elif info.id not in self.candidates or self.candidates[info.id] != info:
                self.candidates[info.id] = info
                self._wake.set()
        elif self.cfg.leader and via == "static" and info.id not in self.membership.members:
            self.spawn(self._post(info.url, Hello(peer=self.info)), name="invite")  # tell it where we are

    def _check_leader_conflict(self, other: PeerInfo) -> None:
        if (other.started, other.id) < (self.info.started, self.info.id):
            raise ConfigError(
                f"cluster {self.cfg.cluster!r} already has a leader: agent {other.id} ({other.name}) at "
                f"{other.url}, pid {other.pid}. Start this agent without --leader to join it, or stop that one.")
        log.warning("a second leader %s (%s) appeared in cluster %r; it will be refused", other.id, other.url,
                    self.cfg.cluster)

    def _peer_lost(self, agent_id: str, via: str) -> None:
        if self.cfg.leader:
            if agent_id in self.membership.members:
                log.info("member %s left (mDNS removal)", agent_id)
                self._apply(Left(agent_id=agent_id, at=time.monotonic(), reason="mdns"))
        else:
            self.candidates.pop(agent_id, None)
            if self.leader_info is not None and agent_id == self.leader_info.id:
                self._wake.set()

    def _on_link_down(self, ev: LinkDown) -> None:
        """A ring link of this agent closed. Outside a switch of epochs that means a peer may be gone."""
        if self.cfg.leader:
            t = self.transition
            if self.update is None or ev.epoch != self.update.epoch or (t is not None and t.phase != "prepare"):
                return
            self.spawn(self._probe(ev.peer, f"ring link {ev.direction} {ev.reason}"), name="probe")
        else:
            active = self.stage_host.active if self.stage_host else None
            if active is not None and ev.epoch == active.epoch:
                self.suspects.add(ev.peer)
                self._wake.set()

    # ============================================================================================ leader

    async def _start_leader(self) -> web.AppRunner:
        from .api import create_app
        from .leader import Leader, LeaderSettings
        from .shard import Shard
        from .tokenizer import Tokenizer

        cfg, src = self.cfg, self.source
        dtype = _DTYPES[cfg.dtype]
        head = await asyncio.to_thread(
            lambda: Shard.from_source(src, LayerRange(start=0, end=0), embed=True, head=True, dtype=dtype).eval())
        tokenizer = self._tokenizer or await asyncio.to_thread(Tokenizer.load, src.path, src.config.eos_token_ids)
        settings = LeaderSettings(max_context=cfg.planning.context, wire_dtype=cfg.wire_dtype)
        self.leader = Leader(head, tokenizer, drafter=_drafter(self.model_fp, head), settings=settings,
                             modes=_modes(), model_id=src.path.stem)
        self.leader.inbox = TapQueue(self._on_link_down)  # the ring's return path delivers here
        self.ring.inbox = self.leader.inbox
        self.stage_host.leader_inbox = self.leader.inbox
        self.membership = Membership(self_info=self.info)
        self.model_spec = describe_model(src, context=cfg.planning.context, fingerprint=self.model_fp,
                                         dtype_bytes=torch.finfo(dtype).bits // 8)
        api = web.AppRunner(create_app(self.leader, self.cluster_view, run_leader=False), handle_signals=False,
                            access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await api.setup()
        try:
            port = await _bind(api, [cfg.api_host], cfg.api_port)
        except ConfigError:
            await api.cleanup()
            raise
        self.api_url = f"http://{cfg.api_host}:{port}"
        return api

    def _apply(self, event) -> None:
        before = self.membership
        self.membership = membership_mod.apply(before, event)
        gone = set(before.members) - set(self.membership.members)
        if self.plan is not None and gone & set(self.plan.agents) and self.broken is None:
            self.broken = f"{', '.join(sorted(gone))} left"
            self._broken_at = time.monotonic()
            self.spawn(self.leader.set_pipeline(None), name="unset-pipeline")
            log.warning("pipeline broken: %s; re-planning", self.broken)

    async def _leader_control(self, msg):
        now = time.monotonic()
        if isinstance(msg, Hello):
            peer = msg.peer
            if peer.cluster != self.cfg.cluster:
                return Refused(reason=f"this leader serves cluster {self.cfg.cluster!r}", leader=self.info)
            if peer.role == "leader":
                log.warning("refused a second leader %s at %s (pid %d)", peer.id, peer.url, peer.pid)
                return Refused(reason=f"cluster {self.cfg.cluster!r} already has a leader: agent {self.id} at "
                                      f"{self.info.url}, pid {self.info.pid}", leader=self.info)
            if peer.id not in self.membership.members:
                log.info("member %s (%s) joined from %s: %.1f GFLOP/s, %.0f MB", peer.id, peer.name, peer.url,
                         peer.profile.gflops, peer.profile.memory_bytes / 2**20)
            self._apply(Joined(info=peer, at=now))
            return Welcome(leader=self.info, epoch=self.epoch)
        if isinstance(msg, Heartbeat):
            if msg.agent_id not in self.membership.members:
                return Ack(epoch=self.epoch, known=False)
            self._apply(Heard(agent_id=msg.agent_id, at=now, epoch=msg.epoch, state=msg.state))
            self.counters[msg.agent_id] = msg.counters
            for s in msg.suspects:
                self.spawn(self._probe(s, f"{msg.agent_id} lost its link"), name="probe")
            return Ack(epoch=self.epoch)
        if isinstance(msg, StageStatus):
            if msg.agent_id not in self.membership.members:
                return Ack(epoch=self.epoch, known=False)
            self._on_status(msg)
            return Ack(epoch=self.epoch)
        if isinstance(msg, Bye):
            if msg.agent_id in self.membership.members:
                log.info("member %s left: %s", msg.agent_id, msg.reason)
                self._apply(Left(agent_id=msg.agent_id, at=now, reason="bye"))
            return Ack(epoch=self.epoch)
        raise ProtocolError(f"a leader does not take {msg.kind!r} messages")

    async def _probe(self, agent_id: str, why: str) -> None:
        m = self.membership.members.get(agent_id)
        if m is None:
            return
        info = await self._fetch_info(m.info.host, m.info.port, PROBE_TIMEOUT_S)
        if info is None or info.started != m.info.started:
            log.warning("member %s is gone (%s)", agent_id, why)
            self._apply(Left(agent_id=agent_id, at=time.monotonic(), reason="link"))
        elif self.broken is None and self.transition is None:
            self.broken = f"ring link to {agent_id} broke"  # alive, but the ring must be rebuilt
            self._broken_at = time.monotonic()
            await self.leader.set_pipeline(None)

    async def _leader_loop(self) -> None:
        await asyncio.sleep(LEADER_PROBE_S)  # an older leader found meanwhile ends this agent (_peer_seen)
        first_plan_at = time.monotonic() + max(0.0, INITIAL_PLAN_DELAY_S - LEADER_PROBE_S)
        opts = PlanOptions(tokens_per_step=self.cfg.planning.tokens_per_step, stages=self.cfg.planning.stages,
                           leader_layers=self.cfg.planning.leader_layers)
        infeasible = None
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            self._apply(Tick(at=now))
            self._check_transition(now)
            if now < first_plan_at:
                continue
            changed = membership_mod.needs_replan(self.membership, now)
            first = self.plan is None and self.transition is None
            rebuild = self.broken is not None and self.transition is None
            if not (changed or first or rebuild):
                continue
            self.membership = membership_mod.apply(self.membership, Planned(at=now))
            self.planning = True  # until the new plan is kept or its transition has started
            try:
                new = await asyncio.to_thread(_plan, membership_mod.devices(self.membership), self.model_spec, opts)
                infeasible = None
                if self._can_keep(new):
                    self.plan = new
                else:
                    await self._start_transition(new, now)
            except PlanInfeasible as e:
                if str(e) != infeasible:
                    log.error("no plan: %s", e)
                infeasible = str(e)
            finally:
                self.planning = False

    def _can_keep(self, new: Plan) -> bool:
        if self.plan is None or self.broken is not None or self.transition is not None:
            return False
        same = [(s.agent_id, s.layers, s.embed, s.head) for s in new.stages] == [
            (s.agent_id, s.layers, s.embed, s.head) for s in self.plan.stages]
        for aid, started in self.ring_starts.items():
            m = self.membership.members.get(aid)
            if aid != self.id and (m is None or m.info.started != started):
                return False  # it restarted: its stage state is gone
        return same

    async def _start_transition(self, new: Plan, now: float) -> None:
        self.epoch += 1
        members = self.membership.members
        nodes = []
        for s in new.stages:
            info = self.info if s.agent_id == self.id else members[s.agent_id].info
            fp = await asyncio.to_thread(self.weights.range_fingerprint, s.layers, embed=s.embed, head=s.head)
            nodes.append(RingNode(agent_id=s.agent_id, host=info.host, port=info.port, layers=s.layers,
                                  embed=s.embed, head=s.head, fingerprint=fp))
        cfg = self.cfg
        update = PlanUpdate(cluster=cfg.cluster, epoch=self.epoch, leader=self.info, plan=new, ring=tuple(nodes),
                            config=self.source.config, model_fingerprint=self.model_fp,
                            context=cfg.planning.context, dtype=cfg.dtype, wire_dtype=cfg.wire_dtype)
        departed = ", ".join(f"{a} ({r})" for a, r in self.membership.departed)
        trigger = self.broken or (f"departed: {departed}" if departed else "membership changed")
        started = self._broken_at if self.broken else now
        starts = {s.agent_id: (self.info if s.agent_id == self.id else members[s.agent_id].info).started
                  for s in new.stages}
        self.transition = Transition(update=update, trigger=trigger, started=started, ring=set(new.agents),
                                     deadline=now + LOAD_TIMEOUT_S, starts=starts)
        log.info("epoch %d: planning %d stage(s) (%s)\n%s", self.epoch, len(new.stages), trigger, render(new))
        for m in list(members.values()):
            self.spawn(self._send_plan(m.info, update), name="plan-update")
        self.stage_host.prepare(update, self._on_status)

    async def _send_plan(self, info: PeerInfo, update: PlanUpdate) -> None:
        try:
            await self._post(info.url, update)
        except (PeerGone, ProtocolError) as e:
            log.warning("member %s did not take plan %d: %s", info.id, update.epoch, e)
            if info.id in update.plan.agents:
                self._apply(Left(agent_id=info.id, at=time.monotonic(), reason="unreachable"))

    def _on_status(self, status: StageStatus) -> None:
        self.statuses[status.agent_id] = status
        if status.agent_id != self.id:
            self._apply(Heard(agent_id=status.agent_id, at=time.monotonic(), epoch=status.epoch, state=status.state))
        t = self.transition
        if t is None or status.epoch != t.epoch or status.agent_id not in t.ring | {self.id}:
            return
        if status.state == "failed":
            log.error("epoch %d: %s failed: %s", t.epoch, status.agent_id, status.detail)
            if status.agent_id == self.id:
                raise FlowSpecError(f"the leader cannot load its own layers: {status.detail}")
            return
        if status.state == "loaded" and status.agent_id in t.ring:
            t.loaded.add(status.agent_id)
        elif status.state in ("ready", "idle"):
            t.ready.add(status.agent_id)
        if t.phase == "prepare" and t.loaded >= t.ring:
            t.phase = "activate"
            t.deadline = time.monotonic() + DRAIN_TIMEOUT_S + ACTIVATE_TIMEOUT_S
            self.spawn(self._activate(t), name="activate")
        elif t.phase == "activate" and t.ready >= t.ring:
            t.phase = "finish"
            self.spawn(self._finish(t), name="finish")

    def _check_transition(self, now: float) -> None:
        t = self.transition
        if t is None:
            return
        if now > t.deadline:
            late = (t.ring - (t.loaded if t.phase == "prepare" else t.ready)) - {self.id}
            for aid in late:
                log.error("epoch %d: %s did not get %s in time; leaving it out", t.epoch, aid,
                          "its layers loaded" if t.phase == "prepare" else "its links up")
                self._apply(Heard(agent_id=aid, at=now, state="failed"))
            t.deadline = now + LOAD_TIMEOUT_S  # the re-plan that follows supersedes this one

    async def _activate(self, t: Transition) -> None:
        if self.broken is None:  # the old pipeline still serves: let the request in flight finish
            deadline = time.monotonic() + DRAIN_TIMEOUT_S
            while self.leader.snapshot()["in_flight"] and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        if self.transition is not t:
            return
        await self.leader.set_pipeline(None)
        last = t.update.ring[-1].agent_id
        self.ring.allowed = lambda hello, last=last: hello.sender == last
        await self.ring.set_epoch(t.epoch)
        act = Activate(epoch=t.epoch)
        for m in list(self.membership.members.values()):
            self.spawn(self._post(m.info.url, act), name="activate")
        status = await self.stage_host.activate(t.epoch)
        self._on_status(status)

    async def _finish(self, t: Transition) -> None:
        if self.transition is not t:
            return
        u = t.update
        first = u.ring[0]
        try:
            if first.agent_id == self.id:
                sender = self.stage_host.local_sender()
            else:
                hello = RingHello(protocol=PROTOCOL_VERSION, cluster=self.cfg.cluster, epoch=u.epoch, sender=self.id)
                sender = await connect_with_retry(ws_url(first.url), hello, self.session, self.leader.inbox,
                                                  self.stage_host.link, _wire(u.wire_dtype))
        except PeerGone as e:
            log.error("epoch %d: cannot reach stage 1 (%s): %s", u.epoch, first.agent_id, e)
            self._apply(Heard(agent_id=first.agent_id, at=time.monotonic(), state="failed"))
            return
        if self.transition is not t:
            await sender.close()
            return
        from .leader import Pipeline

        info = {"plan": [f"{s.agent_id} {s.layers}" for s in u.plan.stages],
                "emulation": self.stage_host.link.describe()}
        await self.leader.set_pipeline(Pipeline(sender, takes="tokens", epoch=u.epoch, stages=len(u.ring), info=info))
        took = time.monotonic() - t.started
        self.plan, self.update, self.transition, self.broken = u.plan, u, None, None
        self.ring_starts = t.starts
        self.recoveries = [*self.recoveries[-19:], {"epoch": u.epoch, "trigger": t.trigger, "seconds": round(took, 3)}]
        self.serving.set()
        log.info("epoch %d serving on %d stage(s), %.2f s after: %s", u.epoch, len(u.ring), took, t.trigger)

    def cluster_view(self) -> dict:
        """GET /cluster: members (id, role, address, pid, capabilities, state), the plan, per-stage counters."""
        now = time.monotonic()
        members = [{**self.info.model_dump(mode="json"), "address": self.info.url, "state": "leader",
                    "epoch": self.update.epoch if self.update else -1}]
        for m in sorted(self.membership.members.values(), key=lambda m: m.info.id):
            members.append({**m.info.model_dump(mode="json"), "address": m.info.url, "state": m.state,
                            "epoch": m.epoch, "failed": m.failed, "last_seen_s": round(now - m.last_seen, 2)})
        stages = []
        for i, n in enumerate(self.update.ring if self.update else (), 1):
            counters = self.stage_host.snapshot() if n.agent_id == self.id else self.counters.get(n.agent_id)
            stages.append({"stage": i, "agent_id": n.agent_id, "layers": str(n.layers), "address": n.url,
                           "counters": counters})
        t = self.transition
        return {
            "cluster": self.cfg.cluster,
            "epoch": self.update.epoch if self.update else None,
            "members": members,
            "plan": self.plan.model_dump(mode="json") if self.plan else None,
            "plan_text": render(self.plan) if self.plan else None,
            "stages": stages,
            "transition": None if t is None else {"epoch": t.epoch, "phase": t.phase, "trigger": t.trigger,
                                                  "loaded": sorted(t.loaded), "ready": sorted(t.ready)},
            "broken": self.broken,
            "pending": self.membership.changed_at is not None or self.planning,
            "recoveries": self.recoveries,
            "emulation": self.cfg.emulation.model_dump(),
        }

    # ============================================================================================ member

    async def _member_control(self, msg):
        if isinstance(msg, Hello):  # a leader that learned of us through a static peer
            if msg.peer.role == "leader" and msg.peer.cluster == self.cfg.cluster:
                self.candidates[msg.peer.id] = msg.peer
                self._wake.set()
            return Ack()
        leader = self.leader_info
        sender = getattr(getattr(msg, "leader", None), "id", None)
        if isinstance(msg, PlanUpdate):
            if leader is None or sender != leader.id:
                raise ProtocolError("plan update from an agent that is not this member's leader")
            if self.latest_update is None or msg.epoch > self.latest_update.epoch:
                self.latest_update = msg
                self.stage_host.prepare(msg, self._report)
            return Ack(epoch=msg.epoch)
        if isinstance(msg, Activate):
            if leader is None:
                raise ProtocolError("activate without a leader")
            self.spawn(self._member_activate(msg.epoch), name="activate")
            return Ack(epoch=msg.epoch)
        if isinstance(msg, Bye):
            if leader is not None and msg.agent_id == leader.id:
                log.warning("the leader %s stopped: %s", leader.id, msg.reason)
                self.candidates.pop(leader.id, None)
                self._wake.set()
            return Ack()
        raise ProtocolError(f"a member does not take {msg.kind!r} messages")

    async def _member_activate(self, epoch: int) -> None:
        u = self.latest_update
        if u is None or u.epoch != epoch:
            return
        if u.node(self.id) is None:
            await self.stage_host.release()
            status = StageStatus(agent_id=self.id, epoch=epoch, state="idle")
        else:
            status = await self.stage_host.activate(epoch)
        await self._report(status)

    async def _report(self, status: StageStatus) -> None:
        if self.leader_info is not None:
            await self._post(self.leader_info.url, status)

    def _pick_leader(self) -> PeerInfo | None:
        if not self.candidates:
            return None
        return min(self.candidates.values(), key=lambda p: (p.started, p.id))

    async def _member_loop(self) -> None:
        while True:
            leader = self._pick_leader()
            if leader is None:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await self._wake.wait()
                continue
            try:
                reply = await self._post(leader.url, Hello(peer=self.info))
            except (PeerGone, ProtocolError) as e:
                log.warning("cannot join leader %s: %s", leader.id, e)
                self.candidates.pop(leader.id, None)
                await asyncio.sleep(membership_mod.HEARTBEAT_INTERVAL_S)
                continue
            if isinstance(reply, Refused):
                log.error("leader %s refused this agent: %s", leader.id, reply.reason)
                self.candidates.pop(leader.id, None)
                await asyncio.sleep(membership_mod.HEARTBEAT_INTERVAL_S)
                continue
            self.leader_info = leader
            log.info("joined leader %s at %s", leader.id, leader.url)
            await self._heartbeats(leader)
            self.leader_info = None
            self.latest_update = None
            await self.stage_host.release()

    async def _heartbeats(self, leader: PeerInfo) -> None:
        """Heartbeat until the leader is lost (silent, removed, stopped) or has forgotten us."""
        last_ok = time.monotonic()
        while True:
            active = self.stage_host.active
            snap = self.stage_host.snapshot() or {}
            counters = {k: float(v) for k, v in snap.items() if isinstance(v, int | float) and not isinstance(v, bool)}
            beat = Heartbeat(agent_id=self.id, epoch=active.epoch if active else -1,
                             state="ready" if active and active.worker else "idle", counters=counters,
                             suspects=tuple(sorted(self.suspects)))
            self.suspects.clear()
            try:
                ack = await self._post(leader.url, beat)
                last_ok = time.monotonic()
                if isinstance(ack, Ack) and not ack.known:
                    log.warning("leader %s does not know this agent any more; joining again", leader.id)
                    return
            except (PeerGone, ProtocolError) as e:
                if time.monotonic() - last_ok > membership_mod.HEARTBEAT_TIMEOUT_S:
                    log.warning("leader %s is gone: %s", leader.id, e)
                    self.candidates.pop(leader.id, None)
                    return
            if leader.id not in self.candidates:
                return
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(membership_mod.HEARTBEAT_INTERVAL_S):
                    await self._wake.wait()


# ============================================================================================== helpers

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def _wire(name: str) -> torch.dtype:
    from .codec import wire_dtype

    return wire_dtype(name)


def _plan(devices, model, opts) -> Plan:
    from .planner import plan

    return plan(devices, model, opts)


def _modes() -> list:
    """The decoding modes this build offers (the leader picks what its drafter allows)."""
    from .chunkpp import CHUNK
    from .leader import AR

    modes = [AR, CHUNK]
    try:
        from .flowspec import FLOWSPEC
    except ImportError:  # the flowspec mode ships separately (issue 5)
        return modes
    return [*modes, FLOWSPEC]


def _drafter(model_fp: str, head):
    from .draft import DraftBundle, find_draft
    from .drafter import HeadDrafter

    stem = find_draft(model_fp)
    if stem is None:
        log.info("no draft head for model %s: speculative modes are off", model_fp[:12])
        return None
    bundle = DraftBundle.load(stem, dtype=head.dtype)
    log.info("draft head %s", stem.name)
    return HeadDrafter(bundle.head, head, bundle.draft_vocab)


def _agent_id(state: Path) -> str:
    path = state / "agent_id"
    try:
        aid = path.read_text().strip()
        if aid:
            return aid
    except OSError:
        pass
    aid = uuid.uuid4().hex[:12]
    path.write_text(aid + "\n")
    return aid


@contextlib.contextmanager
def _locked(state: Path):
    """One agent per state folder (its id must be unique)."""
    fh = open(state / "lock", "a+")  # noqa: SIM115 - held for the agent's lifetime
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"another agent is running with state folder {state}; give each agent its own "
                              "--state-dir") from None
        yield
    finally:
        fh.close()


async def _bind(runner: web.AppRunner, hosts: list[str], port: int) -> int:
    """Start a TCP site on each host, all on one port (the first site picks it when ``port`` is 0)."""
    for host in hosts:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        if port == 0:
            port = runner.addresses[-1][1]
    return port
