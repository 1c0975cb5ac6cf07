"""Training-time test (EAGLE-3, arXiv 2503.01840 §3.2): the head unrolled over its own predicted features.

At inference the head drafts a chain from the committed context: pair (f_c, x_{c+1}) gives f^_{c+1}; then
(f^_{c+1}, y_{c+2}) at position c+1 gives f^_{c+2}, attending to the context's keys and to the chain's own
earlier keys. Training reproduces that for every start i at once, with teacher-forced tokens (a chain level
only counts when the levels above it were accepted, i.e. when its tokens were the target's):

    step 0   pairs (f_i, x_{i+1}) at positions i, causal over step-0 keys             -> g0_i ~ f_{i+1}
    step k   pairs (g{k-1}_i, x_{i+k+1}) at positions i+k; query i sees step-0 keys <= i and the step-1..k
             keys of its own start i (the chain it belongs to)                           -> gk_i ~ f_{i+k+1}

The head runs through its public ``forward`` with a list-backed cache (no in-place writes, so autograd works)
and explicit masks; ``unrolled`` is thus the very computation the drafter does, step by step.
"""

from __future__ import annotations

import torch

from ..speculative.head import DraftHead


class ListCache:
    """Duck-typed ``KVCache`` for one layer that concatenates instead of writing in place."""

    def __init__(self) -> None:
        self.ks: list[torch.Tensor] = []
        self.vs: list[torch.Tensor] = []
        self.length = 0

    def reserve(self, n: int) -> int:
        return self.length

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [batch, kv_heads, n, head_dim] -> all keys/values so far [batch, kv_heads, length + n, head_dim]"""
        assert layer == 0
        assert start == self.length
        self.ks.append(k)
        self.vs.append(v)
        return torch.cat(self.ks, dim=2), torch.cat(self.vs, dim=2)

    def advance(self, n: int) -> None:
        self.length += n


def unroll_mask(n: int, step: int) -> torch.Tensor:
    """Keys visible to step ``step``'s n queries over [step-0 keys | step-1 keys | ... | step-``step`` keys].
    -> [n, (step + 1) * n] bool"""
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    eye = torch.eye(n, dtype=torch.bool)
    return torch.cat([causal] + [eye] * step, dim=1)


def unrolled(
    head: DraftHead,
    features: torch.Tensor,  # [n, hidden]  f_{c..c+n-1}
    next_embeds: torch.Tensor,  # [n + steps - 1, hidden]  embed(x_{c+1..c+n+steps-1}) (zero-padded past the end)
    offset: int,  # c: rotary position of pair 0
    steps: int,
) -> list[torch.Tensor]:
    """-> [g0, g1, ...]: step k's predicted features, [n, hidden], row i estimating f_{c+i+k+1}."""
    n = features.shape[0]
    assert next_embeds.shape[0] >= n + steps - 1, (next_embeds.shape, n, steps)
    cache = ListCache()
    positions = torch.arange(offset, offset + n)[None]  # [1, n]
    out = []
    x = features
    for k in range(steps):
        mask = None if k == 0 else unroll_mask(n, k)[None]  # [1, n, (k + 1) n]
        g = head(x[None], next_embeds[k : k + n][None], positions + k, cache, mask)[0]  # [n, hidden]
        out.append(g)
        x = g
    return out
