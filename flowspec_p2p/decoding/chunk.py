"""Chunk-PP, the FlowSpec paper's main baseline (flowspec-algorithm.md §7.1 ``naive``): pipelined speculative
decoding with whole-tree verification.

One round:
    1. draft an EAGLE-2 tree (EAGLE order) from the root, the last committed token (tree.py, drafter.py)
    2. cut it into contiguous segments and send them all down the pipeline back to back; stage s works on
       segment k while stage s+1 works on segment k-1
    3. wait for the *last* segment to come back, verify the whole tree (verify.py), commit the accepted path and
       the bonus token, and send ``Prune(keep=accepted, accept=len(accepted))`` so every stage keeps exactly the
       accepted path's K/V (causal-consistent, in order with the next round's segments)
    4. feed the committed tokens and their target features to the drafter; repeat

Every round fills and drains the pipeline; that idle time is what FlowSpec removes. Greedy output equals
autoregressive decoding token for token; sampling keeps the target distribution (verify.verify_sampling).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial

import torch

from ..ledger import Ledger
from ..speculative.drafter import TreeShape
from ..speculative.tree import DraftTree, segment_bounds, split_lengths
from ..speculative.verify import Verdict, verify_walk
from .context import DecodingMode, ModeContext, prefill

# The pipeline's tree is not the single-device one (spec.decoder.DEFAULT_TREE, tuned for one forward on one CPU): here
# it is cut into one segment per stage, so a bigger tree costs little more per round. Same budget as FlowSpec's
# initial tree, so the two modes draft comparable trees.
CHUNK_TREE = TreeShape(total_tokens=24, depth=6, top_k=4)


@dataclass
class ChunkFigures:
    """Chunk-PP's own figures of an attempt: the drafter's seconds, segments per tree, the tree shape; in the stats
    also ``tree_nodes``, the mean tree size per round (the root included)."""

    shape: TreeShape
    segments: int
    draft_s: float = 0.0

    def stats(self, ledger: Ledger) -> dict:
        rounds = ledger.attempt_walks
        return dict(draft_s=round(self.draft_s, 4), segments=self.segments, tree=self.shape.model_dump(),
                    tree_nodes=round((ledger.attempt_drafted + rounds) / rounds, 2) if rounds else 0.0)


def _verify(ctx: ModeContext, tree: DraftTree, f: torch.Tensor, committed: int) -> Verdict:
    """f: [n, hidden] target features of the whole tree, whose root sits at position ``committed``. LM-head rows
    only where the walk goes."""
    verdict, rows = verify_walk(tree, len(tree), ctx.params, ctx.gen, logits=lambda idx: ctx.logits(f[idx]),
                                tokens=lambda idx: ctx.greedy_tokens(f[idx]), stop_ids=ctx.stop_ids,
                                root_position=committed, keep_rows=ctx.wants_rows)
    if rows is not None:
        ctx.note_walk(rows, verdict, verdict.emitted(tree))
    return verdict


def _commit(ctx: ModeContext, tree: DraftTree, f: torch.Tensor, verdict: Verdict, more: bool) -> None:
    """Feed the drafter the accepted tokens with their target features (when the reply goes on)."""
    if more:
        acc = torch.tensor(verdict.accepted)
        ctx.drafter.feed(tree.tokens[acc].tolist(), f[acc], verdict.token)


async def chunk_mode(ctx: ModeContext, shape: TreeShape = CHUNK_TREE, segments: int | None = None
                     ) -> AsyncIterator[list[int]]:
    """``segments``: per tree (default: the pipeline's stages + 1, the leader included, as the reference)."""
    drafter, ledger = ctx.drafter, ctx.ledger
    segments = segments or ctx.pipeline.stages + 1
    t0 = time.perf_counter()
    feats = await prefill(ctx)  # [P, hidden]
    token = await ctx.decide(feats[-1])
    drafter.reset(len(ctx.prompt) + ctx.max_new_tokens + shape.draft_slots())
    await ctx.compute(drafter.feed, ctx.prompt, feats, token)
    ledger.prefilled(len(ctx.prompt), time.perf_counter() - t0)
    fig = ChunkFigures(shape, segments)
    ledger.note(fig)
    committed = len(ctx.prompt)
    t1 = time.perf_counter()
    try:
        yield [token]
        while (remaining := ctx.remaining) > 0 and token not in ctx.stop_ids:
            # 1. draft (no deeper than the reply can still grow)
            td = time.perf_counter()
            tree: DraftTree = await ctx.compute(drafter.draft, shape.capped(remaining - 1))
            fig.draft_s += time.perf_counter() - td
            # 2. all segments down the pipeline, back to back
            parents, positions = tree.parent_list, tree.positions(committed).tolist()
            bounds = segment_bounds(split_lengths(len(tree), segments))
            ctx.drafted(len(tree) - 1)  # node 0 is the decided root
            for k, (a, b) in enumerate(bounds):
                await ctx.forward(first=a, parents=parents[a:b], positions=positions[a:b], tokens=tree.tokens[a:b],
                                  tag=k)
            # 3. verify once the last segment is back; keep the accepted path on every stage
            f = torch.cat([ctx.features((await ctx.recv_forward())[1]) for _ in bounds])  # [n, hidden]
            verdict: Verdict = await ctx.compute(_verify, ctx, tree, f, committed)
            await ctx.prune(len(verdict.accepted), verdict.accepted)
            ctx.keep(f[torch.tensor(verdict.accepted)])
            committed += len(verdict.accepted)
            out = verdict.emitted(tree)[:remaining]
            ctx.walked(verdict, len(out))
            token = out[-1]
            yield out
            # 4. the drafter learns the committed tokens with their real target features
            more = ctx.remaining > 0 and token not in ctx.stop_ids
            td = time.perf_counter()
            await ctx.compute(_commit, ctx, tree, f, verdict, more)
            fig.draft_s += time.perf_counter() - td
    finally:
        ledger.decoded(time.perf_counter() - t1)


def make_chunk(shape: TreeShape = CHUNK_TREE, segments: int | None = None) -> DecodingMode:
    """The ``chunk`` mode with a tree shape and a segment count (None: stages + 1)."""
    return DecodingMode("chunk", partial(chunk_mode, shape=shape, segments=segments), needs_drafter=True,
                    description="Chunk-PP: a whole EAGLE-2 tree in segments through the pipeline, verified at once")


CHUNK = make_chunk()
