"""The leader's prompt cache: a conversation's next turn starts from the KV its previous turns left on every stage.

A request that completes leaves its committed positions retained on every stage (``Release.retain``) and here its
entry: the token ids of those positions and their target features (what the drafter needs to draft after them).
A new request whose prompt starts with an entry's tokens reuses the longest such prefix (``Forward.reuse``): every
stage takes the retained KV over and only the rest of the prompt is prefilled. Lossless: the engine computes each
position's K/V from the same inputs whether in a prefill chunk or a decode step, so the reused KV is the KV a cold
prefill would compute.

Entries are bound to a pipeline (a re-plan drops them: the stages that held them are gone) and share the memory
budget of requests in flight: a retained entry holds as much KV on every stage as a request, so the leader keeps at
most ``max_requests`` minus those in flight, dropping the least recently used first (``Release`` without retain).
Pure bookkeeping: no asyncio, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MIN_REUSE = 16  # shared prefix tokens below which a cold prefill is as cheap


@dataclass(frozen=True)
class Entry:
    tokens: tuple[int, ...]  # the committed positions' token ids
    features: torch.Tensor  # [len(tokens), hidden] their target features


@dataclass(frozen=True)
class Reuse:
    """What a new request takes over: the retained request ``rid``'s first ``length`` positions."""

    rid: str
    length: int
    features: torch.Tensor  # [length, hidden]


class PromptCache:
    def __init__(self) -> None:
        self.entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self.hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, rid: str, tokens: Sequence[int], features: torch.Tensor) -> None:
        assert features.shape[0] == len(tokens), (tuple(features.shape), len(tokens))
        self.entries[rid] = Entry(tuple(tokens), features)

    def take(self, prompt: Sequence[int]) -> Reuse | None:
        """The entry sharing the longest prefix with ``prompt`` (at least MIN_REUSE tokens, and one prompt token left
        to prefill), removed: the new request owns that KV now. None: prefill cold."""
        best, best_len = None, 0
        for rid, e in self.entries.items():
            n = _common_prefix(e.tokens, prompt)
            if n > best_len:
                best, best_len = rid, n
        best_len = min(best_len, len(prompt) - 1)
        if best is None or best_len < MIN_REUSE:
            return None
        entry = self.entries.pop(best)
        self.hits += 1
        self.reused_tokens += best_len
        return Reuse(best, best_len, entry.features[:best_len])

    def evict(self, keep: int) -> list[str]:
        """Drop the least recently used entries until at most ``keep`` remain. -> their request ids (to release)."""
        out = []
        while len(self.entries) > max(0, keep):
            rid, _ = self.entries.popitem(last=False)
            out.append(rid)
        return out

    def clear(self) -> list[str]:
        return self.evict(0)

    def snapshot(self) -> dict:
        return {"entries": len(self.entries), "hits": self.hits, "reused_tokens": self.reused_tokens}


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
