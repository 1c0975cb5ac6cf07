"""Draft trees as flat arrays: the one representation drafting, verification and the pipeline all share.

Glossary (speculative-decoding-notes §1.3-1.6, flowspec-algorithm.md §2, §5, §6):

    draft tree     candidate continuations of the committed prefix. Node 0 is the **root**: the last token the
                   target chose (decided, but its K/V not yet computed). Every other node is a drafted token.
                   Stored as ``tokens``, ``parents`` (-1 for the root), ``depth`` (root 0) and ``scores`` (the
                   draft's cumulative log-probability of the path, root 0), all indexed by tree index.
    parents first  every parent's index is smaller than its children's. All operations keep this, so a prefix
                   of the index order is always a valid (parent-closed) sub-tree: a *verified prefix*.
    EAGLE order    by depth, then creation (EAGLE-2's order after reranking).
    score order    descending cumulative score, ties by index (FlowSpec §3.1): the most likely nodes are
                   verified first. Scores never increase along a path, so parents still come first.
    position       absolute rotary position of a node = committed_len + depth.
    ancestor mask  [n, n] bool, row i True at i and at i's ancestors: whom node i may attend to in the tree
                   (plus, in the model, the whole committed prefix).
    prune          keep the accepted path plus the subtree of the new root (FlowSpec §5.1); the kept nodes are
                   re-indexed in their old relative order, so the prune is causal-consistent (kv_cache.keep).
    merge          append a freshly drafted tree from the same root, de-duplicated by token path; existing nodes
                   keep their indices (FlowSpec §6.1-6.2).
    segment        a contiguous index range ``[start, end)`` sent down the pipeline as one unit.

Pure: CPU tensors and Python lists, no model code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch

Order = Literal["eagle", "score"]


@dataclass(frozen=True, eq=False)
class DraftTree:
    tokens: torch.Tensor  # [n] int64 target token ids; tokens[0] is the root
    parents: torch.Tensor  # [n] int64 parent index (< own index); -1 for the root only
    depth: torch.Tensor  # [n] int64 distance from the root
    scores: torch.Tensor  # [n] float64 cumulative draft log-probability of the path (root 0; non-increasing)

    def __post_init__(self):
        n = self.tokens.shape[0]
        assert n >= 1, "a draft tree has at least its root"
        for t in (self.tokens, self.parents, self.depth, self.scores):
            assert t.shape == (n,), [tuple(x.shape) for x in (self.tokens, self.parents, self.depth, self.scores)]

    # -- construction ------------------------------------------------------------------------------------------

    @classmethod
    def root(cls, token: int) -> DraftTree:
        return cls.from_lists([token], [-1])

    @classmethod
    def from_lists(
        cls, tokens: Sequence[int], parents: Sequence[int], scores: Sequence[float] | None = None
    ) -> DraftTree:
        """Build from per-node tokens and parent indices (parents first); depth is derived."""
        depth: list[int] = []
        for i, p in enumerate(parents):
            assert (p == -1) == (i == 0), f"node {i} has parent {p}: exactly one root, at index 0"
            assert p < i, f"node {i} has parent {p}: parents must come first"
            depth.append(0 if p < 0 else depth[p] + 1)
        return cls(
            tokens=torch.tensor(list(tokens), dtype=torch.long),
            parents=torch.tensor(list(parents), dtype=torch.long),
            depth=torch.tensor(depth, dtype=torch.long),
            scores=torch.zeros(len(depth), dtype=torch.float64)
            if scores is None
            else torch.tensor(list(scores), dtype=torch.float64),
        )

    # -- structure ---------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @cached_property
    def token_list(self) -> list[int]:
        return self.tokens.tolist()

    @cached_property
    def parent_list(self) -> list[int]:
        return self.parents.tolist()

    @cached_property
    def children(self) -> list[list[int]]:
        """children[i]: i's children in index order (= score order for both orders)."""
        out: list[list[int]] = [[] for _ in range(len(self))]
        for i, p in enumerate(self.parent_list):
            if p >= 0:
                out[p].append(i)
        return out

    def child_with_token(self, node: int, token: int) -> int | None:
        for c in self.children[node]:
            if self.token_list[c] == token:
                return c
        return None

    def path_to(self, node: int) -> list[int]:
        """Indices root .. node."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parent_list[node]
        return path[::-1]

    def leaves(self) -> list[int]:
        return [i for i, c in enumerate(self.children) if not c]

    def paths(self) -> list[list[int]]:
        """Root-to-leaf index paths, one per leaf, in leaf index order."""
        return [self.path_to(leaf) for leaf in self.leaves()]

    def subtree(self, node: int) -> list[int]:
        """``node`` and all its descendants, in increasing index order."""
        inside = [False] * len(self)
        inside[node] = True
        out = [node]
        for i in range(node + 1, len(self)):
            p = self.parent_list[i]
            if p >= 0 and inside[p]:
                inside[i] = True
                out.append(i)
        return out

    # -- what the model needs ------------------------------------------------------------------------------------

    def positions(self, committed: int) -> torch.Tensor:
        """Absolute positions -> [n] int64."""
        return self.depth + committed

    def ancestor_mask(self) -> torch.Tensor:
        """[n, n] bool: row i is True at i and its ancestors."""
        n = len(self)
        mask = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self.parent_list):
            if p >= 0:
                mask[i] |= mask[p]
        return mask

    def attention_mask(self, committed: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Mask for running nodes ``[start, end)`` after the committed prefix and nodes ``[0, start)``:
        [end - start, committed + end] bool (True = visible), the layout ``Shard.forward`` expects."""
        end = len(self) if end is None else end
        assert 0 <= start <= end <= len(self)
        tree = self.ancestor_mask()[start:end, :end]  # [m, end]
        return torch.cat([torch.ones(end - start, committed, dtype=torch.bool), tree], dim=1)

    # -- orderings ---------------------------------------------------------------------------------------------

    def order(self, order: Order) -> list[int]:
        """The permutation (new index -> old index) that puts the tree in ``order``; stable on ties."""
        idx = list(range(len(self)))
        if order == "eagle":
            d = self.depth.tolist()
            return sorted(idx, key=lambda i: (d[i], i))
        s = self.scores.tolist()
        return [0, *sorted(idx[1:], key=lambda i: (-s[i], i))]

    def reordered(self, order: Order) -> DraftTree:
        return self.select(self.order(order), keep_order=True)

    # -- pruning and merging -------------------------------------------------------------------------------------

    def select(self, indices: Sequence[int], *, keep_order: bool = False) -> DraftTree:
        """The sub-tree on ``indices`` re-indexed 0, 1, ...: ``indices[0]`` becomes the root (depth and score
        re-based on it) and every other node's parent must be selected. Indices are sorted first unless
        ``keep_order`` (then they must already list parents first)."""
        idx = list(indices) if keep_order else sorted(indices)
        new_of = {old: new for new, old in enumerate(idx)}
        assert len(new_of) == len(idx), "duplicate indices"
        parents = [-1] + [new_of[self.parent_list[i]] for i in idx[1:]]  # KeyError: not parent-closed
        assert all(p < i for i, p in enumerate(parents)), "selection does not list parents first"
        t = torch.tensor(idx, dtype=torch.long)
        root = idx[0]
        return DraftTree(
            tokens=self.tokens[t],
            parents=torch.tensor(parents, dtype=torch.long),
            depth=self.depth[t] - self.depth[root],
            scores=self.scores[t] - self.scores[root],
        )

    def prune(self, accepted: Sequence[int], new_root: int | None) -> tuple[DraftTree | None, list[int]]:
        """FlowSpec §5.1-5.2: after accepting the path ``accepted`` (indices from the root), keep the subtree of
        ``new_root`` (a child of ``accepted[-1]``; None = truncate). Returns the new tree rooted at ``new_root``
        (None on truncation) and the kept old indices ``accepted ++ subtree(new_root)`` (strictly increasing:
        the ``keep`` list for every stage's KV cache)."""
        assert accepted
        assert accepted[0] == 0
        if new_root is None:
            return None, list(accepted)
        assert self.parent_list[new_root] == accepted[-1], (new_root, accepted)
        sub = self.subtree(new_root)
        return self.select(sub), [*accepted, *sub]

    def merge(self, other: DraftTree) -> tuple[DraftTree, list[int]]:
        """Append ``other`` (drafted from the same root token) de-duplicated by token path. New nodes go after the
        existing ones in ``other``'s index order, so existing indices never change; an appended node scores its
        merged parent's score plus its own step log-prob from ``other``. Returns the merged tree and, for each
        node of ``other``, its index in the merged tree."""
        assert other.token_list[0] == self.token_list[0], "merge needs the same root token"
        tokens, parents = list(self.token_list), list(self.parent_list)
        depth, scores = self.depth.tolist(), self.scores.tolist()
        children = [list(c) for c in self.children]
        where = [0]
        for j in range(1, len(other)):
            p = where[other.parent_list[j]]
            tok = other.token_list[j]
            hit = next((c for c in children[p] if tokens[c] == tok), None)
            if hit is None:
                hit = len(tokens)
                tokens.append(tok)
                parents.append(p)
                depth.append(depth[p] + 1)
                # the fresh draft's own log-prob for this step, on top of the merged parent's path score
                scores.append(scores[p] + float(other.scores[j] - other.scores[other.parent_list[j]]))
                children[p].append(hit)
                children.append([])
            where.append(hit)
        merged = DraftTree(
            tokens=torch.tensor(tokens, dtype=torch.long),
            parents=torch.tensor(parents, dtype=torch.long),
            depth=torch.tensor(depth, dtype=torch.long),
            scores=torch.tensor(scores, dtype=torch.float64),
        )
        return merged, where

    def limit_depth(self, max_depth: int) -> DraftTree:
        """Drop nodes deeper than ``max_depth`` (parent-closed, order kept)."""
        keep = (self.depth <= max_depth).nonzero().flatten().tolist()
        return self if len(keep) == len(self) else self.select(keep, keep_order=True)

    # -- checks ------------------------------------------------------------------------------------------------

    def check(self) -> None:
        """Assert the invariants every operation must keep (tests; cheap enough for debug runs)."""
        par = self.parent_list
        assert par[0] == -1
        assert int(self.depth[0]) == 0
        for i in range(1, len(self)):
            p = par[i]
            assert 0 <= p < i, f"node {i}: parent {p} not before it"
            assert int(self.depth[i]) == int(self.depth[p]) + 1, f"node {i}: depth"
            assert float(self.scores[i]) <= float(self.scores[p]) + 1e-12, f"node {i}: score above its parent's"
        for i, kids in enumerate(self.children):
            toks = [self.token_list[c] for c in kids]
            assert len(set(toks)) == len(toks), f"node {i}: siblings with equal tokens {toks}"


def segment_bounds(lengths: Sequence[int], start: int = 0) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` ranges for consecutive segment ``lengths`` (0-length segments allowed)."""
    out = []
    for n in lengths:
        assert n >= 0
        out.append((start, start + n))
        start += n
    return out


def split_lengths(n: int, parts: int, cap: int | None = None) -> list[int]:
    """Split ``n`` nodes into at most ``parts`` contiguous segments, sizes non-decreasing (larger segments last,
    as FlowSpec §3.1 does: the early, likelier nodes come back sooner); ``cap`` bounds each size."""
    assert n >= 0
    assert parts >= 1
    parts = min(parts, n) or 1
    base, extra = divmod(n, parts)
    sizes = [base] * (parts - extra) + [base + 1] * extra
    if cap is not None and sizes and sizes[-1] > cap:
        sizes = [cap] * (n // cap) + ([n % cap] if n % cap else [])
        sizes.sort()
    return sizes
