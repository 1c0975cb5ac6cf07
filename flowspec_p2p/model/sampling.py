"""Sampling parameters and the target distribution they define.

``target_probs`` is *the* distribution every decoding mode must reproduce exactly (temperature, then top-k,
then top-p, as transformers applies them). Greedy (temperature 0) is argmax of the raw logits.
"""

from __future__ import annotations

import torch
from pydantic import Field

from ..types import Settings


class SamplingParams(Settings):
    temperature: float = Field(0.0, ge=0.0, le=100.0)  # 0 = greedy
    top_k: int = Field(0, ge=0)  # 0 = off
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self) -> torch.Generator:
        g = torch.Generator()
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [..., vocab] -> probabilities [..., vocab] (float64 for exact residual arithmetic)."""
    assert not params.greedy
    x = logits.to(torch.float64) / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop_sorted = cum <= (1 - params.top_p)
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)


def sample(probs: torch.Tensor, gen: torch.Generator) -> int:
    """probs: [vocab] -> one token id."""
    return int(torch.multinomial(probs, 1, generator=gen))


def choose(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """Next token from the logits of one position. logits: [vocab]"""
    if params.greedy:
        return int(logits.argmax())
    assert gen is not None
    return sample(target_probs(logits, params), gen)
