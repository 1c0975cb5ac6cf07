"""What the leader's control plane shows (``GET /cluster``, the dashboard): ``cluster_view(coordinator)``.

    members      the leader, then every member: PeerInfo (id, name, role, address, ``api_url``: where it serves the
                 API, pid, profile: memory, compute, link), its state, plan epoch, failures and when it was last
                 heard of
    standby      the member that takes over when this leader is lost (replica.py)
    plan         the serving plan (stages: agent, layers, planned memory) and its rendering
    stages       the ring in order: agent, layers, address, and the counters its heartbeats carry (the leader's own
                 stage: read directly)
    transition   a re-plan in progress (phase, trigger, who has loaded and who is ready)
    no_plan      why no plan fits the members now ("no plan: short by N MB: ..."), else None
    recoveries   the plan history, newest last: each epoch put into service, what triggered it (a takeover: "took
                 over from leader ..."), its leader and standby, how long detecting, planning, loading and switching
                 took, when (unix time) and its stages (``plan_stages``)
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .plans import Plan, render

if TYPE_CHECKING:
    from .coordinator import Coordinator


def plan_stages(plan: Plan) -> list[dict]:
    """A plan's stages in ring order, for the plan history."""
    return [{"agent_id": s.agent_id, "layers": [s.layers.start, s.layers.end], "embed": s.embed, "head": s.head,
             "memory_bytes": s.memory_bytes} for s in plan.stages]


def cluster_view(c: Coordinator) -> dict:
    now = time.monotonic()
    members = [{**c.info.model_dump(mode="json"), "address": c.info.url, "state": "leader",
                "epoch": c.update.epoch if c.update else -1}]
    for m in sorted(c.membership.members.values(), key=lambda m: m.info.id):
        members.append({**m.info.model_dump(mode="json"), "address": m.info.url, "state": m.state,
                        "epoch": m.epoch, "failed": m.failed, "last_seen_s": round(now - m.last_seen, 2)})
    stages = []
    for i, n in enumerate(c.update.ring if c.update else (), 1):
        counters = c.stage_host.snapshot() if n.agent_id == c.id else c.counters.get(n.agent_id)
        stages.append({"stage": i, "agent_id": n.agent_id, "layers": str(n.layers), "address": n.url,
                       "counters": counters})
    t = c.transition
    return {
        "cluster": c.cfg.cluster,
        "epoch": c.update.epoch if c.update else None,
        "leader_id": c.id,
        "standby": c.update.standby if c.update else "",  # takes over when this leader is lost
        "members": members,
        "plan": c.plan.model_dump(mode="json") if c.plan else None,
        "plan_text": render(c.plan) if c.plan else None,
        "stages": stages,
        "transition": None if t is None else {"epoch": t.epoch, "phase": t.phase, "trigger": t.trigger,
                                              "loaded": sorted(t.loaded), "ready": sorted(t.ready)},
        "broken": c.broken,
        "no_plan": c.no_plan,  # why no plan fits the members (memory short by how much), while none does
        "pending": c.membership.changed_at is not None or c.planning,
        "recoveries": c.recoveries,
        "emulation": c.cfg.emulation.model_dump(),
    }
