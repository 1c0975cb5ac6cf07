"""Batched, KV-cached generation with continuous batching, recording the target's features as it goes.

Glossary:
    row        one of the ``batch`` lanes of the shared KV cache; it holds one request at a time
    start[r]   the first cache slot of row r's request: row r sees keys in slots [start[r], length)
    refill     a finished row takes the next request: its prompt is prefilled on its own (batch 1, no padding)
               and its K/V copied into row r at slots [length - p, length), right-aligned with the present, so
               every row always writes its next token at the same slot ``length``
    compact    when the cache is full, slots below min(start) (seen by no row) are dropped

Each row's positions are its own (0 for its first prompt token), so slot offsets never reach the rotary
embedding and a row's tokens equal unbatched greedy decoding (up to float rounding in the masked attention).

Recorded per request: the tokens (prompt + answer) and the final-normed features of every position that went
through the target: all prompt tokens and every answer token but the last (nothing is fed after it), i.e.
``len(tokens) - 1`` features. Feature t is the target's state after token t; it predicts token t+1.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from ..model.engine import Shard
from ..model.kv_cache import KVCache

log = logging.getLogger(__name__)

LOOP_WINDOW = 48  # answer tokens checked for a repetition loop
LOOP_MAX_PERIOD = 16  # a loop repeats a cycle of at most this many tokens
LOOP_CHECK_EVERY = 8  # steps between loop checks


@dataclass
class Request:
    key: str
    prompt: list[int]
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0


@dataclass
class Finished:
    key: str
    prompt_len: int
    tokens: list[int]  # prompt + answer
    features: torch.Tensor  # [len(tokens) - 1, hidden], float16
    temperature: float
    reason: str  # "stop" | "length" | "loop"


@dataclass
class _Row:
    req: Request
    answer: list[int] = field(default_factory=list)
    feats: list[torch.Tensor] = field(default_factory=list)  # each [n, hidden]
    gen: torch.Generator | None = None


def has_loop(answer: list[int]) -> bool:
    """The last LOOP_WINDOW tokens repeat one cycle of at most LOOP_MAX_PERIOD tokens."""
    if len(answer) < LOOP_WINDOW + LOOP_MAX_PERIOD:
        return False
    tail = answer[-LOOP_WINDOW:]
    return any(tail == answer[-LOOP_WINDOW - d : -d] for d in range(1, LOOP_MAX_PERIOD + 1))


class BatchGenerator:
    """Greedy / sampled generation of many requests on a whole-model shard, ``batch`` rows at a time."""

    def __init__(
        self,
        model: Shard,
        *,
        batch: int,
        max_new_tokens: int,
        stop_ids: frozenset[int],
        capacity: int | None = None,
        max_prompt: int = 512,
        record: bool = True,
        stop_loops: bool = True,
    ):
        assert model.has_embed
        assert model.has_head
        self.model = model
        self.batch = batch
        self.max_new = max_new_tokens
        self.stop_ids = stop_ids
        self.max_prompt = max_prompt
        self.capacity = capacity or max_prompt + max_new_tokens + 256
        self.record = record
        self.stop_loops = stop_loops

    @torch.inference_mode()
    def run(self, requests: Iterable[Request]) -> Iterator[Finished]:
        """Yield each request's result as it finishes (not in request order)."""
        todo = iter(requests)
        b = self.batch
        cache = self.model.new_cache(self.capacity, batch=b)
        rows: list[_Row | None] = [None] * b
        start = torch.zeros(b, dtype=torch.long)  # [b] first visible slot per row
        pos = torch.zeros(b, dtype=torch.long)  # [b] position of the next fed token per row
        exhausted = False
        step = 0
        while True:
            # 1. refill free rows (their prompt's first answer token comes out of the prefill)
            free = [r for r in range(b) if rows[r] is None]
            if free and not exhausted:
                new = []
                for _ in free:
                    req = next(todo, None)
                    if req is None:
                        exhausted = True
                        break
                    new.append(req)
                if new:
                    yield from self._refill(cache, rows, start, pos, free[: len(new)], new)
            active = [r for r in range(b) if rows[r] is not None]
            if not active:
                return
            # 2. one decode step for every row (free rows compute garbage that nobody sees)
            if cache.length + 1 > cache.capacity:
                self._compact(cache, rows, start)
            length = cache.length
            ids = torch.zeros(b, 1, dtype=torch.long)  # [b, 1]
            for r in active:
                ids[r, 0] = rows[r].answer[-1]
            start[[r for r in range(b) if rows[r] is None]] = length  # free rows see only themselves
            mask = (torch.arange(length + 1)[None, :] >= start[:, None])[:, None, :]  # [b, 1, length + 1]
            feats = self.model(ids, cache, pos[:, None], mask)[:, 0]  # [b, hidden]
            pos += 1
            logits = self.model.logits(feats[active])  # [n_active, vocab]
            step += 1
            for i, r in enumerate(active):
                row = rows[r]
                if self.record:
                    row.feats.append(feats[r : r + 1].to(torch.float16))
                row.answer.append(self._choose(logits[i], row))
                reason = self._finished(row, step)
                if reason:
                    yield self._finish(row, reason)
                    rows[r] = None

    # ----------------------------------------------------------------------------------------- pieces

    def _choose(self, logits: torch.Tensor, row: _Row) -> int:
        """logits: [vocab] -> next token of ``row`` (greedy, or sampled at the request's temperature)."""
        if row.req.temperature == 0.0:
            return int(logits.argmax())
        probs = (logits.to(torch.float64) / row.req.temperature).softmax(-1)
        return int(torch.multinomial(probs, 1, generator=row.gen))

    def _finished(self, row: _Row, step: int) -> str | None:
        if row.answer[-1] in self.stop_ids:
            return "stop"
        if len(row.answer) >= self.max_new:
            return "length"
        if self.stop_loops and step % LOOP_CHECK_EVERY == 0 and has_loop(row.answer):
            return "loop"
        return None

    def _finish(self, row: _Row, reason: str) -> Finished:
        req = row.req
        tokens = req.prompt + row.answer
        if self.record:
            feats = torch.cat(row.feats)  # [len(tokens) - 1, hidden]
            assert feats.shape[0] == len(tokens) - 1, (feats.shape, len(tokens))
        else:
            feats = torch.empty(0, self.model.cfg.hidden_size, dtype=torch.float16)
        return Finished(req.key, len(req.prompt), tokens, feats, req.temperature, reason)

    def _refill(self, cache: KVCache, rows, start, pos, slots: list[int], reqs: list[Request]) -> Iterator[Finished]:
        """Prefill each of ``reqs`` on its own (no padding), splice its K/V into row ``slots[i]`` of ``cache``."""
        for r, q in zip(slots, reqs, strict=True):
            p = len(q.prompt)
            assert 0 < p <= self.max_prompt, (q.key, p)
            small = self.model.new_cache(p)
            feats = self.model(torch.tensor([q.prompt]), small)[0]  # [p, hidden]
            if p > cache.length:  # make room on the left: shift every row right
                self._shift_right(cache, start, p - cache.length)
            length = cache.length
            cache.k[:, r, :, length - p : length] = small.k[:, 0]
            cache.v[:, r, :, length - p : length] = small.v[:, 0]
            start[r] = length - p
            pos[r] = p
            row = _Row(q)
            if q.temperature > 0:
                row.gen = torch.Generator().manual_seed(q.seed)
            if self.record:
                row.feats.append(feats.to(torch.float16))
            row.answer.append(self._choose(self.model.logits(feats[-1]), row))
            rows[r] = row
            reason = self._finished(row, 0)
            if reason:
                yield self._finish(row, reason)
                rows[r] = None

    @staticmethod
    def _shift_right(cache: KVCache, start: torch.Tensor, d: int) -> None:
        n = cache.length
        assert n + d <= cache.capacity, "cache too small for this prompt"
        cache.k[:, :, :, d : n + d] = cache.k[:, :, :, :n].clone()
        cache.v[:, :, :, d : n + d] = cache.v[:, :, :, :n].clone()
        cache.length += d
        start += d

    @staticmethod
    def _compact(cache: KVCache, rows, start: torch.Tensor) -> None:
        active = [r for r in range(len(rows)) if rows[r] is not None]
        d = int(start[active].min())
        if d == 0:
            raise RuntimeError("KV cache full and nothing to drop: raise capacity")
        n = cache.length
        cache.k[:, :, :, : n - d] = cache.k[:, :, :, d:n].clone()
        cache.v[:, :, :, : n - d] = cache.v[:, :, :, d:n].clone()
        cache.length -= d
        start -= d
        start.clamp_(min=0)
