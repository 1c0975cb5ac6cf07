"""The leader's LM head over several requests at once. Two kinds of work are queued here and run together:

    next tokens   a request's next token (``ModeContext.decide``): its features' row, decided with that request's
                  own sampling (its seed, its position)
    greedy walks  a FlowSpec / PipeDec verification walk that needs the target's argmax alone (greedy, no
                  logprobs; ``ModeContext.argmax_only``): the walk's first LM-head call (its root and the nodes it
                  likely goes to, ``LazyRows.wanted``) is shared, any later call is the walk's own

One call on the compute thread takes everything queued: one LM-head call over every row when all of it needs the
argmax alone (Shard.greedy_tokens), else the sampled next tokens' logits in one call and the argmax rows in another.
Work that arrives while the compute thread is busy rides in the next call together, as the stages batch their
forwards. Under load that is most of the leader's head work: one call over k requests' rows costs far less than k
calls (the head's weights are read once; SmolLM2's head, one thread: 1 row 1.4 ms, 4 rows 2.0, 8 rows 3.4).

Lossless: the engine's LM head scores a row the same whatever rows are beside it, so a request's logits, its token
and its walk's verdict are those it gets alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..speculative.tree import DraftTree
from ..speculative.verify import Verdict, verify_greedy_tokens, walk_tokens

if TYPE_CHECKING:
    from .context import ModeContext


@dataclass(eq=False)
class _Walk:
    """A greedy walk of the nodes ``[0, n)`` of ``tree``; ``feats``: node indices -> their features [k, hidden]."""

    ctx: ModeContext
    tree: DraftTree
    n: int
    feats: Callable[[list[int]], torch.Tensor]
    done: asyncio.Future


class NextTokens:
    """``compute``: the leader's compute (context.Compute), where the batched calls run."""

    def __init__(self, compute) -> None:
        self.compute = compute
        self._pending: list[tuple[ModeContext, torch.Tensor, asyncio.Future]] = []
        self._walks: list[_Walk] = []
        self._flusher: asyncio.Task | None = None
        # compute calls made, the requests' next tokens and walks they decided: (rows + walks) per call
        self.calls = 0
        self.rows = 0
        self.walks = 0

    async def decide(self, ctx: ModeContext, features: torch.Tensor) -> int:
        """The token at ``ctx.next_position`` from ``features`` [hidden] (ModeContext.next_token, batched)."""
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._pending.append((ctx, features, done))
        self._kick()
        return await done

    async def walk(self, ctx: ModeContext, tree: DraftTree, n: int,
                   feats: Callable[[list[int]], torch.Tensor]) -> Verdict:
        """The greedy verdict on the nodes ``[0, n)`` of ``tree`` (verify.verify_walk for a request whose
        ``argmax_only`` holds), its first LM-head call shared. ``feats`` is read on the compute thread."""
        done: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        self._walks.append(_Walk(ctx, tree, n, feats, done))
        self._kick()
        return await done

    def _kick(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush(), name="next-tokens")

    async def _flush(self) -> None:
        """Until the queues are empty: take everything queued, decide it in one compute call."""
        while self._pending or self._walks:
            batch = [b for b in self._pending if not b[2].done()]  # not a request whose client left
            walks = [w for w in self._walks if not w.done.done()]
            self._pending, self._walks = [], []
            if not batch and not walks:
                continue
            start = time.time()
            try:
                tokens, verdicts = await self.compute.run(_decide, batch, walks)
            except BaseException as e:
                for fut in [b[2] for b in batch] + [w.done for w in walks]:
                    if not fut.done():
                        fut.set_exception(e if isinstance(e, Exception) else RuntimeError("cancelled"))
                if not isinstance(e, Exception):
                    raise
                continue
            end = time.time()
            self.calls += 1
            self.rows += len(batch)
            self.walks += len(walks)
            for (c, _, fut), tok in zip(batch, tokens, strict=True):
                c.ledger.computed(start, end)
                if not fut.done():
                    fut.set_result(tok)
            for w, verdict in zip(walks, verdicts, strict=True):
                w.ctx.ledger.computed(start, end)
                if not w.done.done():
                    w.done.set_result(verdict)

    def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()


def _decide(batch: list[tuple[Any, torch.Tensor, asyncio.Future]], walks: list[_Walk]
            ) -> tuple[list[int], list[Verdict]]:
    """On the compute thread: every queued next token and walk. The rows that need the argmax alone (next tokens
    of greedy requests without logprobs, every walk's first rows) go in one Shard.greedy_tokens call (no [n, vocab]
    logits); other next tokens in one logits call. -> (the next tokens, the walks' verdicts)"""
    head = batch[0][0].head if batch else walks[0].ctx.head
    with torch.inference_mode():
        lazy = [walk_tokens(w.tree, w.n, lambda idx, w=w: head.greedy_tokens(w.feats(idx))) for w in walks]
        firsts = [rows.wanted(0) for rows in lazy]  # what each walk's first miss (at its root) would compute
        feats = torch.stack([f for _, f, _ in batch]) if batch else None  # [len(batch), hidden]
        argmax_next = feats is not None and all(ctx.argmax_only for ctx, _, _ in batch)
        parts = [feats] if argmax_next else []
        parts += [w.feats(idx) for w, idx in zip(walks, firsts, strict=True)]  # [len(idx), hidden] each
        ids = head.greedy_tokens(torch.cat(parts)).tolist() if parts else []  # [rows]
        if argmax_next:
            tokens = [ctx.took_next(int(t)) for (ctx, _, _), t in zip(batch, ids, strict=False)]
            ids = ids[len(batch):]
        elif feats is not None:
            logits = head.logits(feats)  # [len(batch), vocab]
            tokens = [ctx.choose_next(logits[i]) for i, (ctx, _, _) in enumerate(batch)]
        else:
            tokens = []
        verdicts = []
        for w, rows, idx in zip(walks, lazy, firsts, strict=True):
            rows.put(idx, ids[: len(idx)])
            ids = ids[len(idx):]
            verdicts.append(verify_greedy_tokens(w.tree, rows, stop_ids=w.ctx.stop_ids))
    return tokens, verdicts
