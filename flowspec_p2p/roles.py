"""An agent's roles and how it changes between them (a part of ``Agent``, agent.py).

    leader    plans (cluster/coordinator.py), serves the weights, the replica and the API (``_become_leader``)
    member    joins the oldest leader of its cluster, heartbeats to it and hosts whatever stage the plan gives it
              (cluster/member.py; ``_become_member``)
    standby   the member a plan names to take over: it fetches a replica of the model files once its own layers
              are loaded and loads the leader's parts ahead of need (cluster/replica.py, cluster/leading.py;
              ``_prepare_standby``)

Another leader's claim never stops a leader: members follow their leader by identity (member.py).

Failover. When the leader is lost, or stops and hands over (its Bye names the standby), the standby takes over
(``_take_over``): it becomes the leader in place -- its stage, its API port and its mDNS name stay, its role, API
and advert change -- and plans over the lost leader's members, which turn to it. A leader that comes back
(restarted, or a frozen one that thaws) and finds the standby it named leading steps down and joins it
(``_step_down``; the standby it named is kept across restarts in SUCCESSION_FILE).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path

from .api.app import create_app
from .api.catalog import served_model
from .cluster import replica as replica_mod
from .cluster.control import Hello, PeerInfo, PlanUpdate
from .cluster.coordinator import Coordinator
from .cluster.leading import LeaderParts, load_leader_parts
from .cluster.leading import modes as _modes
from .cluster.member import MemberControl
from .cluster.stage_host import TapQueue
from .cluster.telemetry import StageTimelines
from .cluster.weight_server import WeightServer
from .config import AgentConfig
from .decoding.context import ThreadCompute
from .decoding.leader import Leader
from .decoding.settings import LeaderSettings
from .errors import FlowSpecError
from .model.registry import aliases
from .model.weights import model_fingerprint, open_source
from .pipeline.codec import wire_dtype
from .pipeline.emulation import EmulatedCompute

log = logging.getLogger(__name__)

SUCCESSION_FILE = "succession.json"  # the standby this agent named as leader (it steps down to it when it leads)
STANDBY_DELAY_MAX_S = 120.0  # a standby fetches its replica once its own layers are loaded, or after this


class Roles:
    """The role-changing part of ``Agent`` (a mixin: it works on the agent's state -- cfg, info, stage_host,
    leader, coordinator, member, standby, ... -- and calls its API, discovery and task methods)."""

    async def _become_leader(self, parts: LeaderParts, cfg: AgentConfig, *, takeover: PlanUpdate | None = None,
                             takeover_why: str = "lost", successor: str = "") -> None:
        """Lead with ``parts``: the Leader, the weight and replica servers, the coordinator, the leader's API."""
        self.source, self.model_fp = parts.source, parts.fingerprint
        settings = LeaderSettings(max_context=cfg.planning.context, wire_dtype=cfg.wire_dtype,
                                  default_mode=cfg.decoding)
        compute = ThreadCompute()
        if cfg.emulation.slowdown > 1.0:
            compute = EmulatedCompute(compute, cfg.emulation.slowdown)
        leader = Leader(parts.head, parts.tokenizer, drafter=parts.drafter, settings=settings,
                        modes=_modes(cfg.flowspec), model_id=parts.model_id, compute=compute)
        leader.inbox = TapQueue(self._on_link_down)  # the ring's return path delivers here
        self.weights = WeightServer(parts.source)
        self.replica = replica_mod.ReplicaServer(Path(parts.source.path), parts.fingerprint, parts.draft_stem)
        self.info = self.info.model_copy(update={"role": "leader", "model": parts.fingerprint})
        coordinator = Coordinator(cfg, self.info, net=self, leader=leader, weights=self.weights,
                                  stage_host=self.stage_host, ring=self.ring, session=self.session,
                                  model=parts.model, model_config=parts.source.config, wire_dtype=wire_dtype,
                                  takeover=takeover, takeover_why=takeover_why, successor=successor,
                                  on_successor=self._on_successor, on_standby=self._record_successor)
        app = create_app(leader, coordinator.view, run_leader=False, api_key=cfg.api_key_text, cors=cfg.api_cors,
                         timelines=StageTimelines(coordinator, self.stage_host, self.session),
                         served=served_model(parts.source, [parts.model_id, *aliases(parts.source.path)],
                                             context=cfg.planning.context, digest=parts.fingerprint,
                                             tokenizer=parts.tokenizer))
        await self._serve_api(app, required=True)
        self.info = self.info.model_copy(update={"api_url": self.api_url or ""})
        coordinator.set_info(self.info)
        self.ring.inbox = leader.inbox
        self.stage_host.leader_inbox = leader.inbox
        self.stage_host.shared = (parts.fingerprint, [parts.head])  # the leader's first stage shares the embedding
        self.leader, self.coordinator, self.member = leader, coordinator, None

    def _become_member(self, *, trusted=(), successor: PeerInfo | None = None) -> None:
        self.info = self.info.model_copy(update={"role": "member", "api_url": self.api_url or ""})
        self.member = MemberControl(self.info, net=self, stage_host=self.stage_host, trusted=trusted,
                                    on_takeover=self._on_takeover, on_plan=self._on_plan)
        if successor is not None:
            self.member.peer_seen(successor)

    def _on_plan(self, update: PlanUpdate) -> None:
        """A member took its leader's plan: the plan's standby gets ready to lead."""
        if update.standby != self.id or (self.standby is not None and self.standby.fingerprint == \
                update.model_fingerprint):
            return
        if not self._preparing:
            self._preparing = True
            self.spawn(self._prepare_standby(update), name="standby")

    async def _prepare_standby(self, update: PlanUpdate) -> None:
        """Fetch a replica of the leader's model (unless this agent holds the same model) and load the leader's
        parts from it, ahead of need."""
        try:
            # once this agent's own layers of the plan are loaded (it fetched them), while the plan is put into
            # service: the replica does not take the link this agent's layers come over
            async with asyncio.timeout(STANDBY_DELAY_MAX_S):
                while not self._loaded(update.epoch):  # noqa: ASYNC110 - the stage host's state
                    await asyncio.sleep(0.1)
        except TimeoutError:
            pass
        t0 = time.perf_counter()
        try:
            draft = None
            if self.source is not None and self.model_fp == update.model_fingerprint:
                source = self.source
            else:
                got = await replica_mod.fetch_replica(self.session, update.leader.url, self.cfg.state_path,
                                                      update.model_fingerprint)
                source = await asyncio.to_thread(open_source, got.model)
                fp = await asyncio.to_thread(model_fingerprint, source)
                if fp != update.model_fingerprint:
                    raise FlowSpecError(f"the replica is model {fp[:12]}, not the plan's "
                                        f"{update.model_fingerprint[:12]}")
                draft = got.draft
            cfg = self._leading_config(update)
            self.standby = await asyncio.to_thread(load_leader_parts, cfg, source, update.model_fingerprint,
                                                   tokenizer=self._tokenizer, draft=draft)
            if self.stage_host.local_source is None:  # this agent's layers of later plans load from the replica
                self.stage_host.local_source = source
            log.info("standby: ready to lead (replica and the leader's parts loaded in %.2f s)",
                     time.perf_counter() - t0)
            self._write_state()  # agent.json says so (LocalCluster.wait_standby: benchmarks start on a settled cluster)
            if self.member is not None:
                self.member.ready_to_lead()  # the leader may have been lost meanwhile
        except (FlowSpecError, OSError) as e:
            log.warning("standby: cannot get ready to lead: %s", e)
        finally:
            self._preparing = False

    def _loaded(self, epoch: int) -> bool:
        """This agent's stage has loaded its layers of plan ``epoch`` (or a later one), or serves it."""
        host = self.stage_host
        return any(x is not None and x.epoch >= epoch for x in (host.prepared, host.active))

    def _leading_config(self, update: PlanUpdate) -> AgentConfig:
        """This agent's configuration to lead as the leader of ``update`` did."""
        cfg = self.cfg
        p = update.policy
        # the stage count is the planner's again: the lost leader's may not fit the agents that are left
        planning = cfg.planning if p is None else cfg.planning.model_copy(
            update={"context": p.context, "stages": None, "leader_layers": p.leader_layers})
        return cfg.model_copy(update={"leader": True, "dtype": update.dtype, "wire_dtype": update.wire_dtype,
                                      "planning": planning, "decoding": p.decoding if p else cfg.decoding,
                                      "max_requests": p.max_requests if p else cfg.max_requests})

    def _on_takeover(self, update: PlanUpdate, why: str) -> bool:
        """The leader of ``update`` is gone (``why``: "lost", or "stopped": it handed over) and this agent is its
        standby: take over when ready (not while this agent stops too)."""
        if self._stop.is_set():
            return False
        parts = self.standby
        if parts is None or parts.fingerprint != update.model_fingerprint:
            log.error("leader %s is lost and this agent is its standby, but not ready to lead (its replica is "
                      "still on its way); waiting for a leader", update.leader.id)
            return False
        self.spawn(self._take_over(update, parts, why), name="take-over")
        return True

    async def _take_over(self, update: PlanUpdate, parts: LeaderParts, why: str) -> None:
        t0 = time.perf_counter()
        lost = update.leader
        log.warning("taking over from leader %s (%s), %s: this agent leads cluster %r now", lost.id, lost.name, why,
                    self.cfg.cluster)
        cfg = self._leading_config(update)
        self.cfg = cfg
        self.standby = None
        await self._become_leader(parts, cfg, takeover=update, takeover_why=why)
        self._role_changed.set()
        await self.discovery.update(self.info)
        self._write_state()
        for m in update.members:  # tell the lost leader's members at once (they check on it themselves)
            if m.id not in (self.id, lost.id):
                self.spawn(self.post(m.url, Hello(peer=self.info)), name="invite")
        log.info("took over in %.2f s; planning over the lost leader's members", time.perf_counter() - t0)

    def _on_successor(self, info: PeerInfo) -> None:
        """The standby this leader named leads now: it took over while this agent was gone or frozen (or, while
        this agent stops, because it handed over: then this agent goes, and starts as that standby's member)."""
        if not self._stop.is_set():
            self.spawn(self._step_down(info), name="step-down")

    async def _step_down(self, new_leader: PeerInfo) -> None:
        if self.coordinator is None:
            return
        log.warning("stepping down: this agent joins leader %s (%s) as a member", new_leader.id, new_leader.name)
        old = self.coordinator
        await old.goodbye(f"stepping down: {new_leader.id} leads now")
        await self.leader.set_pipeline(None)
        self.coordinator = None
        self.ring.inbox = self.stage_host.leader_inbox = None  # a member's stage owns its ring server again
        self._become_member(trusted=(new_leader.identity,), successor=new_leader)
        self._role_changed.set()
        await self._serve_api(self._proxy_app(), required=False)
        self.info = self.info.model_copy(update={"api_url": self.api_url or ""})
        self.member.info = self.info
        await self.discovery.update(self.info)
        self._write_state()
        with contextlib.suppress(OSError):
            (self.cfg.state_path / SUCCESSION_FILE).unlink()

    def _recorded_successor(self) -> str:
        """The identity of the standby this agent named when it led before (it may lead now)."""
        try:
            return json.loads((self.cfg.state_path / SUCCESSION_FILE).read_text()).get("identity", "")
        except (OSError, ValueError, AttributeError):
            return ""

    def _record_successor(self, identity: str) -> None:
        with contextlib.suppress(OSError):
            (self.cfg.state_path / SUCCESSION_FILE).write_text(json.dumps({"identity": identity}) + "\n")
