"""Cluster membership as seen by the leader: a pure ``apply(state, event) -> state`` and a debounced re-plan signal.

No asyncio, no clock of its own: every event carries its time ``at`` (seconds, monotonic), so tests replay
sequences exactly. Anchor: exo 1.x ``shared/apply.py``.

Events (the agent turns HTTP messages, mDNS and its timer into these):

    Joined(info)              a Hello was accepted (or a known member re-announced itself)
    Heard(id, epoch, state)   a heartbeat or stage status; a member reporting ``failed`` (or found stalled) is left
                              out of plans until ``retry_delay`` has passed, doubling with each failure in a row,
                              and it answered meanwhile
    Left(id, reason)          a Bye, an mDNS removal, or a refused link: it is gone now
    Tick                      time passes: members silent for HEARTBEAT_TIMEOUT_S are dropped
    Planned                   the leader adopted a plan: the pending change is consumed

A change that affects the plan (a member joins, leaves, fails, or offers something else) sets ``changed_at``;
``needs_replan`` turns true REPLAN_DEBOUNCE_S after the *last* such change, so a burst of joins (a whole cluster
starting) yields one plan rather than one per agent.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from ..types import PeerId
from .control import PeerInfo, StageState
from .plans import Device

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 3.5  # must exceed 3 * HEARTBEAT_INTERVAL_S
REPLAN_DEBOUNCE_S = 0.5
RETRY_BASE_S = 10.0  # a failed member that still answers is planned again after this, doubling per failure
RETRY_MAX_S = 600.0


@dataclass(frozen=True)
class Member:
    info: PeerInfo
    last_seen: float
    epoch: int = -1  # the plan epoch it reports running
    state: StageState = "idle"
    failed: bool = False  # it failed (a load, a stall): not planned until its retry comes (retry_delay) or it re-joins
    failed_at: float = 0.0
    failures: int = 0  # failures in a row; a member that re-joins starts at 0
    failed_epoch: int = -2  # a failure reported for this epoch or an older one does not count again after a retry


@dataclass(frozen=True)
class Membership:
    self_info: PeerInfo
    members: dict[str, Member] = field(default_factory=dict)  # never mutated: apply returns a new dict
    changed_at: float | None = None  # last plan-relevant change not yet consumed by Planned
    departed: tuple[tuple[str, str], ...] = ()  # (agent id, reason) since the last Planned


@dataclass(frozen=True)
class Joined:
    info: PeerInfo
    at: float


@dataclass(frozen=True)
class Heard:
    agent_id: PeerId
    at: float
    epoch: int = -1
    state: StageState | None = None


@dataclass(frozen=True)
class Left:
    agent_id: PeerId
    at: float
    reason: Literal["bye", "mdns", "timeout", "link", "refused"] | str = "bye"


@dataclass(frozen=True)
class Tick:
    at: float


@dataclass(frozen=True)
class Planned:
    at: float


Event = Joined | Heard | Left | Tick | Planned


def _plan_relevant(old: PeerInfo, new: PeerInfo) -> bool:
    return (old.profile, old.model, old.host, old.port, old.started) != (
        new.profile, new.model, new.host, new.port, new.started)


def apply(state: Membership, event: Event) -> Membership:
    """The next membership state. Pure; unknown members in Heard/Left are ignored."""
    members = state.members
    if isinstance(event, Joined):
        info = event.info
        if info.id == state.self_info.id:
            return state
        old = members.get(info.id)
        member = Member(info=info, last_seen=event.at)
        changed = old is None or old.failed or _plan_relevant(old.info, info)
        if old is not None and not changed:
            member = replace(old, info=info, last_seen=event.at)
        return replace(state, members={**members, info.id: member},
                       changed_at=event.at if changed else state.changed_at)
    if isinstance(event, Heard):
        old = members.get(event.agent_id)
        if old is None:
            return state
        new = replace(old, last_seen=max(old.last_seen, event.at), epoch=max(old.epoch, event.epoch),
                      state=event.state or old.state)
        failed_now = event.state == "failed" and not old.failed and event.epoch > old.failed_epoch
        if failed_now:
            new = replace(new, failed=True, failed_at=event.at, failures=old.failures + 1,
                          failed_epoch=max(event.epoch, old.epoch))
        return replace(state, members={**members, event.agent_id: new},
                       changed_at=event.at if failed_now else state.changed_at)
    if isinstance(event, Left):
        if event.agent_id not in members:
            return state
        rest = {k: v for k, v in members.items() if k != event.agent_id}
        return replace(state, members=rest, changed_at=event.at,
                       departed=(*state.departed, (event.agent_id, str(event.reason))))
    if isinstance(event, Tick):
        gone = [k for k, m in members.items() if event.at - m.last_seen > HEARTBEAT_TIMEOUT_S]
        for k in gone:
            state = apply(state, Left(agent_id=k, at=event.at, reason="timeout"))
        due = {k: replace(m, failed=False) for k, m in state.members.items()
               if m.failed and m.last_seen > m.failed_at and event.at - m.failed_at >= retry_delay(m.failures)}
        if due:  # failed members that answered since: planned again
            state = replace(state, members={**state.members, **due}, changed_at=event.at)
        return state
    if isinstance(event, Planned):
        return replace(state, changed_at=None, departed=())
    raise TypeError(f"unknown event {event!r}")


def retry_delay(failures: int) -> float:
    """Seconds a member that failed ``failures`` times in a row stays out of plans (while it keeps answering)."""
    return min(RETRY_MAX_S, RETRY_BASE_S * 2 ** max(0, failures - 1))


def needs_replan(state: Membership, now: float) -> bool:
    return state.changed_at is not None and now - state.changed_at >= REPLAN_DEBOUNCE_S


def device(info: PeerInfo, *, leader: bool = False) -> Device:
    p = info.profile
    return Device(id=info.id, memory_bytes=p.memory_bytes, runtime_bytes=p.runtime_bytes, gflops=p.gflops,
                  link_mbps=p.link_mbps, latency_ms=p.latency_ms, leader=leader)


def devices(state: Membership) -> list[Device]:
    """The leader and every member not marked failed, as planner devices (sorted by id)."""
    out = [device(state.self_info, leader=True)]
    out += [device(m.info) for m in state.members.values() if not m.failed]
    return sorted(out, key=lambda d: d.id)
