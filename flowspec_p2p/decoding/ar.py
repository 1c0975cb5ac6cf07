"""Pipelined autoregressive decoding: the baseline every other mode is measured against (and must equal)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from .context import DecodingMode, ModeContext, prefill


async def ar_mode(ctx: ModeContext) -> AsyncIterator[list[int]]:
    """One token in flight; each step is one committing Forward."""
    ledger = ctx.ledger
    t0 = time.perf_counter()
    feats = await prefill(ctx)
    token = await ctx.decide(feats[-1])
    ledger.prefilled(len(ctx.prompt), time.perf_counter() - t0)
    t1 = time.perf_counter()
    try:
        yield [token]
        pos = len(ctx.prompt)
        while ctx.remaining > 0 and token not in ctx.stop_ids:
            await ctx.forward(parents=[-1], positions=[pos], tokens=[token], commit=True)
            _, tensors = await ctx.recv_forward()
            f = ctx.features(tensors)  # [1, hidden]
            ctx.keep(f)
            token = await ctx.decide(f[-1])
            pos += 1
            ledger.stepped(1)
            yield [token]
    finally:
        ledger.decoded(time.perf_counter() - t1)


AR = DecodingMode("ar", ar_mode, description="pipelined autoregressive decoding, one token in flight")
