"""The stages' busy intervals, gathered on the leader for its dashboard (api/dashboard.py): ``StageTimelines``.

Its own stage's come from its worker; each member's from ``GET /control/timeline?since=`` on that member (through
the agent's session, authenticated like every request it makes). A call fetches only what is new since the last
one, at most every POLL_S (several dashboards share one poll), and keeps KEEP_S of them; a member that does not
answer within FETCH_TIMEOUT_S keeps what was fetched before. Nothing is fetched while no dashboard asks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import aiohttp

from ..pipeline.worker import StageWorker
from .control import TIMELINE_PATH
from .coordinator import Coordinator
from .stage_host import StageHost

log = logging.getLogger(__name__)

POLL_S = 0.4
FETCH_TIMEOUT_S = 1.0
KEEP_S = 60.0


class StageTimelines:
    def __init__(self, coordinator: Coordinator, stage_host: StageHost, session: aiohttp.ClientSession):
        self.coordinator, self.stage_host, self.session = coordinator, stage_host, session
        self._kept: dict[tuple[int, str], deque[tuple[float, float]]] = {}  # (epoch, agent) -> (start, end)
        self._polled = 0.0
        self._lock = asyncio.Lock()

    async def __call__(self, since: float) -> list[dict]:
        """The serving ring's stages in order: {stage, agent_id, name, layers, intervals: [[start, end], ...]}
        with the intervals that end after ``since`` (time.time())."""
        u = self.coordinator.update
        if u is None:
            return []
        async with self._lock:
            if time.monotonic() - self._polled >= POLL_S:
                await asyncio.gather(*(self._poll(u.epoch, n.agent_id, n.url) for n in u.ring))
                self._polled = time.monotonic()
                self._kept = {k: v for k, v in self._kept.items() if k[0] == u.epoch}
        members = self.coordinator.membership.members
        out = []
        for i, n in enumerate(u.ring, 1):
            m = members.get(n.agent_id)
            kept = self._kept.get((u.epoch, n.agent_id), ())
            out.append({"stage": i, "agent_id": n.agent_id, "layers": str(n.layers),
                        "name": m.info.name if m is not None else self.coordinator.info.name,
                        "intervals": [[round(a, 4), round(b, 4)] for a, b in kept if b > since]})
        return out

    async def _poll(self, epoch: int, agent_id: str, url: str) -> None:
        kept = self._kept.setdefault((epoch, agent_id), deque())
        after = kept[-1][1] if kept else time.time() - KEEP_S
        if agent_id == self.coordinator.id:
            active = self.stage_host.active
            worker: StageWorker | None = active.worker if active is not None and active.epoch == epoch else None
            new = worker.timeline(after) if worker is not None else []
        else:
            try:
                async with self.session.get(f"{url}{TIMELINE_PATH}?since={after!r}",
                                            timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)) as r:
                    body = await r.json() if r.status == 200 else {}
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
                log.debug("timeline of %s: %s", agent_id, e)
                return
            new = body.get("intervals", []) if body.get("epoch") == epoch else []
        kept.extend((iv["start"], iv["end"]) for iv in new if iv["end"] > after)
        cutoff = time.time() - KEEP_S
        while kept and kept[0][1] < cutoff:
            kept.popleft()
