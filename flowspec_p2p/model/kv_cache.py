"""Per-request, per-stage KV cache with causal-consistent pruning.

Glossary (used the same way everywhere in this package):

    committed prefix   tokens the target has accepted; their K/V sit in slots [0, committed)
    pending            draft-tree nodes this stage has already processed, in tree-index order; their K/V sit in
                       slots [committed, length)
    keep(indices)      the causal-consistent prune (FlowSpec §5.3): of the pending entries, keep the ones at
                       ``indices`` (increasing offsets into the pending region), moved down to sit right after
                       the committed prefix, in order. Since a tree keeps parents before children and a prune
                       keeps relative order, every surviving node still sees exactly its ancestors.
    commit(n)          the first n pending entries become committed prefix.

Slots are preallocated (``capacity``); appends write at ``[length, length + n)``. No paging, no rollback:
truncation just moves ``length`` back.
"""

from __future__ import annotations

import torch

from ..errors import ContextOverflow


class KVCache:
    """K/V for ``num_layers`` layers. ``k[i]`` / ``v[i]``: [batch, kv_heads, capacity, head_dim]."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        *,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
    ):
        self.capacity = capacity
        self.batch = batch
        # [layers, batch, kv_heads, capacity, head_dim]. One sequence only ever reads the slots it wrote, so its
        # cache is left unwritten and its pages become resident as the context grows (a stage's 2048-token cache
        # costs memory only for the tokens it holds); the rows of a batch, masked over each other's padding, read
        # slots they never wrote, which must hold finite numbers.
        alloc = torch.empty if batch == 1 else torch.zeros
        self.k = alloc(num_layers, batch, kv_heads, capacity, head_dim, dtype=dtype)
        self.v = alloc(num_layers, batch, kv_heads, capacity, head_dim, dtype=dtype)
        self.length = 0  # slots in use: committed + pending
        self.committed = 0

    @property
    def pending(self) -> int:
        return self.length - self.committed

    def reserve(self, n: int) -> int:
        """Check room for ``n`` more entries; return the first slot they will occupy."""
        if self.length + n > self.capacity:
            raise ContextOverflow(
                f"KV cache full: {self.length} + {n} > capacity {self.capacity}; shorten the prompt or max tokens"
            )
        return self.length

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new K/V of one layer at slots [start, start + n); return K/V of slots [0, start + n).

        k, v: [batch, kv_heads, n, head_dim]
        """
        n = k.shape[2]
        kl, vl = self.k[layer], self.v[layer]  # [batch, kv_heads, capacity, head_dim]
        kl.narrow(2, start, n).copy_(k)  # narrow: cheaper to dispatch than tuple indexing
        vl.narrow(2, start, n).copy_(v)
        return kl.narrow(2, 0, start + n), vl.narrow(2, 0, start + n)

    def advance(self, n: int) -> None:
        """Mark ``n`` freshly written entries (all layers) as pending."""
        self.length += n

    def commit(self, n: int) -> None:
        """The first ``n`` pending entries become part of the committed prefix."""
        assert 0 <= n <= self.pending, (n, self.pending)
        self.committed += n

    def keep(self, indices: torch.Tensor | list[int]) -> None:
        """Causal-consistent prune: keep pending entries at ``indices`` (strictly increasing offsets into the
        pending region), compacted to slots [committed, committed + len(indices))."""
        idx = torch.as_tensor(indices, dtype=torch.long)  # [m]
        m = idx.numel()
        if m:
            assert idx.min() >= 0, idx.tolist()
            assert idx.max() < self.pending, (idx.tolist(), self.pending)
            assert bool((idx[1:] > idx[:-1]).all()), "keep() needs strictly increasing indices"
            src = idx + self.committed
            dst = slice(self.committed, self.committed + m)
            # [layers, batch, kv_heads, m, head_dim]; index_select copies, so overlapping moves are safe
            self.k[:, :, :, dst] = self.k.index_select(3, src)
            self.v[:, :, :, dst] = self.v.index_select(3, src)
        self.length = self.committed + m

    def truncate(self, length: int) -> None:
        """Drop every entry from slot ``length`` on (committed ones too, if ``length`` < committed)."""
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length
        self.committed = min(self.committed, length)

    def reset(self) -> None:
        self.length = 0
        self.committed = 0
