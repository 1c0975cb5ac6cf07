"""The leader's FlowSpec bookkeeping and scheduling policy, pure (no I/O, no asyncio): what flowspec.py's loop
drives.

    FlowState    one request's tree, what is in flight (Segment), the verified prefix and the prunes (apply)
    StageCost    a k-node stage forward's time relative to a one-node one, measured from the returned segments
    Calibration  how well the draft's scores predict the target in this request (acceptance estimates, hit rate)
    best_segment the segment size that maximises expected accepted nodes per unit of stage time

Words as in flowspec.py's glossary. What the loop reports about itself (counters, timings) is flowstats.py's.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..pipeline.messages import Forward
from ..speculative.tree import DraftTree
from ..speculative.verify import Verdict


@dataclass
class Segment:
    """An in-flight segment: ``rows`` of the sent message that still live, at current tree indices ``nodes``."""

    tag: int
    sent_rows: int
    rows: list[int]
    nodes: list[int]


@dataclass
class FlowState:
    """The leader's per-request FlowSpec bookkeeping. Pure (no I/O): the async mode drives it."""

    tree: DraftTree
    committed: int  # K/V-committed tokens on every stage (prompt + accepted)
    sent: int = 0
    feats: list[torch.Tensor] = field(default_factory=list)  # [hidden] per verified node (index < V)
    inflight: deque[Segment] = field(default_factory=deque)
    next_tag: int = 0
    outcome: str = ""  # of the last walk applied: "continue", "continue_unsent" (new root not yet sent), "restart"

    @property
    def verified(self) -> int:
        return len(self.feats)

    def live_returned(self, returned: int) -> bool:
        """Whether one of the ``returned`` oldest in-flight segments (back at the leader, not yet taken) still
        holds live nodes: its walk is due."""
        return any(seg.nodes for _, seg in zip(range(returned), self.inflight, strict=False))

    def next_segment(self, size: int) -> tuple[int, int, int]:
        """Claim the next ``size`` unsent nodes [a, b) as a segment -> (tag, a, b)."""
        a = self.sent
        b = a + size
        assert size > 0, size
        assert b <= len(self.tree), (a, size, len(self.tree))
        tag = self.next_tag
        self.next_tag += 1
        self.sent = b
        self.inflight.append(Segment(tag, b - a, list(range(b - a)), list(range(a, b))))
        return tag, a, b

    def take_result(self, msg: Forward, features: torch.Tensor) -> tuple[Segment, torch.Tensor]:
        """Match a returned Forward to its in-flight segment -> (the segment: its live nodes at current indices,
        their features [k, H])."""
        seg = self.inflight.popleft()
        assert seg.tag == msg.tag, f"segment {msg.tag} returned, {seg.tag} expected (FIFO broken)"
        m = features.shape[0]
        if m == seg.sent_rows:
            rows = seg.rows
        elif m == len(seg.nodes):  # a stage already dropped the pruned rows
            rows = list(range(m))
        else:
            raise AssertionError(f"segment {seg.tag} returned {m} rows; sent {seg.sent_rows}, {len(seg.nodes)} live")
        assert not set(rows) & set(msg.dead), f"segment {seg.tag}: a live row came back dead"
        v = self.verified
        assert seg.nodes == list(range(v, v + len(seg.nodes))), (seg.nodes, v)
        return seg, features[rows]

    def apply(self, verdict: Verdict) -> tuple[int, list[int], list[int], torch.Tensor]:
        """Commit the accepted path and prune to the new root's subtree (continue) or a fresh root (restart).
        -> (accept, keep among sent nodes, accepted tokens, their features [a, H]) for Prune and the drafter."""
        acc = verdict.accepted
        assert verdict.token is not None
        tree = self.tree
        tokens = [tree.token_list[i] for i in acc]
        feats = torch.stack([self.feats[i] for i in acc])
        new_tree, keep = tree.prune(acc, verdict.next_child)
        if new_tree is None:  # restart: the decided token is a fresh root
            new_tree = DraftTree.root(verdict.token)
            self.outcome = "restart"
        else:
            self.outcome = "continue" if verdict.next_child < self.sent else "continue_unsent"
        keep_sent = [i for i in keep if i < self.sent]
        a = len(acc)
        new_of = {old: new - a for new, old in enumerate(keep_sent) if new >= a}
        for seg in self.inflight:
            live = [(r, new_of[x]) for r, x in zip(seg.rows, seg.nodes, strict=True) if x in new_of]
            seg.rows, seg.nodes = [r for r, _ in live], [x for _, x in live]
        self.sent = len(keep_sent) - a
        self.tree = new_tree
        self.committed += a
        self.feats = []
        return a, keep_sent, tokens, feats

    def rank_unsent(self, max_unsent: int) -> None:
        """Order the drafted-but-unsent nodes by descending score (the stages know nothing of them yet, so they may
        be re-indexed) and keep the ``max_unsent`` best. Scores never increase along a path and ties go to the
        lower index, so parents still come first and the kept set is parent-closed."""
        n, a = len(self.tree), self.sent
        if n - a <= 1:
            return
        scores = self.tree.scores.tolist()
        best = sorted(range(a, n), key=lambda i: (-scores[i], i))[:max_unsent]
        self.tree = self.tree.select([*range(a), *best], keep_order=True)


CostFn = Callable[[int], float]


def linear_cost(row_cost: float) -> CostFn:
    """cost(k) = 1 + row_cost * (k - 1): a k-node forward relative to a one-node one."""
    return lambda k: 1.0 + row_cost * (k - 1)


def segment_value(probs: list[float], k: int, cost: CostFn) -> float:
    """Expected accepted nodes per unit of stage time of a segment of the first ``k`` of ``probs``."""
    return sum(probs[:k]) / cost(k)


def best_segment(probs: list[float], cost: CostFn, cap: int) -> int:
    """The segment size k in [1, min(cap, len(probs))] that maximises segment_value. probs: the next unsent
    nodes' acceptance estimates, in send order. -> k (0 when nothing is unsent)"""
    best_k, best = min(1, len(probs)), -1.0  # at least one node while any is unsent, whatever the estimates
    for k in range(1, min(cap, len(probs)) + 1):
        value = segment_value(probs, k, cost)
        if value > best + 1e-12:
            best_k, best = k, value
    return best_k


@dataclass
class StageCost:
    """The pipeline's forward time against segment size, measured online: every returned Forward carries each
    stage's busy seconds (``Forward.stage_s``); the slowest stage's is a sample for its number of computed rows.
    cost(k) = median time of k rows / median time of one row, over the last ``window`` samples of each size.
    Until a size has ``min_samples`` samples (and one row has too), it is interpolated between measured sizes,
    or extrapolated from the largest measured one with the prior's slope ``row_cost``. Lives for one request,
    like Calibration (a re-plan changes the stages)."""

    row_cost: float
    window: int = 16
    min_samples: int = 3
    samples: dict[int, deque[float]] = field(default_factory=dict)

    def observe(self, rows: int, stage_s: list[float]) -> None:
        if rows <= 0 or not stage_s or not all(math.isfinite(t) and t >= 0 for t in stage_s):
            return  # nothing computed, nothing reported, or nonsense (messages.py validates it on the wire)
        self.samples.setdefault(rows, deque(maxlen=self.window)).append(max(stage_s))

    def measured(self) -> dict[int, float]:
        """{rows: median seconds} for the sizes with enough samples."""
        return {k: statistics.median(v) for k, v in sorted(self.samples.items()) if len(v) >= self.min_samples}

    def cost_fn(self) -> CostFn:
        """A snapshot of cost(k) for one sizing decision."""
        med = self.measured()
        if 1 not in med or med[1] <= 0:
            return linear_cost(self.row_cost)
        rel = {k: t / med[1] for k, t in med.items()}
        sizes = sorted(rel)

        def cost(k: int) -> float:
            if k in rel:
                return rel[k]
            below = max(j for j in sizes if j < k)  # 1 is always measured here
            above = [j for j in sizes if j > k]
            if not above:
                return rel[below] + self.row_cost * (k - below)
            hi = above[0]
            return rel[below] + (rel[hi] - rel[below]) * (k - below) / (hi - below)

        return cost


@dataclass
class Calibration:
    """How well the draft's probabilities predict the target in this request, per tree level: after every walk,
    for each accepted node, whether the target's next token was one of its drafted children (a hit), against the
    draft's probability mass on those children. Node i's acceptance estimate is exp(score_i) * ratio^depth_i,
    at most 1 (a prior of one level at ratio 1)."""

    hits: float = 1.0
    mass: float = 1.0
    events: float = 1.0
    # per hit: (the hit child's rank among its drafted siblings, 0 the draft's best guess; how many siblings)
    ranks: list[tuple[int, int]] = field(default_factory=list)

    def update(self, tree: DraftTree, verdict: Verdict) -> None:
        scores, parents = tree.scores.tolist(), tree.parent_list
        child_mass = [0.0] * len(tree)
        for i, p in enumerate(parents):
            if p >= 0:
                child_mass[p] += math.exp(scores[i] - scores[p])
        path = verdict.accepted if verdict.token is not None else verdict.accepted[:-1]
        for k, node in enumerate(path):
            self.mass += child_mass[node]
            hit = verdict.accepted[k + 1] if k + 1 < len(verdict.accepted) else verdict.next_child
            self.hits += 1.0 if hit is not None else 0.0
            self.events += 1.0
            if hit is not None:
                siblings = [i for i, p in enumerate(parents) if p == node]
                self.ranks.append((sum(1 for i in siblings if scores[i] > scores[hit]), len(siblings)))

    def useful_top_k(self, cover: float, max_k: int, min_hits: int = 8) -> int:
        """Children per expanded node: the fewest whose ranks held ``cover`` of the hits at nodes drafted
        ``max_k`` wide (each child is a draft-head row per level, so fewer cost the leader less; only full-width
        nodes count, as a narrower draft cannot show what it missed), in [2, max_k]; max_k until ``min_hits``
        such hits."""
        ranks = sorted(r for r, n in self.ranks if n >= max_k)
        if cover <= 0.0 or len(ranks) < min_hits:
            return max_k
        return max(2, min(max_k, ranks[math.ceil(cover * len(ranks)) - 1] + 1))

    @property
    def ratio(self) -> float:
        return self.hits / max(self.mass, 1e-9)

    @property
    def hit_rate(self) -> float:
        """The fraction of accepted nodes whose next token was one of their drafted children."""
        return self.hits / self.events

    def useful_depth(self, min_path: float, max_depth: int) -> int:
        """Levels a path is expected to survive with probability >= min_path, in [1, max_depth]."""
        h = self.hit_rate
        if min_path <= 0.0 or h >= 1.0:
            return max_depth
        if h <= 0.0:
            return 1
        return max(1, min(max_depth, math.floor(math.log(min_path) / math.log(h) + 1e-9)))

    def probs(self, tree: DraftTree, a: int, b: int) -> list[float]:
        """Estimated acceptance of nodes [a, b): the root is certain."""
        r = self.ratio
        p = (tree.scores[a:b].exp() * torch.pow(r, tree.depth[a:b].double())).clamp(max=1.0).tolist()
        if a == 0 and p:
            p[0] = 1.0
        return p
