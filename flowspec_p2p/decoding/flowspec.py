"""FlowSpec: continuous pipelined tree-based speculative decoding (arXiv 2507.02620; flowspec-algorithm.md §3-§6).

With one request in flight a plain pipeline keeps one stage busy at a time. FlowSpec keeps every stage busy by
streaming *segments* of a draft tree through the pipeline and verifying the tree step by step as segments return.

Glossary (tree words as in tree.py, protocol words as in messages.py):

    root            node 0 of the leader's tree: a token already decided (streamed to the client) whose K/V is
                    not yet committed; the target's logits at the root decide what follows it
    sent prefix     nodes [0, sent) have been sent down the pipeline; every stage holds (or will hold, FIFO) their
                    K/V as its pending tree, in the same indexing
    verified prefix nodes [0, V) whose final features are back at the leader; segments go out and return in
                    index order, so this is always a prefix (and V = 0 right after every prune: the new root is
                    never verified yet)
    step            one returned segment: map it to current indices, extend the verified prefix, and — when the
                    root is verified — *walk* (verify.py): accept the longest verified path the target agrees
                    with and decide the token after it (argmax, or an exact sample). A walk is one of the
                    ledger's steps (+1 for the prefill), so tau = tokens per verification as for chunk and spec;
                    the returned segments are the stats' ``segments``
    continue        the decided token equals a child of the last accepted node that is already in the tree (sent or
                    not): that child becomes the new root and its subtree survives — no pipeline drain. If the
                    child was still unsent (``continues_unsent``), its features are a ring trip away, as after
                    a restart (WalkClock measures what each outcome costs)
    restart         the decided token is not in the tree: it becomes a fresh root; every in-flight node is pruned,
                    but the new tree goes out at once (no drain, §10.5)
    prune           Prune(accept = accepted path, keep = accepted + surviving *sent* nodes), sent in band, so every
                    stage applies it exactly once, in order with the segments (no global barrier, §10.3)
    expansion       after a walk, draft a fresh tree from the new root with the newly accepted target features,
                    one level (draft-head forward) at a time; merge each level by token path (tree.merge) and
                    send its new nodes at once (§6.1). A root with nothing drafted below it (the first token, or
                    after a restart) goes out alone first. A returned segment with live nodes stops the draft:
                    its walk comes first

Segments in flight that the leader has since pruned still return (stages skip, or stop part-way through, what a
prune discards, and pass it on as dead rows); the leader maps their rows through every prune made since they were
sent and drops what died.

Lossless: a node's features depend only on the committed prefix and its ancestors (tree attention, causal-
consistent prunes), and each decision at a verified node is the target's argmax or an exact sample from its
distribution (verify.verify_greedy / verify_sampling), made exactly once per emitted token.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from ..ledger import Ledger
from ..pipeline.messages import Forward
from ..speculative.drafter import TreeShape
from ..speculative.tree import DraftTree
from ..speculative.verify import Verdict, verify_walk
from .context import DecodingMode, ModeContext, prefill
from .flowstate import Calibration, FlowState, StageCost, best_segment, segment_value
from .flowstats import FlowStats
from .settings import FlowSpecConfig

log = logging.getLogger(__name__)


def _node_feats(state: FlowState) -> Callable[[list[int]], torch.Tensor]:
    """Tree node indices -> their features [k, hidden], from the state's features as they are now."""
    feats = state.feats
    return lambda idx: torch.stack([feats[i] for i in idx])


def _walk(ctx: ModeContext, state: FlowState) -> Verdict:
    """Verify the verified prefix of the current tree from its root (LM-head rows only where the walk goes)."""
    feats = _node_feats(state)
    verdict, rows = verify_walk(state.tree, state.verified, ctx.params, ctx.gen,
                                logits=lambda idx: ctx.logits(feats(idx)),
                                tokens=lambda idx: ctx.greedy_tokens(feats(idx)), stop_ids=ctx.stop_ids,
                                root_position=state.committed, keep_rows=ctx.wants_rows)
    if rows is not None:
        ctx.note_walk(rows, verdict, verdict.emitted(state.tree))
    return verdict


async def _verify(ctx: ModeContext, state: FlowState) -> Verdict:
    """``_walk`` on the compute thread; a walk that needs the argmax alone (greedy, no logprobs) shares its LM-head
    call with the other requests' next tokens and walks (batcher.py)."""
    batcher = ctx.parts.batcher
    if batcher is None or not ctx.argmax_only:
        return await ctx.compute(_walk, ctx, state)
    return await batcher.walk(ctx, state.tree, state.verified, _node_feats(state))


def _next_level(levels: Iterator[DraftTree]) -> DraftTree | None:
    """One level of a Drafter.draft_levels draft (on the compute thread) -> the tree so far, None when done."""
    with torch.inference_mode():
        return next(levels, None)


class Growth(Protocol):
    """How a pipelined tree mode drafts and cuts its tree (FlowSpec here; PipeDec in pipedec.py)."""

    async def initial(self, ctx: ModeContext, state: FlowState, budget: int, send: Send) -> None:
        """Draft the first tree below ``state.tree`` (the first token alone, not sent yet). ``send()`` sends what
        is ready (the caller sends the rest after)."""

    async def grow(self, ctx: ModeContext, state: FlowState, budget: int, walked: bool, send: Send) -> bool:
        """Expand ``state.tree`` after a returned segment (``walked``: a walk just moved the root). -> drafted?"""

    def segment(self, state: FlowState, live: int) -> int:
        """Nodes in the next segment, starting at ``state.sent``, with ``live`` segments in the ring (0: send
        nothing now)."""

    def walked(self, state: FlowState, verdict: Verdict) -> None:
        """A walk over ``state.tree`` (before its prune) ended in ``verdict``."""

    def returned(self, msg: Forward) -> None:
        """A segment came back (``msg.stage_s``: each stage's busy seconds for it)."""

    def report(self) -> dict:
        """What it learned in this request, for the reply's stats."""


Send = Callable[[], Awaitable[None]]  # fill the ring with what is ready to go


class FlowSpecGrowth:
    def __init__(self, cfg: FlowSpecConfig):
        self.cfg = cfg
        self.calibration = Calibration()
        self.stage_cost = StageCost(cfg.row_cost)

    def returned(self, msg: Forward) -> None:
        self.stage_cost.observe(msg.computed_rows, msg.stage_s)

    def report(self) -> dict:
        med = self.stage_cost.measured()
        cal, cfg = self.calibration, self.cfg
        return dict(acceptance_ratio=round(cal.ratio, 3), hit_rate=round(cal.hit_rate, 3),
                    expand_top_k=cal.useful_top_k(cfg.expand_cover, cfg.expand.top_k) if cfg.adaptive else None,
                    stage_ms={k: round(t * 1e3, 2) for k, t in med.items()})

    def walked(self, state: FlowState, verdict: Verdict) -> None:
        self.calibration.update(state.tree, verdict)

    async def initial(self, ctx: ModeContext, state: FlowState, budget: int, send: Send) -> None:
        await send()  # the first token goes down the ring while the leader drafts
        if budget > 1:
            await self._draft(ctx, state, self.cfg.init.capped(budget - 1), send)

    async def grow(self, ctx: ModeContext, state: FlowState, budget: int, walked: bool, send: Send) -> bool:
        cfg = self.cfg
        if not walked or (cfg.redraft_below and len(state.tree) - state.sent >= cfg.redraft_below):
            return False
        shape = cfg.expand
        if cfg.adaptive:  # as deep and as wide as this request's draft has shown to pay
            shape = shape.model_copy(update={
                "depth": self.calibration.useful_depth(cfg.expand_min_path, shape.depth),
                "top_k": self.calibration.useful_top_k(cfg.expand_cover, shape.top_k)})
        await self._draft(ctx, state, shape.capped(min(shape.depth, budget - 1)), send)
        return True

    async def _draft(self, ctx: ModeContext, state: FlowState, shape: TreeShape, send: Send) -> None:
        """Draft below the root one level (one draft-head forward) at a time: after each level, merge the new
        nodes, rank the unsent ones and send what the ring takes, so the root's children go down the ring while
        the deeper levels are drafted. A segment with live nodes that has come back stops the draft: its walk
        comes first (it decides the root the next draft starts from)."""
        levels = ctx.drafter.draft_levels(shape, partial=self.cfg.stream_levels)
        try:
            while (fresh := await ctx.compute(_next_level, levels)) is not None:
                state.tree, _ = state.tree.merge(fresh)
                state.rank_unsent(self.cfg.max_unsent)
                await send()
                if self.cfg.stream_levels and state.live_returned(ctx.returned):
                    break
        finally:
            # close() drops the draft's K/V; ValueError: cancelled while the compute thread still runs the level
            # (the next request's drafter.reset() drops it then)
            with contextlib.suppress(ValueError):
                levels.close()

    def segment(self, state: FlowState, live: int) -> int:
        cfg, a = self.cfg, state.sent
        b = min(len(state.tree), a + cfg.segment_cap)
        if not cfg.adaptive or b <= a:
            return b - a
        probs = self.calibration.probs(state.tree, a, b)
        cost = self.stage_cost.cost_fn()
        k = best_segment(probs, cost, cfg.segment_cap)
        if live and segment_value(probs, k, cost) < cfg.min_value:
            return 0  # not worth delaying the segments (and the next root) behind it: wait for the next walk
        return k


@dataclass
class TreeFigures:
    """The tree loop's own figures of an attempt (the reply's stats): segments in flight, the loop's counters
    (flowstats.FlowStats; ``walks`` from the ledger) and what the growth learned."""

    in_flight: int
    loop: FlowStats
    growth: Growth

    def stats(self, ledger: Ledger) -> dict:
        return dict(in_flight=self.in_flight, **self.loop.extra(ledger.attempt_walks), **self.growth.report())


class _TreeLoop:
    """One request's pipelined tree loop (tree_pipeline): the ring kept full, and each returned segment turned
    into a walk, a prune in band and a grown tree."""

    def __init__(self, ctx: ModeContext, growth: Growth, state: FlowState, in_flight: int):
        self.ctx, self.growth, self.state, self.in_flight = ctx, growth, state, in_flight
        self.stats = FlowStats()
        self.verdict: Verdict | None = None  # the last walk's, until advance() applies it

    def budget(self) -> int:
        return self.ctx.remaining

    async def fill(self) -> None:
        """Keep ``in_flight`` live segments in the ring while unsent nodes exist, shared with the other requests in
        flight: with k requests decoding, each keeps ceil(in_flight / k) (the ring is full of their segments anyway,
        and a segment that dies in flight delays theirs too). Segments that a prune emptied do
        not count: the stages skip their dead rows (look-ahead), so a fresh root goes out at once."""
        state = self.state
        share = max(1, -(-self.in_flight // max(1, self.ctx.in_flight_now())))
        while (live := sum(1 for seg in state.inflight if seg.nodes)) < share:
            n = self.growth.segment(state, live)
            if n <= 0:
                return
            tag, a, b = state.next_segment(n)
            self.stats.sent(tag, b - a)
            self.ctx.drafted(b - a - (a == 0))  # node 0 is the decided root
            t = state.tree
            await self.ctx.forward(first=a, parents=t.parent_list[a:b], positions=t.positions(state.committed)[a:b]
                                   .tolist(), tokens=t.tokens[a:b], tag=tag)

    async def start(self) -> None:
        td = time.perf_counter()
        await self.growth.initial(self.ctx, self.state, self.budget(), self.fill)
        self.stats.draft_s += time.perf_counter() - td
        await self.fill()  # the initial tree, cut into segments, fills the ring

    async def take(self, msg: Forward, tensors: dict[str, torch.Tensor]) -> tuple[list[int], bool]:
        """A returned segment: its live nodes extend the verified prefix and are walked. -> (tokens decided now,
        to stream at once; whether the reply is over)"""
        ctx, state, stats = self.ctx, self.state, self.stats
        self.growth.returned(msg)
        seg, f = state.take_result(msg, ctx.features(tensors))
        stats.returned(seg)
        self.verdict = None
        if not seg.nodes:
            return [], False
        tv = time.perf_counter()
        state.feats += list(f)
        verdict = await _verify(ctx, state)  # the root is always in the verified prefix here
        stats.verify_s += time.perf_counter() - tv
        stats.walked()
        out = verdict.emitted(state.tree)[: self.budget()]
        ctx.walked(verdict, len(out))  # a step: comparable with chunk's rounds and spec's steps
        if verdict.stopped or self.budget() <= 0 or out[-1] in ctx.stop_ids:
            return out, True
        self.verdict = verdict
        return out, False

    async def advance(self) -> None:
        """After ``take``: prune to the walk's outcome in band and feed the drafter (if it walked), grow the
        tree, refill the ring."""
        ctx, state, stats, verdict = self.ctx, self.state, self.stats, self.verdict
        if verdict is not None:
            self.growth.walked(state, verdict)
            accept, keep, acc_tokens, acc_feats = state.apply(verdict)
            stats.applied(state.outcome)
            await ctx.prune(accept, keep)
            ctx.keep(acc_feats)
            await self.fill()  # surviving unsent nodes go out before we spend time drafting
            td = time.perf_counter()
            await ctx.compute(ctx.drafter.feed, acc_tokens, acc_feats, verdict.token)
            stats.draft_s += time.perf_counter() - td
        td = time.perf_counter()
        if await self.growth.grow(ctx, state, self.budget(), verdict is not None, self.fill):
            stats.drafted()
        stats.draft_s += time.perf_counter() - td
        await self.fill()


async def tree_pipeline(ctx: ModeContext, growth: Growth, in_flight: int | None = None,
                        draft_slots: int = 64) -> AsyncIterator[list[int]]:
    """The pipelined tree loop shared by FlowSpec and PipeDec: prefill, fill the ring with segments, and on every
    returned segment extend the verified prefix, walk, prune in band, grow the tree, refill."""
    drafter, ledger = ctx.drafter, ctx.ledger
    in_flight = in_flight or ctx.pipeline.stages + 1
    t0 = time.perf_counter()
    feats = await prefill(ctx)  # [P, hidden]
    token = await ctx.decide(feats[-1])
    drafter.reset(len(ctx.prompt) + ctx.max_new_tokens + draft_slots)
    await ctx.compute(drafter.feed, ctx.prompt, feats, token)
    ledger.prefilled(len(ctx.prompt), time.perf_counter() - t0)
    t1 = time.perf_counter()
    try:
        yield [token]
        if ctx.remaining <= 0 or token in ctx.stop_ids:
            return
        loop = _TreeLoop(ctx, growth, FlowState(tree=DraftTree.root(token), committed=len(ctx.prompt)), in_flight)
        ledger.note(TreeFigures(in_flight, loop.stats, growth))
        await loop.start()
        while True:
            msg, tensors = await ctx.recv()
            if not isinstance(msg, Forward):
                continue  # acks of our prunes: the FIFO bookkeeping is done at send time
            out, done = await loop.take(msg, tensors)
            if out:
                yield out  # streamed the moment it is decided
            if done:
                return
            await loop.advance()
    finally:
        ledger.decoded(time.perf_counter() - t1)


async def flowspec_mode(ctx: ModeContext, config: FlowSpecConfig | None = None) -> AsyncIterator[list[int]]:
    cfg = config or FlowSpecConfig()
    slots = cfg.init.draft_slots() + cfg.expand.draft_slots()
    async for chunk in tree_pipeline(ctx, FlowSpecGrowth(cfg), cfg.in_flight, slots):
        yield chunk


def make_flowspec(config: FlowSpecConfig | None = None) -> DecodingMode:
    """The ``flowspec`` mode with these settings (None: the defaults)."""
    return DecodingMode("flowspec", partial(flowspec_mode, config=config), needs_drafter=True,
                        description="FlowSpec: score-ordered tree segments streamed through the pipeline, verified "
                                    "step by step, pruned in band on every stage, expanded as they flow")


FLOWSPEC = make_flowspec()
