"""The leader's control plane: membership, planning, and the two-phase switch from one plan epoch to the next.

    HTTP (Hello, Heartbeat, StageStatus, Bye), mDNS removals, broken ring links, timer ticks
        --> membership.apply  --debounced-->  planner.plan  --a new layout-->  Transition
    Transition, phase 1 "prepare":  PlanUpdate to every member; each stage loads its range ("loaded") while the
                                    old pipeline, if intact, keeps serving
               phase 2 "activate":  the request in flight may finish (DRAIN_TIMEOUT_S); the leader retires the
                                    old pipeline, moves its ring server to the new epoch and sends Activate; each
                                    stage starts its worker and links ("ready")
               "finish":            the leader opens the first hop and installs the new Pipeline

A departure from the serving ring breaks the pipeline at once (requests then wait or get 503, see leader.py) and
skips the debounce and the drain. Every epoch is a diff from the previous one (planner.diff); stages whose range
did not change keep their shard, and moved ranges share the blocks they already hold (stage_host.build_shard).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

from .. import env
from ..config import AgentConfig
from ..errors import FlowSpecError, PeerGone, PlanInfeasible, ProtocolError
from ..model.arch import ModelConfig
from ..pipeline.messages import PROTOCOL_VERSION
from ..pipeline.ring_server import RingServer
from ..pipeline.transport import LinkDown, RingHello
from . import membership as membership_mod
from .control import (
    Ack,
    Activate,
    Bye,
    ControlMessage,
    Heartbeat,
    Hello,
    LeaderPolicy,
    PeerInfo,
    PlanUpdate,
    Refused,
    RingNode,
    StageStatus,
    Welcome,
)
from .membership import Heard, Joined, Left, Membership, Planned, Tick
from .net import Net
from .planner import plan_requests
from .plans import ModelSizes, Plan, PlanOptions, diff, parallel_stations, render
from .replica import choose_standby
from .stage_host import StageHost, connect_with_retry, ws_url
from .view import cluster_view, plan_stages

log = logging.getLogger(__name__)

LEADER_PROBE_S = 1.5  # a new leader listens this long for an older leader of its cluster before it plans
INITIAL_PLAN_DELAY_S = 2.5  # the first plan waits for agents started at the same time
TICK_S = 0.1  # the membership clock
PROBE_TIMEOUT_S = 1.0  # a peer whose ring link broke must answer GET /control/info within this
LOAD_TIMEOUT_S = 300.0  # phase 1: a member that has not loaded its range by then is left out
ACTIVATE_TIMEOUT_S = 30.0  # phase 2: a member that has not opened its links by then is left out
TAKEOVER_JOIN_S = 2.0  # a standby that took over plans this long after, or once the lost leader's members joined
DRAIN_TIMEOUT_S = 20.0  # a join lets the request in flight finish for at most this long before switching
MAX_MEMBERS = 256  # members a leader takes; a Hello beyond this is refused
STALL_MIN_S = 15.0  # a stage whose forward has run this long, and STALL_FACTOR times its slowest recent one, stalled
STALL_FACTOR = 20.0


def stall_bound(slowest_s: float) -> float:
    """Seconds a stage's forward may run before the leader counts the stage as stalled, from the busy time of the
    slowest of its recent forwards (worker.RECENT_FORWARDS)."""
    return max(STALL_MIN_S, STALL_FACTOR * slowest_s)



@dataclass
class Transition:
    """A re-plan in progress."""

    update: PlanUpdate
    trigger: str
    started: float
    ring: set[str]  # agent ids holding layers in the new plan
    deadline: float  # of the current phase
    starts: dict[str, float]  # PeerInfo.started of each ring member: a restarted member breaks the ring
    loaded: set[str] = field(default_factory=set)
    ready: set[str] = field(default_factory=set)
    phase: str = "prepare"
    marks: dict[str, float] = field(default_factory=dict)  # when each phase began (time.monotonic())

    @property
    def epoch(self) -> int:
        return self.update.epoch


class Coordinator:
    def __init__(self, cfg: AgentConfig, info: PeerInfo, *, net: Net, leader, weights, stage_host: StageHost,
                 ring: RingServer, session, model: ModelSizes, model_config: ModelConfig,
                 wire_dtype: Callable[[str], object], takeover: PlanUpdate | None = None, takeover_why: str = "lost",
                 successor: str = "", on_successor: Callable[[PeerInfo], None] | None = None,
                 on_standby: Callable[[str], None] | None = None):
        """``takeover``: the lost leader's last plan, when this agent takes over from it (its members are known
        at once, and the first plan is made as soon as they joined, within TAKEOVER_JOIN_S); ``takeover_why``: how
        that leader went ("lost", or "stopped": it handed over), for the plan history. ``successor``: the
        identity of the standby this leader named before (kept across restarts); ``on_successor(info)``: called
        when that standby claims to lead (it took over: this agent steps down to be its member); ``on_standby``:
        told the identity of each new plan's standby (the agent keeps it across restarts)."""
        self.cfg = cfg
        self.info = info
        self.id = info.id
        self.net = net
        self.leader = leader  # leader.Leader
        self.weights = weights  # weight_server.WeightServer
        self.stage_host = stage_host
        self.ring = ring
        self.session = session
        self.model = model
        self.model_config = model_config
        self.wire_dtype = wire_dtype
        self.options = PlanOptions(tokens_per_step=cfg.planning.tokens_per_step, stages=cfg.planning.stages,
                                   leader_layers=cfg.planning.leader_layers)
        self.membership = Membership(self_info=info)
        self.plan: Plan | None = None
        self.requests = 1  # requests in flight the latest plan holds KV for (planner.plan_requests)
        self.update: PlanUpdate | None = None  # of the serving epoch
        self.epoch = 0  # last epoch started
        self.transition: Transition | None = None
        self.planning = False  # a plan is being computed (or its transition set up)
        self.broken: str | None = None  # why the serving pipeline is unusable
        self.no_plan: str | None = None  # why the latest planning found no plan ("no plan: short by N MB: ...")
        self.broken_at = 0.0
        self.ring_starts: dict[str, float] = {}
        self.statuses: dict[str, StageStatus] = {}
        self.counters: dict[str, dict] = {}
        self.recoveries: list[dict] = []
        self.serving = asyncio.Event()
        self._rivals: set[str] = set()  # other leaders' claims seen (each logged once)
        self.takeover = takeover
        self.takeover_why = takeover_why
        self.leaving = False  # goodbye() was said: no member joins any more
        self.created = time.monotonic()
        self.successor = successor  # the identity of the standby of the latest plan
        self.on_successor = on_successor
        self.on_standby = on_standby
        self._awaiting: set[str] = set()  # (takeover) members of the lost leader's plan that have not joined yet
        if takeover is not None:
            self.epoch = takeover.epoch
            now = time.monotonic()
            for m in takeover.members:
                if m.id not in (self.id, takeover.leader.id):
                    self.membership = membership_mod.apply(self.membership, Joined(info=m, at=now))
                    self._awaiting.add(m.id)

    # ------------------------------------------------------------------------------------------- events

    def apply(self, event) -> None:
        """Apply a membership event; a departure from the serving ring breaks the pipeline at once."""
        before = self.membership
        self.membership = membership_mod.apply(before, event)
        gone = set(before.members) - set(self.membership.members)
        for aid in gone:  # maps keyed by member are freed when it leaves
            self.statuses.pop(aid, None)
            self.counters.pop(aid, None)
        if self.plan is not None and gone & set(self.plan.agents) and self.broken is None:
            self._break(f"{', '.join(sorted(gone))} left")

    def _break(self, why: str) -> None:
        self.broken, self.broken_at = why, time.monotonic()
        self.net.spawn(self.leader.set_pipeline(None), name="unset-pipeline")
        log.warning("pipeline broken: %s; re-planning", why)

    async def handle(self, msg: ControlMessage) -> ControlMessage:
        """A control message to the leader -> the reply."""
        now = time.monotonic()
        if isinstance(msg, Hello):
            peer = msg.peer
            if self.leaving:
                return Refused(reason=f"leader {self.id} is stopping", leader=self.info)
            if peer.cluster != self.cfg.cluster:
                return Refused(reason=f"this leader serves cluster {self.cfg.cluster!r}", leader=self.info)
            if peer.role == "leader":
                log.warning("refused a second leader %s at %s (pid %d)", peer.id, peer.url, peer.pid)
                return Refused(reason=f"cluster {self.cfg.cluster!r} already has a leader: agent {self.id} at "
                                      f"{self.info.url}, pid {self.info.pid}", leader=self.info)
            if peer.id not in self.membership.members and len(self.membership.members) >= MAX_MEMBERS:
                return Refused(reason=f"cluster {self.cfg.cluster!r} already has {MAX_MEMBERS} members",
                               leader=self.info)
            if peer.id not in self.membership.members:
                log.info("member %s (%s) joined from %s: %.1f GFLOP/s, %.0f MB", peer.id, peer.name, peer.url,
                         peer.profile.gflops, peer.profile.memory_bytes / 2**20)
            self.apply(Joined(info=peer, at=now))
            self._awaiting.discard(peer.id)
            return Welcome(leader=self.info, epoch=self.epoch)
        if isinstance(msg, Heartbeat | StageStatus) and msg.agent_id not in self.membership.members:
            return Ack(epoch=self.epoch, known=False)
        if isinstance(msg, Heartbeat):
            self.apply(Heard(agent_id=msg.agent_id, at=now, epoch=msg.epoch, state=msg.state))
            self.counters[msg.agent_id] = msg.counters
            self._check_stall(msg, now)
            for s in msg.suspects:
                self.net.spawn(self.probe(s, f"{msg.agent_id} lost its link"), name="probe")
            return Ack(epoch=self.epoch)
        if isinstance(msg, StageStatus):
            self.on_status(msg)
            return Ack(epoch=self.epoch)
        if isinstance(msg, Bye):
            if msg.agent_id in self.membership.members:
                log.info("member %s left: %s", msg.agent_id, msg.reason)
                self.apply(Left(agent_id=msg.agent_id, at=now, reason="bye"))
            return Ack(epoch=self.epoch)
        raise ProtocolError(f"a leader does not take {msg.kind!r} messages")

    def _check_stall(self, beat: Heartbeat, now: float) -> None:
        """A serving stage whose forward has run past its stall bound (its compute hung with its sockets open) is
        marked failed and planned around; the request in flight resumes on the new plan (membership retries the
        member later, while it keeps answering)."""
        running = beat.counters.get("forward_running_s", 0.0)
        slowest = beat.counters.get("forward_slowest_s", 0.0)
        member = self.membership.members.get(beat.agent_id)
        if self.plan is None or beat.agent_id not in self.plan.agents or member is None or member.failed:
            return
        if running <= stall_bound(slowest):
            return
        self.apply(Heard(agent_id=beat.agent_id, at=now, epoch=self.epoch, state="failed"))
        if not self.membership.members[beat.agent_id].failed:
            return  # already counted for this epoch
        log.error("member %s stalled: a forward has run %.3g s (bound %.1f s from its slowest recent one, %.2f s); "
                  "planning around it", beat.agent_id, running, stall_bound(slowest), slowest)
        if self.broken is None and self.transition is None:
            self._break(f"{beat.agent_id} stalled")

    def peer_seen(self, info: PeerInfo, via: str) -> None:
        """Discovery found ``info``. Another leader's claim, older or not, never ends this one (a holder of the key
        could make any claim): it is logged once, and members that follow this leader keep doing so."""
        if info.role == "leader":
            if self.successor and info.identity == self.successor and self.on_successor is not None:
                log.warning("leader %s (%s), this leader's standby, took over and leads now", info.id, info.name)
                self.on_successor(info)
                return
            if info.id not in self._rivals:
                self._rivals.add(info.id)
                older = (info.started, info.id) < (self.info.started, self.info.id)
                log.warning("another leader of cluster %r claims to lead: agent %s (%s) at %s, identity %s%s; this "
                            "leader keeps serving (its members follow it by identity)", self.cfg.cluster, info.id,
                            info.name, info.url, info.identity[:12], ", started earlier" if older else "")
        elif via == "static" and info.id not in self.membership.members:
            self.net.spawn(self.net.post(info.url, Hello(peer=self.info)), name="invite")  # tell it where we are

    def peer_lost(self, agent_id: str) -> None:
        if agent_id in self.membership.members:
            log.info("member %s left (mDNS removal)", agent_id)
            self.apply(Left(agent_id=agent_id, at=time.monotonic(), reason="mdns"))

    def link_down(self, ev: LinkDown) -> None:
        """A ring link of the serving epoch closed outside a switch: is its peer still there?"""
        t = self.transition
        if self.update is None or ev.epoch != self.update.epoch or (t is not None and t.phase != "prepare"):
            return
        self.net.spawn(self.probe(ev.peer, f"ring link {ev.direction} {ev.reason}"), name="probe")

    async def probe(self, agent_id: str, why: str) -> None:
        m = self.membership.members.get(agent_id)
        if m is None:
            return
        info = await self.net.fetch_info(m.info.host, m.info.port, PROBE_TIMEOUT_S)
        if info is None or info.started != m.info.started:
            log.warning("member %s is gone (%s)", agent_id, why)
            self.apply(Left(agent_id=agent_id, at=time.monotonic(), reason="link"))
        elif self.broken is None and self.transition is None:
            self._break(f"ring link to {agent_id} broke")  # alive, but the ring must be rebuilt

    def set_info(self, info: PeerInfo) -> None:
        """This leader's PeerInfo changed (its API's address is known)."""
        self.info = info
        self.membership = replace(self.membership, self_info=info)

    async def goodbye(self, reason: str = "stopping", *, hand_over: bool = False) -> None:
        """Tell every member this leader goes; with ``hand_over``, that the serving plan's standby takes over (it
        leads as when this leader is lost, and the members turn to it). No agent joins this leader after."""
        self.leaving = True
        successor = self.update.standby if hand_over and self.update is not None else ""
        bye = Bye(agent_id=self.id, reason=reason, successor=successor)
        await asyncio.gather(*(self.net.post(m.info.url, bye) for m in self.membership.members.values()),
                             return_exceptions=True)

    # ------------------------------------------------------------------------------------------ planning

    async def run(self) -> None:
        if self.takeover is not None:  # the lost leader's members are on their way: plan once they are here
            first_plan_at = time.monotonic() + TAKEOVER_JOIN_S
        else:
            await asyncio.sleep(LEADER_PROBE_S)  # members of an agent that restarts find it meanwhile
            first_plan_at = time.monotonic() + max(0.0, INITIAL_PLAN_DELAY_S - LEADER_PROBE_S)
        infeasible = None
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            self.apply(Tick(at=now))
            self._check_deadline(now)
            if now < first_plan_at and (self.takeover is None or self._awaiting):
                continue
            changed = membership_mod.needs_replan(self.membership, now)
            first = self.plan is None and self.transition is None
            rebuild = self.broken is not None and self.transition is None
            if not (changed or first or rebuild):
                continue
            self.membership = membership_mod.apply(self.membership, Planned(at=now))
            self.planning = True  # until the new plan is kept or its transition has started
            try:
                new, self.requests = await asyncio.to_thread(
                    partial(plan_requests, requests=self.cfg.max_requests), membership_mod.devices(self.membership),
                    self.model, self.options)
                infeasible = self.no_plan = None
                if self._can_keep(new):
                    self.plan = new
                else:
                    await self._start(new, now)
            except PlanInfeasible as e:
                if str(e) != infeasible:
                    log.error("no plan: %s", e)
                infeasible, self.no_plan = str(e), f"no plan: {e}"
            except (ArithmeticError, ValueError, KeyError, TypeError) as e:  # the planner must not end the leader
                if str(e) != infeasible:
                    log.exception("no plan: the planner failed on these members")
                infeasible = str(e)
            finally:
                self.planning = False

    def _can_keep(self, new: Plan) -> bool:
        if self.plan is None or self.broken is not None or self.transition is not None:
            return False
        for aid, started in self.ring_starts.items():
            m = self.membership.members.get(aid)
            if aid != self.id and (m is None or m.info.started != started):
                return False  # it restarted: its stage state is gone
        return not diff(self.plan, new)

    async def _start(self, new: Plan, now: float) -> None:
        self.epoch += 1
        members = self.membership.members
        infos = {s.agent_id: self.info if s.agent_id == self.id else members[s.agent_id].info for s in new.stages}
        nodes = []
        for s in new.stages:
            fp = await asyncio.to_thread(self.weights.range_fingerprint, s.layers, embed=s.embed, norm=s.head)
            info = infos[s.agent_id]
            nodes.append(RingNode(agent_id=s.agent_id, host=info.host, port=info.port, layers=s.layers,
                                  embed=s.embed, head=s.head, fingerprint=fp, identity=info.identity))
        cfg = self.cfg
        infos_all = {aid: m.info for aid, m in members.items() if not m.failed}
        standby = choose_standby(new, infos_all, self.model, self.id)
        p = cfg.planning
        policy = LeaderPolicy(context=p.context, stages=p.stages, leader_layers=p.leader_layers,
                              decoding=cfg.decoding, max_requests=cfg.max_requests)
        update = PlanUpdate(cluster=cfg.cluster, epoch=self.epoch, leader=self.info, plan=new, ring=tuple(nodes),
                            config=self.model_config, model_fingerprint=self.model.fingerprint,
                            context=self.leader.settings.stage_capacity, dtype=cfg.dtype,
                            engine=self.leader.head.engine.name, wire_dtype=cfg.wire_dtype,
                            max_requests=self.requests, standby=standby, members=tuple(infos_all.values()),
                            policy=policy)
        if standby and infos_all[standby].identity != self.successor:
            self.successor = infos_all[standby].identity
            if self.on_standby is not None:
                self.on_standby(self.successor)
        departed = ", ".join(f"{a} ({r})" for a, r in self.membership.departed)
        trigger = self.broken or (f"departed: {departed}" if departed else "membership changed")
        started = self.broken_at if self.broken else now
        if self.takeover is not None and self.plan is None:
            lost = self.takeover.leader
            trigger, started = f"took over from leader {lost.id} ({lost.name}), {self.takeover_why}", self.created
        self.transition = Transition(update=update, trigger=trigger, started=started, ring=set(new.agents),
                                     deadline=now + LOAD_TIMEOUT_S,
                                     starts={a: i.started for a, i in infos.items()}, marks={"planned": now})
        changes = "; ".join(str(c) for c in diff(self.plan, new))
        log.info("epoch %d: %d stage(s) (%s): %s\n%s", self.epoch, len(new.stages), trigger, changes, render(new))
        for m in list(members.values()):
            self.net.spawn(self._send_plan(m.info, update), name="plan-update")
        self.stage_host.prepare(update, self.on_status)

    async def _send_plan(self, info: PeerInfo, update: PlanUpdate) -> None:
        try:
            await self.net.post(info.url, update)
        except (PeerGone, ProtocolError) as e:
            log.warning("member %s did not take plan %d: %s", info.id, update.epoch, e)
            if info.id in update.plan.agents:
                self.apply(Left(agent_id=info.id, at=time.monotonic(), reason="unreachable"))

    def on_status(self, status: StageStatus) -> None:
        """A stage's progress through the transition (members over HTTP, the leader's own stage directly)."""
        self.statuses[status.agent_id] = status
        if status.agent_id != self.id:
            self.apply(Heard(agent_id=status.agent_id, at=time.monotonic(), epoch=status.epoch, state=status.state))
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
            t.marks["loaded"] = time.monotonic()
            t.deadline = t.marks["loaded"] + DRAIN_TIMEOUT_S + ACTIVATE_TIMEOUT_S
            self.net.spawn(self._activate(t), name="activate")
        elif t.phase == "activate" and t.ready >= t.ring:
            t.phase = "finish"
            self.net.spawn(self._finish(t), name="finish")

    def _check_deadline(self, now: float) -> None:
        t = self.transition
        if t is None or now <= t.deadline:
            return
        late = (t.ring - (t.loaded if t.phase == "prepare" else t.ready)) - {self.id}
        for aid in late:
            log.error("epoch %d: %s did not get %s in time; leaving it out", t.epoch, aid,
                      "its layers loaded" if t.phase == "prepare" else "its links up")
            self.apply(Heard(agent_id=aid, at=now, state="failed"))
        t.deadline = now + LOAD_TIMEOUT_S  # the re-plan that follows supersedes this one

    async def _activate(self, t: Transition) -> None:
        if self.broken is None:  # the old pipeline still serves: let the request in flight finish
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(DRAIN_TIMEOUT_S):
                    await self.leader.idle.wait()
        if self.transition is not t:
            return
        await self.leader.set_pipeline(None)
        last = t.update.ring[-1].agent_id
        self.ring.allowed = lambda hello, last=last: hello.sender == last
        self.ring.wire_dtype = t.update.wire_dtype
        await self.ring.set_epoch(t.epoch)
        act = Activate(epoch=t.epoch)
        for m in list(self.membership.members.values()):
            self.net.spawn(self.net.post(m.info.url, act), name="activate")
        self.on_status(await self.stage_host.activate(t.epoch))

    async def _finish(self, t: Transition) -> None:
        from ..decoding.context import Pipeline

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
                                                  self.stage_host.link, self.wire_dtype(u.wire_dtype),
                                                  wanted=lambda: self.transition is t)
        except PeerGone as e:
            log.error("epoch %d: cannot reach stage 1 (%s): %s", u.epoch, first.agent_id, e)
            self.apply(Heard(agent_id=first.agent_id, at=time.monotonic(), state="failed"))
            return
        if self.transition is not t:
            await sender.close()
            return
        info = {"plan": [f"{s.agent_id} {s.layers}" for s in u.plan.stages],
                "emulation": self.stage_host.link.describe()}
        await self.leader.set_pipeline(Pipeline(sender, takes="tokens", epoch=u.epoch, stages=len(u.ring), info=info,
                                                parallel=parallel_stations(
                                                    [n.host for n in u.ring], self.info.host,
                                                    any(n.agent_id == self.id for n in u.ring),
                                                    self.cfg.emulation.enabled, env.physical_cores()),
                                                max_requests=u.max_requests))
        now = time.monotonic()
        took = now - t.started
        self.plan, self.update, self.transition, self.broken = u.plan, u, None, None
        self.ring_starts = t.starts
        planned, loaded = t.marks["planned"], t.marks.get("loaded", now)
        record = {"epoch": u.epoch, "trigger": t.trigger, "leader": self.id, "standby": u.standby,
                  "seconds": round(took, 3),
                  "detect_plan_s": round(planned - t.started, 3), "load_s": round(loaded - planned, 3),
                  "switch_s": round(now - loaded, 3), "at": time.time(), "stages": plan_stages(u.plan)}
        self.recoveries = [*self.recoveries[-19:], record]
        self.serving.set()
        log.info("epoch %d serving on %d stage(s), %.2f s after: %s", u.epoch, len(u.ring), took, t.trigger)

    # ------------------------------------------------------------------------------------------------ view

    def view(self) -> dict:
        """GET /cluster (view.py)."""
        return cluster_view(self)
