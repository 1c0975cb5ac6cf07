"""Sampling parameters and the target distribution they define.

``target_probs`` is *the* distribution every decoding mode must reproduce exactly (temperature, then top-k,
then top-p, as transformers applies them). Greedy (temperature 0) is argmax of the raw logits.

``PositionalDraws``: the pipeline's modes draw the token at absolute position t by inverse CDF from one uniform
that depends only on (seed, t). The reply is then a function of the seed and the prompt alone, whatever tree was
drafted or how often the request resumed on a new pipeline (speculative/verify.py, ``verify_positional``).
"""

from __future__ import annotations

import hashlib
import secrets

import numpy as np
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


def choose(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | PositionalDraws | None,
           position: int | None = None) -> int:
    """Next token from the logits of one position (absolute ``position``, for PositionalDraws). logits: [vocab]"""
    if params.greedy:
        return int(logits.argmax())
    assert gen is not None
    if isinstance(gen, PositionalDraws):
        assert position is not None, "positional draws need the position"
        return gen.sample(logits, params, position)
    return sample(target_probs(logits, params), gen)


def inverse_cdf(p: np.ndarray, u: float) -> int:
    """Token for one uniform draw from the (possibly unnormalised) distribution p. [vocab] -> id with p > 0."""
    cdf = np.cumsum(p)
    y = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return min(y, p.shape[0] - 1)


class PositionalDraws:
    """One uniform in [0, 1) per absolute position, from (seed, position) only: BLAKE2b of both, 53 bits."""

    def __init__(self, seed: int | None = None):
        self.seed = secrets.randbits(63) if seed is None else seed

    def uniform(self, position: int) -> float:
        assert position >= 0
        h = hashlib.blake2b(f"{self.seed}:{position}".encode(), digest_size=8).digest()
        return (int.from_bytes(h, "little") >> 11) / float(1 << 53)

    def sample(self, logits: torch.Tensor, params: SamplingParams, position: int) -> int:
        """The token at ``position`` from the target distribution of ``logits`` [vocab]."""
        if params.greedy:
            return int(logits.argmax())
        return inverse_cdf(target_probs(logits, params).numpy(), self.uniform(position))
