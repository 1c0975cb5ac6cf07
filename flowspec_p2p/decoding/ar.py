"""Pipelined autoregressive decoding: the baseline every other mode is measured against (and must equal)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from .context import DecodingMode, ModeContext, prefill


async def ar_mode(ctx: ModeContext) -> AsyncIterator[list[int]]:
    """One token in flight; each step is one committing Forward."""
    stats = ctx.stats
    t0 = time.perf_counter()
    feats = await prefill(ctx)
    token = await ctx.compute(ctx.next_token, feats[-1])
    stats.prefill_s = time.perf_counter() - t0
    stats.steps, stats.new_tokens = 1, 1
    t1 = time.perf_counter()
    try:
        yield [token]
        pos = len(ctx.prompt)
        while stats.new_tokens < ctx.max_new_tokens and token not in ctx.stop_ids:
            await ctx.forward(parents=[-1], positions=[pos], tokens=[token], commit=True)
            _, tensors = await ctx.recv_forward()
            token = await ctx.compute(ctx.next_token, ctx.features(tensors)[-1])
            pos += 1
            stats.steps += 1
            stats.new_tokens += 1
            yield [token]
    finally:
        stats.decode_s = time.perf_counter() - t1


AR = DecodingMode("ar", ar_mode, description="pipelined autoregressive decoding, one token in flight")
