"""A member's side of the control plane: find the leader, join, heartbeat, follow its plans.

    candidates (mDNS, static peers, a leader's invite) -> the oldest leader -> Hello -> Welcome
    every HEARTBEAT_INTERVAL_S: Heartbeat (stage state, counters, peers whose ring link broke) -> Ack
    PlanUpdate -> StageHost.prepare -> "loaded";  Activate -> StageHost.activate (or release) -> "ready"/"idle"

The leader is lost when it says Bye, its mDNS record goes, or it has not answered for HEARTBEAT_TIMEOUT_S; the
member then releases its stage and waits for a leader again. A leader that restarted and no longer knows the
member (``Ack.known`` false) gets a fresh Hello.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

from ..errors import PeerGone, ProtocolError
from ..pipeline.transport import LinkDown
from . import membership as membership_mod
from .control import Ack, Activate, Bye, ControlMessage, Heartbeat, Hello, PeerInfo, PlanUpdate, Refused, StageStatus
from .net import Net
from .stage_host import StageHost

log = logging.getLogger(__name__)

SEARCH_WAKE_S = 1.0  # without a leader, look at the candidates at least this often



class MemberControl:
    def __init__(self, info: PeerInfo, *, net: Net, stage_host: StageHost):
        self.info = info
        self.id = info.id
        self.net = net
        self.stage_host = stage_host
        self.candidates: dict[str, PeerInfo] = {}  # leaders of this cluster we know of
        self.leader: PeerInfo | None = None  # the one we joined
        self.latest_update: PlanUpdate | None = None
        self.suspects: set[str] = set()
        self._wake = asyncio.Event()

    # ------------------------------------------------------------------------------------------- events

    def peer_seen(self, info: PeerInfo) -> None:
        if info.role == "leader" and self.candidates.get(info.id) != info:
            self.candidates[info.id] = info
            self._wake.set()

    def peer_lost(self, agent_id: str) -> None:
        self.candidates.pop(agent_id, None)
        if self.leader is not None and agent_id == self.leader.id:
            self._wake.set()

    def link_down(self, ev: LinkDown) -> None:
        active = self.stage_host.active
        if active is not None and ev.epoch == active.epoch:
            self.suspects.add(ev.peer)  # told to the leader with the next heartbeat, sent at once
            self._wake.set()

    async def handle(self, msg: ControlMessage, sender: str | None = None) -> ControlMessage:
        """A control message to this member -> the reply. ``sender``: the agent that authenticated (None in the
        open mode); plans, activations and goodbyes count only from this member's leader."""
        if isinstance(msg, Hello):  # a leader that learned of us through a static peer
            if msg.peer.role == "leader" and msg.peer.cluster == self.info.cluster:
                self.peer_seen(msg.peer)
            return Ack()
        leader = self.leader
        if isinstance(msg, PlanUpdate):
            if leader is None or msg.leader.id != leader.id:
                raise ProtocolError("plan update from an agent that is not this member's leader")
            if self.latest_update is None or msg.epoch > self.latest_update.epoch:
                self.latest_update = msg
                self.stage_host.prepare(msg, self._report)
            return Ack(epoch=msg.epoch)
        if isinstance(msg, Activate):
            if leader is None:
                raise ProtocolError("activate without a leader")
            if sender is not None and sender != leader.id:
                raise ProtocolError("activate from an agent that is not this member's leader")
            self.net.spawn(self._activate(msg.epoch), name="activate")
            return Ack(epoch=msg.epoch)
        if isinstance(msg, Bye):
            if leader is not None and msg.agent_id == leader.id:
                log.warning("the leader %s stopped: %s", leader.id, msg.reason)
                self.peer_lost(leader.id)
            return Ack()
        raise ProtocolError(f"a member does not take {msg.kind!r} messages")

    async def _activate(self, epoch: int) -> None:
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
        if self.leader is not None:
            await self.net.post(self.leader.url, status)

    async def goodbye(self) -> None:
        if self.leader is not None:
            await self.net.post(self.leader.url, Bye(agent_id=self.id))

    # ---------------------------------------------------------------------------------------------- loop

    async def run(self) -> None:
        while True:
            leader = min(self.candidates.values(), key=lambda p: (p.started, p.id), default=None)
            if leader is None:
                await self._sleep(SEARCH_WAKE_S)
                continue
            try:
                reply = await self.net.post(leader.url, Hello(peer=self.info))
            except (PeerGone, ProtocolError) as e:
                reply, why = None, str(e)
            else:
                why = reply.reason if isinstance(reply, Refused) else ""
            if reply is None or isinstance(reply, Refused):
                log.warning("cannot join leader %s: %s", leader.id, why)
                self.candidates.pop(leader.id, None)
                await asyncio.sleep(membership_mod.HEARTBEAT_INTERVAL_S)
                continue
            self.leader = leader
            log.info("joined cluster %r: leader %s (%s) at %s", self.info.cluster, leader.id, leader.name, leader.url)
            try:
                await self._heartbeats(leader)
            finally:
                self.leader = None
                self.latest_update = None
            await self.stage_host.release()

    async def _heartbeats(self, leader: PeerInfo) -> None:
        """Heartbeat until the leader is lost (silent, removed, stopped) or has forgotten us."""
        last_ok = time.monotonic()
        while True:
            active = self.stage_host.active
            snap = self.stage_host.snapshot() or {}
            counters = {k: float(v) for k, v in snap.items()
                        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}
            beat = Heartbeat(agent_id=self.id, epoch=active.epoch if active else -1,
                             state="ready" if active and active.worker else "idle", counters=counters,
                             suspects=tuple(sorted(self.suspects)))
            self.suspects.clear()
            try:
                ack = await self.net.post(leader.url, beat)
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
            await self._sleep(membership_mod.HEARTBEAT_INTERVAL_S)

    async def _sleep(self, seconds: float) -> None:
        """Sleep, or less when something happened (a candidate, a lost leader, a broken link)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()
        self._wake.clear()
