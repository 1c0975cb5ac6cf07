"""A member's side of the control plane: find the leader, join, heartbeat, follow its plans.

    candidates (mDNS, static peers, a leader's invite) -> the oldest leader -> Hello -> Welcome
    every HEARTBEAT_INTERVAL_S: Heartbeat (stage state, counters, peers whose ring link broke) -> Ack
    PlanUpdate -> StageHost.prepare -> "loaded";  Activate -> StageHost.activate (or release) -> "ready"/"idle"

The leader is lost when it says Bye, its mDNS record goes, or it has not answered for HEARTBEAT_TIMEOUT_S; the
member then releases its stage and waits for a leader again. A leader that restarted and no longer knows the
member (``Ack.known`` false) gets a fresh Hello. Nothing a peer does ends the member: a report its leader does not
take is logged, and the member carries on.

Failover. Every plan names a standby (replica.py). When the leader is lost, or stops and hands over (its Bye names
the standby; a Bye that names none is a cluster stopping on purpose: nobody takes over), its standby takes over
(``on_takeover``: the agent promotes itself) and every other member turns to it at once: it trusts the identity its
leader's plan named, keeps its stage (the new plan mostly keeps its range), and asks to join every
SUCCESSOR_RETRY_S until the standby leads (the leader that said Bye is not joined again until it restarts). A
closed ring link to the leader, or the standby's word (or, to the standby, a member's), makes a member probe its
leader at once instead of waiting for the heartbeats. While the standby does not lead (it finds the leader there),
a member rechecks the leader it found lost every RECHECK_S and joins it again when it answers: it was slow.

Trust. A member joins only leaders whose identity it trusts (``trusted``): the one it was told
(``--leader-identity`` / $FLOWSPEC_LEADER_IDENTITY, printed next to the key by the leader), else the first leader
it joins (then pinned). Plans, activations and goodbyes count only from the identity of the leader it joined: a
holder of the cluster key cannot hand it a plan, weights or ring links in the leader's name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable

from ..errors import PeerGone, ProtocolError
from ..pipeline.transport import LinkDown
from . import membership as membership_mod
from .control import (
    Ack,
    Activate,
    Bye,
    ControlMessage,
    Heartbeat,
    Hello,
    PeerInfo,
    PlanUpdate,
    Refused,
    StageStatus,
    Welcome,
)
from .guard import Peer
from .net import Net
from .stage_host import StageHost

log = logging.getLogger(__name__)

SEARCH_WAKE_S = 1.0  # without a leader, look at the candidates at least this often
PROBE_TIMEOUT_S = 1.0  # a leader suspected gone (its ring link closed) must answer GET /control/info within this
SUCCESSOR_RETRY_S = 0.2  # how often the lost leader's standby is asked to take this member, until it leads
RECHECK_S = 1.0  # ... and how often, meanwhile, whether the leader found lost answers after all
TAKEOVER_WAIT_S = 60.0  # ... for at most this long (a standby still fetching its replica gets ready meanwhile)



class MemberControl:
    def __init__(self, info: PeerInfo, *, net: Net, stage_host: StageHost, trusted: Iterable[str] = (),
                 on_takeover: Callable[[PlanUpdate, str], bool] | None = None,
                 on_plan: Callable[[PlanUpdate], None] | None = None):
        """``trusted``: identities of leaders this member may join (empty: the first it joins, then that one).
        ``on_takeover(update, why)``: the leader of ``update`` is gone ("lost", or "stopped": it handed over) and
        this member is its standby; True when the agent takes over (this member then stops looking for a leader).
        ``on_plan(update)``: each plan taken."""
        self.info = info
        self.id = info.id
        self.net = net
        self.stage_host = stage_host
        self.trusted: set[str] = {t for t in trusted if t}
        self.on_takeover = on_takeover
        self.on_plan = on_plan
        self.candidates: dict[str, PeerInfo] = {}  # leaders of this cluster we know of
        self.leader: PeerInfo | None = None  # the one we joined
        self.latest_update: PlanUpdate | None = None  # of the leader we joined
        self.last_update: PlanUpdate | None = None  # the latest plan of any leader (names the standby)
        self.suspects: set[str] = set()
        self.lost_at: float | None = None  # when the last leader was found lost (time.monotonic())
        self.taking_over = False
        self._successor: tuple[str, float] | None = None  # (standby's id, until when it is waited for)
        self._alternate = False
        self._suspect_leader = False
        self._left_on_purpose = False
        self._handed_over = False  # the last leader's Bye named its standby
        self._departed: tuple[str, float] | None = None  # (id, start) of the last leader that said Bye: not rejoined
        self._lost: tuple[PeerInfo, float] | None = None  # the leader found lost, and when it was last rechecked
        self._distrusted: set[str] = set()  # leaders ignored (logged once each)
        self._wake = asyncio.Event()

    # ------------------------------------------------------------------------------------------- events

    def peer_seen(self, info: PeerInfo) -> None:
        if info.role != "leader" or self.candidates.get(info.id) == info or (info.id, info.started) == self._departed:
            return
        if self.trusted and info.identity not in self.trusted:
            if info.id not in self._distrusted:
                self._distrusted.add(info.id)
                log.warning("ignoring leader %s (%s) at %s: its identity %s is not the leader's this member may join",
                            info.id, info.name, info.url, info.identity[:12])
            return
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
            if self.leader is not None and ev.peer == self.leader.id:
                self._suspect_leader = True  # the leader's own link: is it gone?
            self._wake.set()

    def _standby_of_last_plan(self) -> PeerInfo | None:
        u = self.last_update
        return u.standby_info if u is not None else None

    def _is_standby(self, peer: PeerInfo) -> bool:
        """``peer`` is the standby of the latest plan (by id and identity)."""
        standby = self._standby_of_last_plan()
        return standby is not None and (peer.id, peer.identity) == (standby.id, standby.identity)

    def _asks_this_standby(self, peer: PeerInfo) -> bool:
        """This agent is the latest plan's standby and ``peer`` one of that plan's members (by id and identity)."""
        u = self.last_update
        return u is not None and u.standby == self.id and any(
            (m.id, m.identity) == (peer.id, peer.identity) for m in u.members)

    def _from_leader(self, msg: ControlMessage, sender: Peer | None) -> PeerInfo:
        """This member's leader, when ``msg`` comes from it (by id and, with a key, by the identity it proved);
        else ProtocolError (logged by the caller)."""
        leader = self.leader
        if leader is None:
            raise ProtocolError(f"a {msg.kind} message, and this member has no leader")
        if sender is not None and (sender.agent_id, sender.identity) != (leader.id, leader.identity):
            raise ProtocolError(f"a {msg.kind} message from agent {sender.agent_id} (identity {sender.identity[:12]}), "
                                f"not from this member's leader {leader.id} (identity {leader.identity[:12]})")
        return leader

    async def handle(self, msg: ControlMessage, sender: Peer | None = None) -> ControlMessage:
        """A control message to this member -> the reply. ``sender``: the agent that authenticated (None in the
        open mode); plans, activations and goodbyes count only from this member's leader's identity."""
        if isinstance(msg, Hello):
            peer = msg.peer
            if peer.cluster != self.info.cluster:
                return Ack()
            if self.leader is not None and (self._is_standby(peer) or self._asks_this_standby(peer)):
                # the standby says the leader is lost (it took over), or a member of it asks this standby to take
                # it (it found the leader lost): see for ourselves at once
                self._suspect_leader = True
                self._wake.set()
            if peer.role == "leader":  # a leader that learned of us through a static peer, or the standby
                if self._is_standby(peer):
                    self.trusted.add(peer.identity)
                self.peer_seen(peer)
            return Ack()
        if isinstance(msg, PlanUpdate):
            leader = self._from_leader(msg, sender)
            if (msg.leader.id, msg.leader.identity) != (leader.id, leader.identity):
                raise ProtocolError(f"a plan naming leader {msg.leader.id}, not this member's leader {leader.id}")
            if self.latest_update is None or msg.epoch > self.latest_update.epoch:
                self.latest_update = self.last_update = msg
                self.stage_host.prepare(msg, self._report)
                if self.on_plan is not None:
                    self.on_plan(msg)
            return Ack(epoch=msg.epoch)
        if isinstance(msg, Activate):
            self._from_leader(msg, sender)
            self.net.spawn(self._activate(msg.epoch), name="activate")
            return Ack(epoch=msg.epoch)
        if isinstance(msg, Bye):
            leader = self._from_leader(msg, sender)
            if msg.agent_id == leader.id:
                u = self.last_update
                self._handed_over = bool(msg.successor) and u is not None and u.leader.id == leader.id \
                    and msg.successor == u.standby
                log.warning("the leader %s stopped: %s%s", leader.id, msg.reason,
                            f"; its standby {msg.successor} takes over" if self._handed_over else "")
                self._left_on_purpose = not self._handed_over
                self._departed = (leader.id, leader.started)  # until it starts again, it is not joined again
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
        """Tell the leader how this stage stands; a leader that does not take it is the heartbeats' business (they
        find it gone), never a reason for this agent to stop."""
        leader = self.leader
        if leader is None:
            return
        try:
            await self.net.post(leader.url, status)
        except (PeerGone, ProtocolError) as e:
            log.warning("could not report epoch %d %s to leader %s: %s", status.epoch, status.state, leader.id, e)

    async def goodbye(self) -> None:
        if self.leader is not None:
            await self.net.post(self.leader.url, Bye(agent_id=self.id))

    # ---------------------------------------------------------------------------------------------- loop

    def _pick(self) -> PeerInfo | None:
        """The leader to join: the lost leader's standby while it is awaited (every other try, another trusted
        candidate -- the lost leader back, say -- when there is one), else the oldest candidate."""
        oldest = min((p for p in self.candidates.values() if self._successor is None or p.id != self._successor[0]),
                     key=lambda p: (p.started, p.id), default=None)
        if self._successor is not None:
            sid, until = self._successor
            if sid in self.candidates and time.monotonic() < until:
                self._alternate = not self._alternate
                return oldest if self._alternate and oldest is not None else self.candidates[sid]
            self._successor = None
        return oldest

    async def run(self) -> None:
        while True:
            if self.taking_over:
                await asyncio.Event().wait()  # the agent leads now; it ends this task
            leader = self._pick()
            if leader is None:
                await self._sleep(SEARCH_WAKE_S)
                continue
            try:
                reply = await self.net.post(leader.url, Hello(peer=self.info))
            except (PeerGone, ProtocolError) as e:
                reply, why = None, str(e)
            else:
                why = reply.reason if isinstance(reply, Refused) else f"it answered {reply.kind}, not welcome"
            if not isinstance(reply, Welcome):
                if self._successor is not None and self._successor[0] == leader.id:
                    log.debug("standby %s does not lead yet: %s", leader.id, why)
                    await self._recheck_lost()
                    await self._sleep(SUCCESSOR_RETRY_S)
                    continue
                log.warning("cannot join leader %s: %s", leader.id, why)
                self.candidates.pop(leader.id, None)
                await asyncio.sleep(membership_mod.HEARTBEAT_INTERVAL_S)
                continue
            self.leader, self._successor = leader, None
            if leader.identity and not self.trusted:
                self.trusted.add(leader.identity)  # the first leader joined is the one this member follows
            log.info("joined cluster %r: leader %s (%s) at %s%s", self.info.cluster, leader.id, leader.name,
                     leader.url, "" if self.lost_at is None else
                     f", {time.monotonic() - self.lost_at:.2f} s after the last one was lost")
            self._left_on_purpose = self._suspect_leader = self._handed_over = False
            try:
                lost = await self._heartbeats(leader)
            finally:
                self.leader = None
                self.latest_update = None
            if lost and self._succeed(leader):
                continue  # keep the stage: the standby's plan mostly keeps its range
            await self.stage_host.release()

    def _succeed(self, lost: PeerInfo) -> bool:
        """The leader ``lost`` is gone: its standby takes over (this agent, or another that this member turns to).
        -> whether there is one"""
        self.lost_at = time.monotonic()
        u = self.last_update
        standby = u.standby_info if u is not None and u.leader.id == lost.id else None
        if standby is None:
            log.warning("leader %s is lost and named no standby; waiting for a leader", lost.id)
            return False
        if standby.id == self.id:
            self.taking_over = self.on_takeover is not None and self.on_takeover(u, self._why())
            return self.taking_over
        log.warning("leader %s is lost; turning to its standby %s (%s) at %s", lost.id, standby.id, standby.name,
                    standby.url)
        if standby.identity:
            self.trusted.add(standby.identity)
        self.candidates[standby.id] = standby.model_copy(update={"role": "leader"})
        self._successor = (standby.id, time.monotonic() + TAKEOVER_WAIT_S)
        self._lost = None if self._handed_over else (lost, 0.0)
        self.net.spawn(self._tell(standby), name="tell-standby")
        return True

    async def _recheck_lost(self) -> None:
        """While the standby does not lead: does the leader that seemed lost answer after all (it was slow, not
        gone: the standby, which probes it too, does not take over)? Then it is joined again."""
        if self._lost is None or time.monotonic() - self._lost[1] < RECHECK_S:
            return
        lost = self._lost[0]
        self._lost = (lost, time.monotonic())
        info = await self.net.fetch_info(lost.host, lost.port, PROBE_TIMEOUT_S)
        if info is not None and (info.id, info.started, info.role) == (lost.id, lost.started, "leader") \
                and self._successor is not None:
            log.warning("leader %s answers again (it was slow, not lost); joining it again", lost.id)
            self.candidates[lost.id] = lost
            self._successor = self._lost = None

    def _why(self) -> str:
        return "stopped" if self._handed_over else "lost"

    def ready_to_lead(self) -> None:
        """This agent's standby preparation finished: if its leader was lost meanwhile (and no leader came since),
        take over now."""
        u = self.last_update
        if self.leader is None and not self.taking_over and self.lost_at is not None and u is not None \
                and u.standby == self.id and self.on_takeover is not None and self.on_takeover(u, self._why()):
            self.taking_over = True
            self._wake.set()

    async def _tell(self, standby: PeerInfo) -> None:
        """Let the standby know at once (it probes the leader itself, and takes over when it finds it gone)."""
        with contextlib.suppress(PeerGone, ProtocolError):
            await self.net.post(standby.url, Hello(peer=self.info))

    async def _heartbeats(self, leader: PeerInfo) -> bool:
        """Heartbeat until the leader is lost (silent, gone from mDNS, not answering a probe: -> True) or stopped
        on purpose or has forgotten us (-> False)."""
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
            # a frozen leader (its sockets open, nothing answering) is lost HEARTBEAT_TIMEOUT_S after its last
            # answer, not a whole control timeout later
            left = last_ok + membership_mod.HEARTBEAT_TIMEOUT_S - time.monotonic()
            try:
                async with asyncio.timeout(max(left, membership_mod.HEARTBEAT_INTERVAL_S)):
                    ack = await self.net.post(leader.url, beat)
                last_ok = time.monotonic()
                if isinstance(ack, Ack) and not ack.known:
                    log.warning("leader %s does not know this agent any more; joining again", leader.id)
                    return False
            except (PeerGone, ProtocolError, TimeoutError) as e:
                if time.monotonic() - last_ok > membership_mod.HEARTBEAT_TIMEOUT_S:
                    log.warning("leader %s is gone: %s", leader.id, e or "no answer")
                    self.candidates.pop(leader.id, None)
                    return True
            if leader.id not in self.candidates:
                return not self._left_on_purpose  # a goodbye, or an mDNS removal it did not deny
            if self._suspect_leader:
                self._suspect_leader = False
                info = await self.net.fetch_info(leader.host, leader.port, PROBE_TIMEOUT_S)
                if info is None or info.started != leader.started:
                    log.warning("leader %s is gone: it does not answer", leader.id)
                    self.candidates.pop(leader.id, None)
                    return True
            await self._sleep(membership_mod.HEARTBEAT_INTERVAL_S)

    async def _sleep(self, seconds: float) -> None:
        """Sleep, or less when something happened (a candidate, a lost leader, a broken link)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()
        self._wake.clear()
