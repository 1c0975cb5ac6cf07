"""Lossless verification of a draft tree against the target (speculative-decoding-notes §1.5; FlowSpec §4).

Glossary (tree words as in tree.py):

    verified prefix  the nodes ``[0, verified_end)`` whose target logits are known. Single-device speculation
                     verifies the whole tree at once; FlowSpec verifies a prefix of the score-ordered tree per
                     pipeline step. The root (index 0) is always verified.
    walk             start at the root; move to a verified child the target accepts; stop at a leaf, when every
                     verified child was rejected, or at the first child not verified yet.
    bonus token      the target's own token after the last accepted node (its argmax, or a sample from the
                     residual). Single-device speculation commits it; FlowSpec calls it x_new and continues the
                     round if it equals an *unverified* child (``next_child``) whose subtree is already in flight.
    residual         greedy: nothing. Sampling (EAGLE-2, deterministic drafts, q = 1): at a node with target
                     distribution p, try the verified children in index order: accept child x with probability
                     p_res(x); on rejection set p_res(x) = 0 and renormalise. The bonus is drawn from p_res (= p
                     at a leaf or when no child was tried). P(emit y) telescopes to p(y): the output follows the
                     target distribution exactly, whatever the tree.
    stop token       an accepted stop token (EOS) ends the reply: the walk stops there and there is no bonus.

Pure functions. Target rows come through ``Rows`` (a [m, vocab] tensor, or ``LazyRows`` so that the LM head
runs only for the nodes the walk visits: on a small target it costs as much per node as several layers).
``walk_rows`` computes a few rows per LM-head call, the visited node's and those the walk most likely visits next
(its first-child chain, then its other children): the quantized LM head streams its weights once for up to
``ROW_BATCH`` rows at little more than one row's cost, and a row's values do not depend on its batch. A greedy
walk needs only each row's argmax: ``walk_tokens`` asks the LM head for those alone (Shard.greedy_tokens, the same
ids as the logits' argmax) and ``verify_greedy_tokens`` walks them, so no [k, vocab] logits are held.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..model.sampling import PositionalDraws, SamplingParams, inverse_cdf, target_probs
from .tree import DraftTree


class Rows(Protocol):
    """Per-node target rows, indexable by tree index < len: a [m, vocab] tensor or ``LazyRows``."""

    def __getitem__(self, i: int) -> torch.Tensor: ...
    def __len__(self) -> int: ...


ROW_BATCH = 4  # LM-head rows per call in walk_rows (native Q8_0 head, 1 thread: 4 rows cost 1.07x one row)


class LazyRows:
    """Rows computed on first access and memoised: ``fn(i)`` -> [vocab]. With ``many`` (indices -> [k, vocab])
    and ``plan`` (i -> the indices worth computing along with i, best first), a miss at i computes i and up to
    ``batch - 1`` planned rows not computed yet in one call."""

    def __init__(self, n: int, fn: Callable[[int], torch.Tensor] | None = None, *,
                 many: Callable[[list[int]], torch.Tensor] | None = None,
                 plan: Callable[[int], Sequence[int]] | None = None, batch: int = 1):
        assert (fn is None) != (many is None), "give fn or many"
        self.n = n
        self.fn = fn
        self.many = many
        self.plan = plan
        self.batch = batch
        self._rows: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        assert 0 <= i < self.n, (i, self.n)
        row = self._rows.get(i)
        if row is not None:
            return row
        if self.many is None:
            row = self._rows[i] = self.fn(i)
            return row
        want = self.wanted(i)
        self.put(want, self.many(want))  # [len(want), vocab]
        return self._rows[i]

    def wanted(self, i: int) -> list[int]:
        """The rows a miss at ``i`` computes: i, then up to ``batch - 1`` planned rows not computed yet."""
        want = [i]
        for j in self.plan(i) if self.plan is not None else ():
            if len(want) == self.batch:
                break
            if j != i and 0 <= j < self.n and j not in self._rows and j not in want:
                want.append(j)
        return want

    def put(self, idx: Sequence[int], rows: torch.Tensor | Sequence) -> None:
        """Rows computed elsewhere (a call shared with other walks: decoding/batcher.py): rows[r] is node idx[r]'s."""
        for r, j in enumerate(idx):
            self._rows[j] = rows[r]

    @property
    def computed(self) -> list[int]:
        """The rows computed so far, in the order they were."""
        return list(self._rows)


def likely_next(tree: DraftTree, node: int) -> list[int]:
    """The nodes a walk from ``node`` most likely visits next: its first-child chain (each child is the drafter's
    best at its parent), then its other children."""
    children = tree.children
    chain, n = [], node
    while children[n]:
        n = children[n][0]
        chain.append(n)
    return chain + children[node][1:]


def walk_rows(tree: DraftTree, n: int, many: Callable[[list[int]], torch.Tensor]) -> LazyRows:
    """Target rows of the nodes ``[0, n)`` of ``tree``, ``ROW_BATCH`` per call where the walk likely goes.
    many: node indices -> their rows [k, vocab] (the LM head over those nodes' features)."""
    return LazyRows(n, many=many, plan=lambda i: likely_next(tree, i), batch=ROW_BATCH)


def walk_tokens(tree: DraftTree, n: int, many: Callable[[list[int]], torch.Tensor]) -> LazyRows:
    """The target's greedy token after each of the nodes ``[0, n)`` of ``tree``, computed as ``walk_rows`` computes
    rows. many: node indices -> their argmax ids [k] (Shard.greedy_tokens over those nodes' features: the LM head
    keeps its maxima, so no [k, vocab] logits are held; 1 MiB a row on a 262k vocabulary)."""
    return LazyRows(n, many=many, plan=lambda i: likely_next(tree, i), batch=ROW_BATCH)


@dataclass(frozen=True)
class Verdict:
    accepted: list[int]  # tree indices of the accepted path, from the root (always [0, ...])
    token: int | None  # the bonus token / x_new; None when an accepted stop token ended the reply
    next_child: int | None  # the not-yet-verified child of accepted[-1] whose token == token, if any

    @property
    def stopped(self) -> bool:
        return self.token is None

    @property
    def confirmed(self) -> int:
        """Levels of the draft the target confirmed: the accepted path, one more when the bonus token is a drafted
        child not verified yet (FlowSpec continues there: that draft was right)."""
        return len(self.accepted) - 1 + (self.next_child is not None)

    def emitted(self, tree: DraftTree) -> list[int]:
        """The tokens this verification adds to the reply: accepted drafted tokens, then the bonus."""
        out = [tree.token_list[i] for i in self.accepted[1:]]
        return out if self.token is None else [*out, self.token]


def verify_greedy(
    tree: DraftTree, logits: Rows, *, verified_end: int | None = None, stop_ids: frozenset[int] = frozenset()
) -> Verdict:
    """Longest path whose every token is the target's argmax at its parent, plus the argmax after it.

    logits: rows [vocab] for nodes < verified_end (default len(logits)). Equivalent to EAGLE's
    ``evaluate_posterior`` (siblings have distinct tokens, so at most one child can match).
    """
    end = len(logits) if verified_end is None else verified_end
    return _follow(tree, end, stop_ids, lambda node: int(logits[node].argmax()))


def verify_greedy_tokens(tree: DraftTree, tokens: Rows, *, verified_end: int | None = None,
                         stop_ids: frozenset[int] = frozenset()) -> Verdict:
    """``verify_greedy`` from the target's argmax at each node instead of its logits rows: tokens[i] is the id
    ``logits[i].argmax()`` would give (a 0-d tensor or an int; ``walk_tokens``), for nodes < verified_end (default
    len(tokens)). The same verdict, bit for bit."""
    end = len(tokens) if verified_end is None else verified_end
    return _follow(tree, end, stop_ids, lambda node: int(tokens[node]))


def _follow(tree: DraftTree, end: int, stop_ids: frozenset[int], pick: Callable[[int], int]) -> Verdict:
    """From the root, move to the child holding ``pick(node)`` (the token the target puts after ``node``) while there
    is one verified (< end); stop after a stop token. The last pick is the bonus token."""
    assert 1 <= end <= len(tree)
    node, accepted = 0, [0]
    while True:
        if node and tree.token_list[node] in stop_ids:
            return Verdict(accepted, None, None)
        y = pick(node)
        child = tree.child_with_token(node, y)
        if child is not None and child < end:
            accepted.append(child)
            node = child
            continue
        return Verdict(accepted, y, child)


def verify_sampling(
    tree: DraftTree,
    probs: Rows,
    uniforms: np.ndarray | torch.Tensor,
    *,
    verified_end: int | None = None,
    stop_ids: frozenset[int] = frozenset(),
) -> Verdict:
    """EAGLE-2 sibling-by-sibling rejection (q = 1 for deterministic drafts); keeps the target distribution.

    probs: rows [vocab] of the target distribution (``sampling.target_probs``: temperature, top-k, top-p) for
        nodes < verified_end (default len(probs)).
    uniforms: [>= len(tree) + 1] independent U[0, 1) draws; one per child test, one for the bonus.
    """
    end = len(probs) if verified_end is None else verified_end
    assert 1 <= end <= len(tree)
    u = uniforms.numpy() if isinstance(uniforms, torch.Tensor) else uniforms
    assert u.ndim == 1, u.shape
    assert u.shape[0] >= len(tree) + 1, (u.shape, len(tree))
    k = 0  # next unused uniform
    node, accepted = 0, [0]
    while True:
        if node and tree.token_list[node] in stop_ids:
            return Verdict(accepted, None, None)
        p = _row(probs[node])  # [vocab] float64, residual (a private copy)
        moved = False
        for child in tree.children[node]:
            if child >= end:  # verified children form an index prefix: the rest are unverified too
                break
            x = tree.token_list[child]
            if u[k] < p[x]:
                k += 1
                accepted.append(child)
                node, moved = child, True
                break
            k += 1
            p[x] = 0.0
            p /= p.sum()
        if moved:
            continue
        y = _inverse_cdf(p, float(u[-1]))
        nxt = tree.child_with_token(node, y)
        assert nxt is None or nxt >= end, "a rejected child cannot be sampled from the residual"
        return Verdict(accepted, y, nxt)


def verify_positional(
    tree: DraftTree,
    probs: Rows,
    draws: PositionalDraws,
    root_position: int,
    *,
    verified_end: int | None = None,
    stop_ids: frozenset[int] = frozenset(),
) -> Verdict:
    """The walk of ``verify_greedy`` with the argmax replaced by the target's own sample at each position: the token
    after node i (at depth d) is ``inverse_cdf(p_i, u(root_position + d + 1))``, and the walk moves to the child with
    that token. Every emitted token is an exact draw from the target given the prefix, with one uniform per absolute
    position, so the reply depends only on (seed, prompt): the same text whatever tree was drafted, and after a
    resume. A child holding that token is accepted with probability p(x), the same as sibling-by-sibling
    rejection of deterministic drafts (``verify_sampling``).

    probs: rows [vocab] of the target distribution for nodes < verified_end (default len(probs)).
    root_position: absolute position of the tree's root token (the committed tokens before it)."""
    end = len(probs) if verified_end is None else verified_end
    depth = tree.depth.tolist()
    return _follow(tree, end, stop_ids,
                   lambda node: inverse_cdf(_row(probs[node]), draws.uniform(root_position + depth[node] + 1)))


def verify_tree(tree: DraftTree, logits: Rows, params: SamplingParams, gen: torch.Generator | PositionalDraws | None,
                *, verified_end: int | None = None, stop_ids: frozenset[int] = frozenset(),
                root_position: int | None = None) -> Verdict:
    """Verify ``tree`` as ``params`` say: the greedy walk (temperature 0); with ``PositionalDraws`` and the root's
    absolute position, ``verify_positional``; else exact rejection sampling with ``len(tree) + 1`` uniforms from
    ``gen``. logits: target logits rows (usually ``LazyRows``)."""
    if params.greedy:
        return verify_greedy(tree, logits, verified_end=verified_end, stop_ids=stop_ids)
    if isinstance(gen, PositionalDraws):
        assert root_position is not None, "positional draws need the root's position"
        probs = LazyRows(len(logits), lambda i: target_probs(logits[i], params))
        return verify_positional(tree, probs, gen, root_position, verified_end=verified_end, stop_ids=stop_ids)
    probs = LazyRows(len(logits), lambda i: target_probs(logits[i], params))
    uniforms = torch.rand(len(tree) + 1, generator=gen, dtype=torch.float64)
    return verify_sampling(tree, probs, uniforms, verified_end=verified_end, stop_ids=stop_ids)


def verify_walk(tree: DraftTree, n: int, params: SamplingParams, gen: torch.Generator | PositionalDraws | None, *,
                logits: Callable[[list[int]], torch.Tensor], tokens: Callable[[list[int]], torch.Tensor],
                stop_ids: frozenset[int] = frozenset(), root_position: int | None = None, keep_rows: bool = False
                ) -> tuple[Verdict, LazyRows | None]:
    """Verify the nodes ``[0, n)`` of ``tree`` (the verified prefix) as ``params`` say, the LM head computed only
    where the walk goes (``ROW_BATCH`` nodes per call). A greedy walk asks ``tokens`` (node indices -> their argmax
    ids [k], Shard.greedy_tokens) unless ``keep_rows`` (the caller reads the rows: logprobs); else ``logits`` (node
    indices -> their rows [k, vocab]). -> (verdict, the logits rows the walk read; None for a walk on tokens)"""
    if params.greedy and not keep_rows:
        return verify_greedy_tokens(tree, walk_tokens(tree, n, tokens), stop_ids=stop_ids), None
    rows = walk_rows(tree, n, logits)
    return verify_tree(tree, rows, params, gen, verified_end=n, stop_ids=stop_ids, root_position=root_position), rows


def _row(row: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(row, torch.Tensor):
        row = row.detach().numpy()
    assert row.ndim == 1
    return np.array(row, dtype=np.float64)  # copy


_inverse_cdf = inverse_cdf
