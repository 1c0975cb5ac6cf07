"""What the pipelined tree loop (flowspec.tree_pipeline) reports about itself in the reply's stats (its figures in
the request's ledger: flowspec.TreeFigures): segment and node counts, walk outcomes, ring trips, and what each walk
outcome costs. Diagnostics for ``flowspec bench``; the algorithm (flowstate.py) neither reads nor needs any of it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .flowstate import Segment


@dataclass
class WalkClock:
    """What each walk outcome costs: the time from a walk to the next one, summed by the first walk's outcome
    (FlowState.outcome), into the reply's stats as ``<outcome>_gap_s`` and ``<outcome>_gaps``. A continue whose
    child was in flight costs about one stage time; a restart, or a continue to an unsent child, a trip round
    the ring. ``flowspec bench`` reports the mean of each. Call ``walked`` at every walk and ``outcome`` once
    the walk is applied (the request's last walk has none)."""

    sums: dict[str, float] = field(default_factory=dict)
    last: tuple[float, str | None] | None = None

    def walked(self, now: float) -> None:
        if self.last is not None and self.last[1] is not None:
            t, kind = self.last
            self.sums[f"{kind}_gap_s"] = round(self.sums.get(f"{kind}_gap_s", 0.0) + now - t, 6)
            self.sums[f"{kind}_gaps"] = self.sums.get(f"{kind}_gaps", 0) + 1
        self.last = (now, None)

    def outcome(self, kind: str) -> None:
        assert self.last is not None, "outcome() of a walk that was not clocked"
        self.last = (self.last[0], kind)


@dataclass
class FlowStats:
    """Counters of one request's tree loop, fed by the loop as it sends, takes back and walks."""

    counters: dict = field(default_factory=lambda: dict(
        segments=0, nodes_sent=0, nodes_returned=0, nodes_dead=0, continues=0, continues_unsent=0, restarts=0,
        prunes=0, trip_s=0.0, trips=0))
    clock: WalkClock = field(default_factory=WalkClock)
    sent_at: dict[int, float] = field(default_factory=dict)  # segment tag -> time.perf_counter() it went out
    draft_s: float = 0.0
    verify_s: float = 0.0

    def sent(self, tag: int, nodes: int) -> None:
        self.counters["segments"] += 1
        self.counters["nodes_sent"] += nodes
        self.sent_at[tag] = time.perf_counter()

    def returned(self, seg: Segment) -> None:
        """A segment came back; ``seg.nodes`` are the ones still live."""
        c = self.counters
        c["nodes_returned"] += len(seg.nodes)
        c["nodes_dead"] += seg.sent_rows - len(seg.nodes)
        sent_at = self.sent_at.pop(seg.tag)
        if seg.nodes:  # a live segment's trip round the ring (queueing behind earlier segments included)
            c["trip_s"] += time.perf_counter() - sent_at
            c["trips"] += 1

    def walked(self) -> None:
        """A walk (the ledger counts it: Ledger.walked)."""
        self.clock.walked(time.perf_counter())

    def applied(self, outcome: str) -> None:
        """The walk's prune was applied with ``outcome`` (FlowState.outcome)."""
        c = self.counters
        c["prunes"] += 1
        if outcome == "restart":
            c["restarts"] += 1
        else:
            c["continues"] += 1
            c["continues_unsent"] += outcome == "continue_unsent"
        self.clock.outcome(outcome)

    def drafted(self) -> None:
        self.counters["drafts"] = self.counters.get("drafts", 0) + 1

    def extra(self, walks: int) -> dict:
        """Its keys of the reply's stats; ``walks``: the attempt's, from the ledger."""
        counters = {**self.counters, "walks": walks, "trip_s": round(self.counters["trip_s"], 6)}
        return dict(draft_s=round(self.draft_s, 4), verify_s=round(self.verify_s, 4), **counters, **self.clock.sums)
