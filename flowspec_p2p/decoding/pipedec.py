"""PipeDec, the FlowSpec paper's second baseline (flowspec-algorithm.md §7.1): the draft tree grows **one level per
pipeline step**, with a fixed width, and every segment is exactly one level.

It shares FlowSpec's machinery (flowspec.tree_pipeline: step-wise verification, in-band causal pruning, look-ahead)
and differs only in how the tree grows:

    initial  the root plus ``in_flight - 1`` levels of the draft's beam (``width`` nodes per level), one segment each
    grow     after every returned segment, draft the beam one level deeper than the tree and append that level's
             ``width`` best nodes (cumulative score) whose parents are on the current deepest level
    segment  one level

Like the reference, the drafter re-runs over the whole current tree to grow it (here: the EAGLE-2 beam from the
root, depth = tree depth + 1), with draft features below the root.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial

from pydantic import Field

from ..pipeline.messages import Forward
from ..speculative.drafter import TreeShape
from ..speculative.tree import DraftTree
from ..speculative.verify import Verdict
from ..types import Settings
from .context import DecodingMode, ModeContext
from .flowspec import Send, tree_pipeline
from .flowstate import FlowState


class PipeDecConfig(Settings):
    width: int = Field(4, ge=1)  # nodes per level (the reference's 16 suits GPUs; a CPU stage pays per node)
    max_depth: int = Field(10, ge=1)  # levels below the root at most
    in_flight: int | None = Field(None, ge=1)  # default: compute stages + 1


def beam(tree: DraftTree, width: int) -> DraftTree:
    """Level by level, the ``width`` best-scored nodes whose parent was kept: the EAGLE-2 beam, in level order."""
    scores, depth, parents = tree.scores.tolist(), tree.depth.tolist(), tree.parent_list
    kept, level = [0], [0]
    while True:
        inside = set(level)
        kids = [i for i in range(len(tree)) if parents[i] in inside]
        if not kids:
            break
        level = sorted(kids, key=lambda i: (-scores[i], i))[:width]
        kept += sorted(level, key=lambda i: (-scores[i], i))
    assert all(depth[kept[j]] <= depth[kept[j + 1]] for j in range(len(kept) - 1))
    return tree.select(kept, keep_order=True)


class PipeDecGrowth:
    def __init__(self, cfg: PipeDecConfig, levels: int):
        self.cfg = cfg
        self.levels = levels

    def _shape(self, depth: int) -> TreeShape:
        w = self.cfg.width
        return TreeShape(total_tokens=1 + w + w * w * max(0, depth - 1), depth=depth, top_k=w, order="eagle")

    async def initial(self, ctx: ModeContext, state: FlowState, budget: int, send: Send) -> None:
        depth = min(self.levels, self.cfg.max_depth, budget - 1)
        tree = await ctx.compute(ctx.drafter.draft, self._shape(max(0, depth)))
        state.tree = beam(tree, self.cfg.width)  # the caller sends it, level by level

    async def grow(self, ctx: ModeContext, state: FlowState, budget: int, walked: bool, send: Send) -> bool:
        tree = state.tree
        deepest = int(tree.depth.max())
        if deepest >= min(self.cfg.max_depth, budget - 1):
            return False
        fresh = await ctx.compute(ctx.drafter.draft, self._shape(deepest + 1))
        merged, _ = tree.merge(fresh)
        depth, parents, scores = merged.depth.tolist(), merged.parent_list, merged.scores.tolist()
        n = len(tree)
        # the new deepest level: children of nodes already in the tree (fresh nodes above it are not kept)
        new = [i for i in range(n, len(merged)) if depth[i] == deepest + 1 and parents[i] < n]
        new = sorted(new, key=lambda i: (-scores[i], i))[: self.cfg.width]
        if not new:
            return False
        state.tree = merged.select([*range(n), *new], keep_order=True)
        return True

    def walked(self, state: FlowState, verdict: Verdict) -> None:
        pass  # one level per step whatever the acceptance: the baseline as published

    def returned(self, msg: Forward) -> None:
        pass

    def report(self) -> dict:
        return {}

    def segment(self, state: FlowState, live: int) -> int:
        """The unsent nodes of the next level (they were appended level by level)."""
        depth = state.tree.depth.tolist()
        a = state.sent
        if a >= len(depth):
            return 0
        b = a
        while b < len(depth) and depth[b] == depth[a]:
            b += 1
        return b - a


async def pipedec_mode(ctx: ModeContext, config: PipeDecConfig | None = None) -> AsyncIterator[list[int]]:
    cfg = config or PipeDecConfig()
    in_flight = cfg.in_flight or ctx.pipeline.stages + 1
    growth = PipeDecGrowth(cfg, levels=in_flight - 1)
    async for chunk in tree_pipeline(ctx, growth, in_flight, draft_slots=1 + cfg.width * (cfg.max_depth + 1)):
        yield chunk


def make_pipedec(config: PipeDecConfig | None = None) -> DecodingMode:
    return DecodingMode("pipedec", partial(pipedec_mode, config=config), needs_drafter=True,
                    description="PipeDec: the draft tree grows one level per pipeline step, one level per segment")


PIPEDEC = make_pipedec()
