"""The agent, one per device: the composition root. ``Agent(cfg).run()`` owns everything in one TaskGroup.

    discovery (mDNS + static peers) --PeerSeen/PeerLost--> coordinator (leader) or member control
    agent server (aiohttp; with a cluster key TLS, and every route but /auth for authenticated peers only:
    cluster/security.py):
        POST /auth/challenge, POST /auth/confirm                    mutual authentication (handshake.py)
        POST /control, GET /control/info, GET /control/timeline    control plane (control.py)
        GET  /ring                                                  data plane (ring_server.RingServer)
        GET  /weights/...                                           the leader's weight server
        GET  /metrics                                               this agent's stage (stage_metrics.py)
        GET  /replica/...                                           the leader's model files, for its standby
        *    /relay/...                                             the leader's API, for the members' APIs
    StageHost: this agent's pipeline stage (weights, worker, links) for the plan epoch in force
    the API on --api-port: the leader's own (api/app.py: the Leader, its decoding modes, dashboard, /metrics); a
    member's forwards every request to its leader (api/proxy.py), resuming a streamed reply on the next leader

Roles (roles.py): the leader plans, serves the weights and the API; every other agent is a member that hosts the
stage its leader's plan gives it; the plan's standby gets ready to lead, and takes over when the leader is lost or
stops. An agent changes role in place (``_roles`` runs the role in force until it changes).

Stopping (``stop()``, SIGINT/SIGTERM in ``flowspec agent``): say Bye (a member to its leader, the leader to every
member, naming its standby, which takes over as when the leader is lost), then cancel everything; the mDNS record
is withdrawn, links and servers close.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from functools import partial

import aiohttp
from aiohttp import web

from .api.proxy import RELAY_PATH, create_proxy_app, forward, not_leading
from .cluster import replica as replica_mod
from .cluster import weight_server as weight_server_mod
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
from .cluster.leading import LeaderParts, load_leader_parts
from .cluster.member import MemberControl
from .cluster.net import CONTROL_TIMEOUT_S, ControlClient, Net, bind
from .cluster.profile import measure
from .cluster.security import Security
from .cluster.stage_host import StageHost
from .cluster.stage_metrics import install_stage_metrics
from .config import AgentConfig, split_host_port
from .errors import ConfigError, FlowSpecError, ProtocolError
from .model.dtypes import TORCH_DTYPES
from .model.load import get_engine, set_threads
from .model.weights import model_fingerprint, open_source
from .pipeline.emulation import ComputeEmulation, LinkEmulation, device_for
from .pipeline.ring_server import RingServer
from .pipeline.transport import LinkDown
from .roles import Roles

log = logging.getLogger(__name__)

BYE_TIMEOUT_S = 1.5
SHUTDOWN_TIMEOUT_S = 2.0  # open HTTP handlers (ring links, streamed responses) get this long to end
STATE_FILE = "agent.json"
LEADER_POLL_S = 0.05  # how often the API's proxy looks whether this agent's leader changed


class _Stopped(Exception):
    """Raised inside the TaskGroup to end it after stop()."""


class _RoleChanged(Exception):
    """Raised inside a role's TaskGroup to end it when the agent takes over or steps down."""


class Agent(Net, Roles):
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
        self.replica: replica_mod.ReplicaServer | None = None  # the model's files for the standby, on the leader
        self.coordinator: Coordinator | None = None  # on the leader
        self.member: MemberControl | None = None  # on a member
        self.discovery: Discovery | None = None
        self.standby: LeaderParts | None = None  # the leader's parts, loaded ahead of need (the plan's standby)
        self._preparing = False  # the standby's replica and parts are being fetched and loaded
        self._stop = asyncio.Event()
        self._role_changed = asyncio.Event()
        self._tg: asyncio.TaskGroup | None = None
        self._events: asyncio.Queue = asyncio.Queue()
        self._local_http: aiohttp.ClientSession | None = None  # this agent's own API, for the relay
        self._api: tuple[web.AppRunner, int] | None = None  # the API runner serving now, and its port
        self._old_apis: list[web.AppRunner] = []  # replaced ones: their open replies finish first

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
            async with self.security.client_session() as session, aiohttp.ClientSession() as local:
                self.session, self._local_http = session, local
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
        """The agent server: control plane, ring links, and (served while this agent leads) the weight server, the
        replica for the standby and the relay to the API."""
        sec = self.security
        app = web.Application(middlewares=sec.middlewares(), client_max_size=MAX_CONTROL_BYTES)
        sec.install(app)
        self.ring = RingServer(self.id, self.cfg.cluster, authenticated=self._ring_sender if sec.secure else None)
        self.ring.install(app)
        app.router.add_get(INFO_PATH, self._http_info)
        app.router.add_get(TIMELINE_PATH, self._http_timeline)
        app.router.add_post(CONTROL_PATH, self._http_control)
        install_stage_metrics(app, lambda: self.stage_host, lambda: self.info)
        app.router.add_get(weight_server_mod.MANIFEST_PATH, partial(self._leading, "_manifest", "weights"))
        app.router.add_get(weight_server_mod.TENSOR_PATH, partial(self._leading, "_tensor", "weights"))
        app.router.add_get(replica_mod.MANIFEST_PATH, partial(self._leading, "handle_manifest", "replica"))
        app.router.add_get(replica_mod.FILE_PATH, partial(self._leading, "handle_file", "replica"))
        app.router.add_route("*", RELAY_PATH + "/{tail:.*}", self._http_relay)
        return app

    async def _serve(self, addresses: list[str], profile: DeviceProfile) -> None:
        cfg = self.cfg
        runner = web.AppRunner(self._agent_app(), handle_signals=False, access_log=None,
                               shutdown_timeout=SHUTDOWN_TIMEOUT_S, keepalive_timeout=KEEPALIVE_TIMEOUT_S)
        await runner.setup()
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
                parts = await asyncio.to_thread(load_leader_parts, cfg, self.source, self.model_fp,
                                                tokenizer=self._tokenizer)
                await self._become_leader(parts, cfg, successor=self._recorded_successor())
            else:
                await self._serve_api(self._proxy_app(), required=False)
                self._become_member(trusted=(cfg.leader_identity or "",))
            self.discovery = Discovery(
                self.info, self._events, addresses=addresses, interfaces=addresses,
                seal=self.security.seal, confirm=self._confirm if self.security.secure else None, mdns=cfg.mdns,
                static_peers=[split_host_port(p) for p in cfg.peers], fetch_info=self.fetch_info)
            self._write_state()
            log.info("agent %s (%s) of cluster %r at %s, %.1f GFLOP/s, %.0f MB offered%s", self.id, self.info.role,
                     cfg.cluster, self.info.url, profile.gflops, profile.memory_bytes / 2**20,
                     f"; API at {self.api_url}/v1, dashboard at {self.api_url}/" if self.api_url else "")
            await self._run_roles(self.discovery)
        finally:
            self._tg = None
            if self.leader is not None:
                self.leader.close()
            await self._close_apis()
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
                tg.create_task(self._roles(), name="role")
                tg.create_task(self._until_stopped(), name="stop")
                self.started.set()
        except BaseExceptionGroup as eg:
            _, rest = eg.split(_Stopped)
            if rest is not None:
                first = rest.exceptions[0]
                while isinstance(first, BaseExceptionGroup):
                    first = first.exceptions[0]
                raise first from None

    async def _roles(self) -> None:
        """Run the agent's role (leader: the demultiplexer and the coordinator; member: its control loop) until it
        changes (a takeover, a step-down), then the next one."""
        while True:
            self._role_changed.clear()
            try:
                async with asyncio.TaskGroup() as tg:
                    if self.coordinator is not None:
                        tg.create_task(self.leader.run(), name="leader-demux")
                        tg.create_task(self.coordinator.run(), name="coordinator")
                        # the replica's digests, while the members load their layers: the standby's ask waits less
                        self.spawn(self.replica.prepare(), name="replica-digests")
                    else:
                        tg.create_task(self.member.run(), name="member")
                    await self._role_changed.wait()
                    raise _RoleChanged
            except* _RoleChanged:
                pass

    # ================================================================================================ API

    def _proxy_app(self) -> web.Application:
        return create_proxy_app(self, api_key=self.cfg.api_key_text, cors=self.cfg.api_cors)

    async def _serve_api(self, app: web.Application, *, required: bool) -> None:
        """Serve ``app`` as this agent's API, on the port the one before it had (the replaced one finishes the
        replies it streams). A member's API that cannot bind is logged (it is a convenience); a leader's ends it."""
        cfg = self.cfg
        gate = Gate("API")
        app.middlewares.insert(0, gate.vouch_all)  # a connection that carries a request is vouched for (gate.py)
        runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                               keepalive_timeout=KEEPALIVE_TIMEOUT_S)
        await runner.setup()
        port = self._api[1] if self._api is not None else cfg.api_port
        try:
            port = await bind(runner, [cfg.api_host], port, gate=gate, reuse_port=True)
        except ConfigError as e:
            await runner.cleanup()
            if required:
                raise
            log.warning("no API on this agent: %s", e)
            return
        if self._api is not None:
            old = self._api[0]
            for site in list(old.sites):
                await site.stop()  # new connections go to the new app; open replies go on
            self._old_apis.append(old)
        self._api = (runner, port)
        self.api_url = f"http://{cfg.api_host}:{port}"

    def leader_url(self) -> str | None:
        """resume.LeaderLink: the agent URL of this agent's leader (its own while it leads)."""
        if self.coordinator is not None:
            return self.info.url
        leader = self.member.leader if self.member is not None else None
        return leader.url if leader is not None else None

    async def leader_change(self, url: str | None, timeout_s: float | None) -> str | None:
        """resume.LeaderLink: wait until this agent's leader is another than ``url``."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while self.leader_url() == url:  # noqa: ASYNC110 - the role changes in several places
                    await asyncio.sleep(LEADER_POLL_S)
        return self.leader_url()

    async def _http_relay(self, request: web.Request) -> web.StreamResponse:
        """A member's API forwards its clients' requests here (authenticated by the cluster's session): they go to
        this agent's own API while it leads."""
        if self.coordinator is None or self._api is None or self.coordinator.leaving:
            return not_leading()
        host = self.cfg.api_host if self.cfg.api_host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        headers = {"Authorization": f"Bearer {self.cfg.api_key_text}"} if self.cfg.api_key_text else None
        url = f"http://{host}:{self._api[1]}/{request.match_info['tail']}"
        return await forward(request, url, self._local_http, headers=headers)

    async def _leading(self, method: str, part: str, request: web.Request) -> web.StreamResponse:
        """A route of the leader's weight server or replica (served while this agent leads)."""
        server = self.weights if part == "weights" else self.replica
        if server is None or self.coordinator is None:
            raise web.HTTPServiceUnavailable(text="this agent does not lead the cluster")
        return await getattr(server, method)(request)

    async def _until_stopped(self) -> None:
        await self._stop.wait()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(BYE_TIMEOUT_S):
                await self._goodbye()
        await self._close_apis()  # while the role still runs: open replies get SHUTDOWN_TIMEOUT_S to finish
        raise _Stopped

    async def _close_apis(self) -> None:
        apis, self._old_apis = [*self._old_apis, *([self._api[0]] if self._api else [])], []
        self._api = None
        for api in apis:
            await api.cleanup()

    async def _goodbye(self) -> None:
        """A member says Bye to its leader; the leader to every member, handing over to its standby."""
        if self.coordinator is not None:
            u = self.coordinator.update
            if u is not None and u.standby:
                log.info("stopping: handing over to the standby %s", u.standby)
            await self.coordinator.goodbye(hand_over=True)
        elif self.member is not None:
            await self.member.goodbye()

    def spawn(self, coro, name: str | None = None) -> None:
        """Start a task owned by the agent's TaskGroup (dropped once the agent is stopping)."""
        wrapped = self._guarded(coro)
        try:
            if self._tg is None:
                raise RuntimeError("not running")
            task = self._tg.create_task(wrapped, name=name)
            if hasattr(coro, "close"):  # a task cancelled before it started never awaited its coroutine
                task.add_done_callback(lambda _: coro.close())
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
                "url": self.info.url, "api_url": self.api_url, "standby_ready": self.standby is not None}
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
        if self.info is None:
            raise web.HTTPServiceUnavailable(text="the agent is starting")
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
