"""The leader's LM head over several requests at once: each request's next token (``ModeContext.decide``) is queued
here, and one call on the compute thread scores every queued request's features in one LM-head matmul, then
decides each token with that request's own sampling (its seed, its position). Requests whose results come back
while the compute thread is busy ride in the next call together, as the stages batch their forwards.

Lossless: the engine's LM head scores a row the same whatever rows are beside it, so a request's logits (and its
token) are those it gets alone.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .context import ModeContext


class NextTokens:
    """``compute``: the leader's compute (context.Compute), where the batched calls run."""

    def __init__(self, compute) -> None:
        self.compute = compute
        self._pending: list[tuple[ModeContext, torch.Tensor, asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None
        self.calls = 0  # compute calls made, and the requests' tokens they decided: rows per LM-head call
        self.rows = 0

    async def decide(self, ctx: ModeContext, features: torch.Tensor) -> int:
        """The token at ``ctx.next_position`` from ``features`` [hidden] (ModeContext.next_token, batched)."""
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._pending.append((ctx, features, done))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush(), name="next-tokens")
        return await done

    async def _flush(self) -> None:
        """Until the queue is empty: take every queued request, decide their tokens in one compute call."""
        while self._pending:
            batch, self._pending = self._pending, []
            batch = [b for b in batch if not b[2].done()]  # a request whose client left
            if not batch:
                continue
            start = time.time()
            try:
                tokens = await self.compute.run(_decide, batch)
            except BaseException as e:
                for *_, fut in batch:
                    if not fut.done():
                        fut.set_exception(e if isinstance(e, Exception) else RuntimeError("cancelled"))
                if not isinstance(e, Exception):
                    raise
                continue
            end = time.time()
            self.calls += 1
            self.rows += len(batch)
            for (c, _, fut), tok in zip(batch, tokens, strict=True):
                c.ledger.computed(start, end)
                if not fut.done():
                    fut.set_result(tok)

    def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()


def _decide(batch: list[tuple[Any, torch.Tensor, asyncio.Future]]) -> list[int]:
    """On the compute thread: one LM-head call over every request's features, then each request's choice. When
    every request of the call only needs the argmax (greedy, no logprobs) the call returns the argmax alone
    (Shard.greedy_tokens: no [n, vocab] logits)."""
    head = batch[0][0].head
    feats = torch.stack([f for _, f, _ in batch])  # [n, hidden]
    with torch.inference_mode():
        if all(ctx.argmax_only for ctx, _, _ in batch):
            tokens = head.greedy_tokens(feats).tolist()  # [n]
            return [ctx.took_next(int(t)) for (ctx, _, _), t in zip(batch, tokens, strict=True)]
        logits = head.logits(feats)  # [n, vocab]
    return [ctx.choose_next(logits[i]) for i, (ctx, _, _) in enumerate(batch)]
