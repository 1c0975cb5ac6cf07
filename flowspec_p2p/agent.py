"""The agent, one per device: the composition root. ``Agent(cfg).run()`` owns everything in one TaskGroup.

    discovery (mDNS + static peers) --PeerSeen/PeerLost--> coordinator (leader) or member control
    agent server (aiohttp; with a cluster key TLS, and every route but /auth for authenticated peers only:
    cluster/security.py):
        POST /auth/challenge, POST /auth/confirm                    mutual authentication (handshake.py)
        POST /control, GET /control/info, GET /control/timeline    control plane (control.py)
        GET  /ring                                                  data plane (ring_server.RingServer)
        GET  /weights/...                                           the leader's weight server
        GET  /metrics                                               this agent's stage (stage_metrics.py)
    StageHost: this agent's pipeline stage (weights, worker, links) for the plan epoch in force
    leader only: the Leader (decoding modes), its OpenAI-compatible API, dashboard and /metrics (api/) on --api-port

Roles. The leader (``--leader``) plans (coordinator.py), serves weights and the API; every other agent is a
member (member.py) that joins the oldest leader of its cluster, heartbeats to it and hosts whatever stage the plan
gives it. Another leader's claim never stops a leader: members follow their leader by identity (member.py).

Stopping (``stop()``, SIGINT/SIGTERM in ``flowspec agent``): say Bye (a member to its leader, the leader to every
member), then cancel everything; the mDNS record is withdrawn, links and servers close.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import aiohttp
from aiohttp import web

from .api.app import create_app
from .api.catalog import served_model
from .cluster.control import (
    CONTROL_PATH,
    INFO_PATH,
    MAX_CONTROL_BYTES,
    TIMELINE_PATH,
    ControlMessage,
    PeerInfo,
    decode_message,
    encode_message,
)
from .cluster.coordinator import Coordinator
from .cluster.device import DeviceProfile
from .cluster.discovery import Discovery, PeerLost, PeerSeen, bindable, default_addresses, resolve_interfaces
from .cluster.gate import KEEPALIVE_TIMEOUT_S, Gate, raise_fd_limit
from .cluster.identity import state_lock as _locked
from .cluster.member import MemberControl
from .cluster.net import CONTROL_TIMEOUT_S, ControlClient, Net, bind
from .cluster.plans import describe_model
from .cluster.profile import measure
from .cluster.security import Security
from .cluster.stage_host import StageHost, TapQueue
from .cluster.stage_metrics import install_stage_metrics
from .cluster.telemetry import StageTimelines
from .cluster.weight_server import WeightServer
from .config import AgentConfig, split_host_port
from .decoding.context import DecodingMode, ThreadCompute
from .decoding.flowspec import FlowSpecConfig
from .decoding.leader import Leader
from .decoding.registry import builtin_modes
from .decoding.settings import LeaderSettings
from .errors import ConfigError, FlowSpecError, ProtocolError
from .model.dtypes import TORCH_DTYPES
from .model.engine import Shard
from .model.load import get_engine, load_shard, set_threads
from .model.registry import aliases, display_name
from .model.tokenizer import Tokenizer
from .model.weights import model_fingerprint, open_source
from .pipeline.codec import wire_dtype
from .pipeline.emulation import ComputeEmulation, EmulatedCompute, LinkEmulation, device_for
from .pipeline.ring_server import RingServer
from .pipeline.transport import LinkDown
from .speculative.decoder import PROBE_TEXT, load_drafter
from .speculative.drafter import Drafter
from .types import LayerRange

log = logging.getLogger(__name__)

BYE_TIMEOUT_S = 1.5
SHUTDOWN_TIMEOUT_S = 2.0  # open HTTP handlers (ring links, streamed responses) get this long to end
STATE_FILE = "agent.json"


class _Stopped(Exception):
    """Raised inside the TaskGroup to end it after stop()."""


class Agent(Net):
    def __init__(self, cfg: AgentConfig, *, profile: DeviceProfile | None = None, tokenizer=None):
        """``profile`` replaces the start-up measurement and ``tokenizer`` the model's own (tests)."""
        self.cfg = cfg
        self.security: Security | None = None
        self._profile = profile
        self._tokenizer = tokenizer
        self.id = ""
        self.info: PeerInfo | None = None
        self.api_url: str | None = None
        self.started = asyncio.Event()  # the agent server, discovery and its role run
        self.source = None  # this device's own model copy, if any
        self.model_fp = ""
        self.session: aiohttp.ClientSession | None = None
        self.client: ControlClient | None = None
        self.ring: RingServer | None = None
        self.stage_host: StageHost | None = None
        self.leader = None  # leader.Leader, on the leader
        self.weights = None  # weight_server.WeightServer, on the leader
        self.coordinator: Coordinator | None = None  # on the leader
        self.member: MemberControl | None = None  # on a member
        self._stop = asyncio.Event()
        self._tg: asyncio.TaskGroup | None = None
        self._events: asyncio.Queue = asyncio.Queue()

    # =========================================================================================== lifecycle

    def stop(self) -> None:
        """Ask ``run()`` to say goodbye and return (safe from signal handlers)."""
        self._stop.set()

    async def run(self) -> None:
        cfg = self.cfg
        state = cfg.state_path
        state.mkdir(parents=True, exist_ok=True)
        with _locked(state):
            limit = raise_fd_limit()  # a stranger's idle connections are capped (gate.py); peers need the rest
            log.debug("open-files limit %d", limit)
            self.security = await asyncio.to_thread(Security.load, cfg)
            self.id = self.security.agent_id
            set_threads(cfg.threads)
            addresses = resolve_interfaces(cfg.interfaces) if cfg.interfaces else default_addresses()
            bad = [a for a in addresses if not bindable(a)]
            if bad:
                raise ConfigError(f"cannot bind {', '.join(bad)}: pass --interface with an address of this host")
            if cfg.model is not None or cfg.leader:
                self.source = await asyncio.to_thread(open_source, cfg.model)
            profile = self._profile or await asyncio.to_thread(self._measure)
            async with self.security.client_session() as session:
                self.session = session
                self.client = self.security.control_client(session)
                await self._serve(addresses, profile)

    def _measure(self) -> DeviceProfile:
        cfg, o = self.cfg, self.cfg.profile
        return measure(self.source.config if self.source is not None else None, threads=cfg.threads,
                       engine=get_engine(cfg.engine, TORCH_DTYPES[cfg.dtype]),
                       memory_bytes=int(o.memory_mb * 2**20) if o.memory_mb else None, gflops=o.gflops,
                       link_mbps=o.link_mbps or cfg.emulation.link_mbps,
                       latency_ms=o.latency_ms if o.latency_ms is not None else cfg.emulation.link_latency_ms,
                       slowdown=cfg.emulation.slowdown)

    def _agent_app(self) -> web.Application:
        """The agent server: control plane, ring links, (on the leader) the weight server."""
        sec = self.security
        app = web.Application(middlewares=sec.middlewares(), client_max_size=MAX_CONTROL_BYTES)
        sec.install(app)
        self.ring = RingServer(self.id, self.cfg.cluster, authenticated=self._ring_sender if sec.secure else None)
        self.ring.install(app)
        app.router.add_get(INFO_PATH, self._http_info)
        app.router.add_get(TIMELINE_PATH, self._http_timeline)
        app.router.add_post(CONTROL_PATH, self._http_control)
        install_stage_metrics(app, lambda: self.stage_host, lambda: self.info)
        if self.cfg.leader:
            self.weights = WeightServer(self.source)
            self.weights.install(app)
        return app

    async def _serve(self, addresses: list[str], profile: DeviceProfile) -> None:
        cfg = self.cfg
        runner = web.AppRunner(self._agent_app(), handle_signals=False, access_log=None,
                               shutdown_timeout=SHUTDOWN_TIMEOUT_S, keepalive_timeout=KEEPALIVE_TIMEOUT_S)
        await runner.setup()
        api_runner = None
        try:
            port = await bind(runner, addresses if cfg.interfaces else ["0.0.0.0"], cfg.port,
                              self.security.server_ssl(), gate=self.security.gate)
            if self.source is not None:
                self.model_fp = await asyncio.to_thread(model_fingerprint, self.source)
            self.info = PeerInfo(id=self.id, name=cfg.name or socket.gethostname(), cluster=cfg.cluster,
                                 role="leader" if cfg.leader else "member", host=addresses[0], port=port,
                                 pid=os.getpid(), started=time.time(), profile=profile, model=self.model_fp,
                                 identity=self.security.fingerprint)
            self.stage_host = StageHost(
                agent_id=self.id, cluster=cfg.cluster, ring=self.ring, session=self.session,
                cache_dir=cfg.state_path, local_source=self.source,
                cache_max_bytes=None if cfg.cache_max_gb is None else int(cfg.cache_max_gb * 1e9),
                link=LinkEmulation(bandwidth_mbps=cfg.emulation.link_mbps, latency_ms=cfg.emulation.link_latency_ms),
                device=partial(device_for, ComputeEmulation(slowdown=cfg.emulation.slowdown)), tap=self._on_link_down)
            if cfg.leader:
                api_runner = await self._start_leader()
            else:
                self.member = MemberControl(self.info, net=self, stage_host=self.stage_host,
                                            trusted=(cfg.leader_identity or "",))
            discovery = Discovery(
                self.info, self._events, addresses=addresses, interfaces=addresses,
                seal=self.security.seal, confirm=self._confirm if self.security.secure else None, mdns=cfg.mdns,
                static_peers=[split_host_port(p) for p in cfg.peers], fetch_info=self.fetch_info)
            self._write_state()
            log.info("agent %s (%s) of cluster %r at %s, %.1f GFLOP/s, %.0f MB offered%s", self.id, self.info.role,
                     cfg.cluster, self.info.url, profile.gflops, profile.memory_bytes / 2**20,
                     f"; API at {self.api_url}/v1, dashboard at {self.api_url}/" if self.api_url else "")
            await self._run_roles(discovery)
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

    async def _run_roles(self, discovery: Discovery) -> None:
        """Discovery, the stage host and the agent's role in one TaskGroup, until stop() (or the first error)."""
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                tg.create_task(discovery.run(), name="discovery")
                tg.create_task(self._discovery_events(), name="discovery-events")
                tg.create_task(self.stage_host.run(), name="stage-host")
                if self.cfg.leader:
                    tg.create_task(self.leader.run(), name="leader-demux")
                    tg.create_task(self.coordinator.run(), name="coordinator")
                else:
                    tg.create_task(self.member.run(), name="member")
                tg.create_task(self._until_stopped(), name="stop")
                self.started.set()
        except BaseExceptionGroup as eg:
            _, rest = eg.split(_Stopped)
            if rest is not None:
                first = rest.exceptions[0]
                while isinstance(first, BaseExceptionGroup):
                    first = first.exceptions[0]
                raise first from None

    async def _start_leader(self) -> web.AppRunner:
        cfg, src = self.cfg, self.source
        dtype = TORCH_DTYPES[cfg.dtype]
        # the engine is chosen here, once: the plans name the head's, so every stage runs the same one (auto falls
        # back to the torch engine for a model the native engine cannot run)
        head = await asyncio.to_thread(load_shard, src, LayerRange(start=0, end=0), embed=True, head=True,
                                       engine=cfg.engine, dtype=dtype)
        tokenizer = self._tokenizer or await asyncio.to_thread(Tokenizer.load, src.path, src.config.eos_token_ids)
        settings = LeaderSettings(max_context=cfg.planning.context, wire_dtype=cfg.wire_dtype,
                                  default_mode=cfg.decoding)
        compute = ThreadCompute()
        if cfg.emulation.slowdown > 1.0:
            compute = EmulatedCompute(compute, cfg.emulation.slowdown)
        probe = tokenizer.encode(PROBE_TEXT)

        def whole_model() -> Shard:  # the tolerance test of a head trained for another build of the model
            return head.engine.load(src, LayerRange(start=0, end=src.config.num_layers), embed=True, head=True)

        drafter = await asyncio.to_thread(_drafter, self.model_fp, head, cfg.draft, probe, whole_model)
        model_id = display_name(cfg.model, src.path)  # the name it was started by, else the file's stem
        self.leader = Leader(head, tokenizer, drafter=drafter, settings=settings, modes=_modes(cfg.flowspec),
                             model_id=model_id, compute=compute)
        self.leader.inbox = TapQueue(self._on_link_down)  # the ring's return path delivers here
        self.ring.inbox = self.leader.inbox
        self.stage_host.leader_inbox = self.leader.inbox
        self.stage_host.shared = (self.model_fp, [head])  # the leader's first stage shares the head's embedding
        base = getattr(drafter, "base", drafter)  # LookupDrafter wraps the head drafter
        model = describe_model(src, head.engine, context=cfg.planning.context, fingerprint=self.model_fp,
                               draft_bytes=getattr(base, "nbytes", 0))
        self.coordinator = Coordinator(cfg, self.info, net=self, leader=self.leader, weights=self.weights,
                                       stage_host=self.stage_host, ring=self.ring, session=self.session,
                                       model=model, model_config=src.config, wire_dtype=wire_dtype)
        app = create_app(self.leader, self.coordinator.view, run_leader=False, api_key=cfg.api_key_text,
                         cors=cfg.api_cors, timelines=StageTimelines(self.coordinator, self.stage_host, self.session),
                         served=served_model(src, [model_id, *aliases(src.path)], context=cfg.planning.context,
                                             digest=self.model_fp, tokenizer=tokenizer))
        gate = Gate("API")
        app.middlewares.insert(0, gate.vouch_all)  # a connection that carries a request is vouched for (gate.py)
        api = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                            keepalive_timeout=KEEPALIVE_TIMEOUT_S)
        await api.setup()
        try:
            port = await bind(api, [cfg.api_host], cfg.api_port, gate=gate)
        except ConfigError:
            await api.cleanup()
            raise
        self.api_url = f"http://{cfg.api_host}:{port}"
        return api

    async def _until_stopped(self) -> None:
        await self._stop.wait()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(BYE_TIMEOUT_S):
                await self._goodbye()
        raise _Stopped

    async def _goodbye(self) -> None:
        role = self.coordinator or self.member
        if role is not None:
            await role.goodbye()

    def spawn(self, coro, name: str | None = None) -> None:
        """Start a task owned by the agent's TaskGroup (dropped once the agent is stopping)."""
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
        except Exception:  # a background task's bug (a peer's odd input) is logged; it does not end the agent
            log.exception("background task %s failed", getattr(coro, "__qualname__", coro))

    def _write_state(self) -> None:
        data = {"id": self.id, "pid": os.getpid(), "cluster": self.cfg.cluster, "role": self.info.role,
                "url": self.info.url, "api_url": self.api_url}
        (self.cfg.state_path / STATE_FILE).write_text(json.dumps(data) + "\n")

    # ============================================================================================== HTTP

    def _ring_sender(self, request: web.Request) -> str | None:
        """Who opened a ring link, for the ring server: the agent id it authenticated as, provided its identity is
        the one the plan this agent prepared gives that agent (a predecessor is checked by identity, not by id)."""
        peer = self.security.sender(request)
        if peer is None:
            return None
        prepared = self.stage_host.prepared if self.stage_host is not None else None
        if prepared is not None:
            u = prepared.update
            planned = {n.agent_id: n.identity for n in u.ring} | {u.leader.id: u.leader.identity}
            expected = planned.get(peer.agent_id, "")
            if expected and expected != peer.identity:
                log.warning("ring: a link from %s with identity %s, not the %s the plan gives it", peer.agent_id,
                            peer.identity[:12], expected[:12])
                return f"{peer.agent_id} (another identity)"
        return peer.agent_id

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
        role = self.coordinator or self.member
        if role is None or not self.started.is_set():
            raise web.HTTPServiceUnavailable(text="the agent is starting")
        try:
            msg = decode_message(await request.read())
        except ProtocolError as e:
            raise web.HTTPBadRequest(text=str(e)) from None
        try:
            self.security.check_control(request, msg)
            if self.member is not None:
                reply = await self.member.handle(msg, sender=self.security.sender(request))
            else:
                reply = await self.coordinator.handle(msg)
        except ProtocolError as e:
            log.warning("refused a %s message from %s: %s", msg.kind, request.remote, e)
            raise web.HTTPForbidden(text=str(e)) from None
        except FlowSpecError as e:  # a message this agent cannot act on: refused with the reason, the agent goes on
            log.warning("could not act on a %s message from %s: %s", msg.kind, request.remote, e)
            raise web.HTTPBadRequest(text=str(e)) from None
        self.security.learn(msg)
        return web.Response(body=encode_message(reply), content_type="application/json")

    async def post(self, url: str, msg: ControlMessage) -> ControlMessage:
        """Net: POST a control message (signed) -> the reply. Raises PeerGone/ProtocolError."""
        return await self.client.post(url, msg)

    async def fetch_info(self, host: str, port: int, timeout_s: float = CONTROL_TIMEOUT_S) -> PeerInfo | None:
        """Net: GET /control/info of an agent; None when it does not answer (or cannot authenticate)."""
        return await self.client.fetch_info(host, port, timeout_s)

    async def _confirm(self, claim: PeerInfo) -> PeerInfo | None:
        """Discovery: the claimant's own word on a sealed leadership claim."""
        return await self.security.confirm(claim, self.client)

    # ========================================================================================= discovery

    async def _discovery_events(self) -> None:
        while True:
            ev = await self._events.get()
            try:
                self._discovered(ev)
            except Exception:  # a peer's odd advert must not end the agent
                log.exception("discovery event %s failed", ev)

    def _discovered(self, ev) -> None:
        if isinstance(ev, PeerSeen):
            if self.coordinator is not None:
                self.coordinator.peer_seen(ev.info, ev.via)
            else:
                self.member.peer_seen(ev.info)
        elif isinstance(ev, PeerLost):
            (self.coordinator or self.member).peer_lost(ev.agent_id)

    def _on_link_down(self, ev: LinkDown) -> None:
        """A ring link of this agent closed. Outside a switch of epochs that means a peer may be gone."""
        role = self.coordinator or self.member
        if role is not None:
            role.link_down(ev)


# ============================================================================================== helpers

def _modes(flowspec: FlowSpecConfig) -> list[DecodingMode]:
    """The decoding modes this build offers (the leader picks what its drafter allows), FlowSpec with ``flowspec``
    (AgentConfig.flowspec)."""
    return builtin_modes(None if flowspec == FlowSpecConfig() else flowspec)


def _drafter(model_fp: str, head: Shard, stem: Path | None = None, probe: list[int] | None = None,
             whole_model: Callable[[], Shard] | None = None) -> Drafter:
    """The leader's drafter: the head at ``stem``, else one trained for this model (or another build of it that
    passes the tolerance test), else prompt lookup alone (spec.decoder.load_drafter)."""
    drafter, meta = load_drafter(head, model_fp, stem, probe, whole_model)
    if meta["match"] != "none":
        log.info("draft head for %s (+ prompt-lookup candidates; matched by %s)", model_fp[:12], meta["match"])
    return drafter
