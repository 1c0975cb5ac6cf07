"""Drafters: EAGLE-2 dynamic draft trees (speculative-decoding-notes §1.3; FlowSpec §3.1, §6.1).

Glossary (tree words as in tree.py):

    drafter        keeps its own KV cache of the committed context and drafts a tree from the root.
    feed           tell the drafter about newly committed tokens: ``tokens`` (x_t ...), the target's
                   ``features`` at them (f_t ...) and the token after them (``next_token``, the new root).
                   An EAGLE head consumes the pairs (f_t, x_t+1); the oracle consumes the tokens themselves.
    EAGLE-2 tree   expand the root's top-k children; then, ``depth - 1`` times, run the k frontier nodes in one
                   forward (tree mask: committed context + ancestors + self), give each its top-k children with
                   cumulative log-prob score = parent's + own, and keep the global top-k of those k*k as the
                   next frontier. Finally rerank: keep the ``total_tokens - 1`` best-scoring candidates (ties by
                   creation, so parents always win and the selection is parent-closed) plus the root.
    draft vocabulary an EAGLE head may score only V_d frequent tokens (``draft_vocab`` maps draft id -> target
                   id); the tree holds target ids, and verification is over the full vocabulary (lossless).
    expansion      FlowSpec: after a partial acceptance, feed the newly committed tokens, draft from the new root
                   one level at a time (``draft_levels``) and merge each level into the pruned tree (flowspec.py).

Two drafters plug into the same loop: ``HeadDrafter`` (a trained or random ``head.DraftHead``) and
``OracleDrafter`` (the target itself: greedy drafts are always accepted; for tests and upper bounds).
``ngram.LookupDrafter`` wraps either with prompt-lookup candidates.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from ..model.engine import DraftNet, Shard
from ..model.kv_cache import KVCache
from .shape import TreeShape
from .tree import DraftTree


class Drafter(Protocol):
    def reset(self, capacity: int) -> None:
        """Start a request; ``capacity`` bounds committed tokens + draft slots."""

    def feed(self, tokens: Sequence[int], features: torch.Tensor, next_token: int) -> None:
        """Commit ``tokens`` (with target features [n, hidden]); ``next_token`` is the next root."""

    def draft(self, shape: TreeShape) -> DraftTree:
        """A tree rooted at the last ``next_token``."""

    def draft_levels(self, shape: TreeShape, partial: bool = True) -> Iterator[DraftTree]:
        """``draft`` one model forward at a time (TreeDrafter.draft_levels); the last tree is draft's."""

    def fork(self) -> Drafter:
        """A drafter sharing this one's weights with request state of its own (its caches, its context), so
        several requests draft at once; reset() it for its request."""


class TreeDrafter(ABC):
    """EAGLE-2 tree search over a model that scores the children of a batch of same-depth nodes.

    Subclasses run their model on nodes (``_root_logprobs``, ``_expand``); this class owns the search, the
    drafter KV cache (committed context at slots [0, committed), tree nodes after it, dropped after each draft)
    and the tree masks.
    """

    vocab_size: int  # size of the drafting vocabulary
    cache: KVCache
    root: int | None

    @abstractmethod
    def _new_cache(self, capacity: int) -> KVCache: ...

    @abstractmethod
    def feed(self, tokens: Sequence[int], features: torch.Tensor, next_token: int) -> None: ...

    @abstractmethod
    def _root_logprobs(self) -> torch.Tensor:
        """Log-probabilities [V_d] of the root's children."""

    @abstractmethod
    def _expand(self, nodes: list[int], tokens: list[int], parents: list[int], depth: list[int]) -> torch.Tensor:
        """Run candidate ``nodes`` (same depth; parents already run) -> log-probs of their children [m, V_d]."""

    def _to_target(self, ids: torch.Tensor) -> list[int]:
        """Draft-vocabulary ids -> target token ids."""
        return ids.tolist()

    def reset(self, capacity: int) -> None:
        self.cache = self._new_cache(capacity)
        self.root = None
        self._slot: dict[int, int] = {}

    def fork(self) -> TreeDrafter:
        twin = copy.copy(self)  # the model and its tables are shared; the request state is made anew below
        twin._draft_done()
        twin.reset(1)
        return twin

    def draft(self, shape: TreeShape) -> DraftTree:
        *_, tree = self.draft_levels(shape, partial=False)
        return tree

    def draft_levels(self, shape: TreeShape, partial: bool = True) -> Iterator[DraftTree]:
        """``draft(shape)`` one level at a time: after each level (``partial``; else only at the end), the best
        ``total_tokens - 1`` candidates so far (parent-closed, as draft's rerank); the last is ``draft(shape)``.
        Each ``next()`` runs one model forward, so a caller can send what is ready, or stop early (close() drops
        the tree's K/V). Drive it under torch.inference_mode()."""
        assert self.root is not None, "feed() the prompt first"
        k = min(shape.top_k, self.vocab_size)
        levels = min(shape.depth, shape.total_tokens - 1)
        if levels <= 0:
            yield DraftTree.root(self.root)
            return
        tokens, parents, depth, scores = [self.root], [-1], [0], [0.0]
        self._slot = {}
        try:
            # 1. the root's top-k children
            vals, ids = self._root_logprobs().topk(k)  # [k]
            frontier = list(range(1, k + 1))
            front_scores = vals.to(torch.float64)  # [k]
            tokens += self._to_target(ids)
            parents += [0] * k
            depth += [1] * k
            scores += front_scores.tolist()
            # 2. expand the frontier level by level; keep the global top-k of the k*k children
            for level in range(2, levels + 1):
                frontier, front_scores = _worth_expanding(frontier, front_scores, scores, shape.total_tokens - 1)
                if not frontier:
                    break
                if partial:
                    yield _rerank(tokens, parents, scores, shape)
                vals, ids = self._expand(frontier, tokens, parents, depth).topk(k, dim=-1)  # [m, k]
                cu = front_scores[:, None] + vals.to(torch.float64)  # [m, k] cumulative log-prob
                base = len(tokens)
                tokens += self._to_target(ids.flatten())
                parents += [f for f in frontier for _ in range(k)]
                depth += [level] * cu.numel()
                scores += cu.flatten().tolist()
                best = torch.sort(-cu.flatten(), stable=True).indices[:k]  # ties: earlier candidate first
                frontier = [base + int(b) for b in best]
                front_scores = cu.flatten()[best]
        finally:
            self.cache.keep([])  # drop the tree's K/V; the committed context stays
            self._slot = {}
            self._draft_done()
        yield _rerank(tokens, parents, scores, shape)

    def _draft_done(self) -> None:  # noqa: B027 (a hook: most drafters keep no per-draft state)
        """Drop per-draft state."""

    def _tree_mask(self, nodes: list[int], parents: list[int]) -> torch.Tensor:
        """[1, m, cache.length + m] bool: committed context, the slots of each node's ancestors, itself.
        Assigns the nodes' slots."""
        start, m = self.cache.length, len(nodes)
        mask = torch.zeros(m, start + m, dtype=torch.bool)
        mask[:, : self.cache.committed] = True
        for r, j in enumerate(nodes):
            a = parents[j]
            while a >= 0:
                s = self._slot.get(a)
                if s is not None:
                    mask[r, s] = True
                a = parents[a]
            mask[r, start + r] = True
            self._slot[j] = start + r
        return mask[None]


class HeadDrafter(TreeDrafter):
    """EAGLE head drafting: pairs (feature, next token) -> predicted feature -> logits via the target's LM head."""

    def __init__(self, head: DraftNet, target: Shard, draft_vocab: torch.Tensor | None = None):
        assert target.embed is not None, "needs the target's embedding"
        self.head = head
        self.embed = target.embed
        self.dtype = head.dtype
        # [V_d] target ids, increasing: the order of a draft vocabulary means nothing to the head (it scores rows
        # of the target's LM head), and increasing rows are read from the file one window at a time
        self.draft_vocab = None if draft_vocab is None else torch.sort(draft_vocab.to(torch.long)).values
        self.lm_head = target.head_rows(self.draft_vocab, self.dtype)  # the target's LM head, draft rows
        self.vocab_size = self.lm_head.rows
        self.last_feature: torch.Tensor | None = None  # [hidden] predicted feature of the root
        self._feat: dict[int, torch.Tensor] = {}  # node -> predicted feature, during one draft
        self.reset(1)

    def _new_cache(self, capacity: int) -> KVCache:
        return self.head.new_cache(capacity)

    @property
    def nbytes(self) -> int:
        """Memory the drafter holds beyond the target's own tensors: the head's network and the reduced LM-head copy
        (none for the full vocabulary, whose rows are the target's)."""
        return self.head.nbytes + (self.lm_head.nbytes if self.draft_vocab is not None else 0)

    def _to_target(self, ids: torch.Tensor) -> list[int]:
        return (ids if self.draft_vocab is None else self.draft_vocab[ids]).tolist()

    @torch.inference_mode()
    def feed(self, tokens: Sequence[int], features: torch.Tensor, next_token: int) -> None:
        n = len(tokens)
        assert n >= 1
        assert features.shape[0] == n, (tuple(features.shape), n)
        dtype = self.dtype
        nxt = torch.tensor([[*list(tokens)[1:], next_token]], dtype=torch.long)  # [1, n]: x_t+1
        self.cache.keep([])
        c = self.cache.committed
        pos = torch.arange(c, c + n)[None]  # [1, n]
        out = self.head(features[None].to(dtype), self.embed(nxt).to(dtype), pos, self.cache)  # [1, n, hidden]
        self.cache.commit(n)
        self.last_feature = out[0, -1]
        self.root = int(next_token)

    def _logprobs(self, feats: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., V_d]"""
        return _log_softmax(self.lm_head.matmul(feats))

    @torch.inference_mode()
    def agreement(self, tokens: Sequence[int], features: torch.Tensor, target_next: torch.Tensor) -> float:
        """Teacher-forced top-1 agreement with the target on a probe text: from the pairs (f_t, x_t+1) the head
        predicts f_t+1, whose top draft token should be the target's greedy token after x_t+1. ``features``:
        the target's [n, hidden] at ``tokens``; ``target_next``: [n] its greedy next token at each. Leaves the
        drafter's state alone (a cache of its own)."""
        n = len(tokens)
        assert n >= 3
        assert features.shape[0] == n
        assert target_next.shape[0] == n
        dtype = self.dtype
        nxt = torch.tensor([[*list(tokens)[1:]]], dtype=torch.long)  # [1, n - 1]: x_t+1
        pos = torch.arange(n - 1)[None]  # [1, n - 1]
        out = self.head(features[None, : n - 1].to(dtype), self.embed(nxt).to(dtype), pos,
                        self.head.new_cache(n))[0]  # [n - 1, hidden]: predicted f_1 .. f_n-1
        guess = torch.as_tensor(self._to_target(self.lm_head.matmul(out).argmax(-1)))  # [n - 1]
        return float((guess == target_next[1:]).double().mean())

    def _root_logprobs(self) -> torch.Tensor:
        assert self.last_feature is not None
        self._feat = {0: self.last_feature}
        return self._logprobs(self.last_feature)

    def _expand(self, nodes, tokens, parents, depth) -> torch.Tensor:
        dtype = self.dtype
        feats = torch.stack([self._feat[parents[j]] for j in nodes])[None]  # [1, m, hidden] parents' features
        embeds = self.embed(torch.tensor([[tokens[j] for j in nodes]])).to(dtype)  # [1, m, hidden]
        pos = torch.tensor([[self.cache.committed + depth[j] - 1 for j in nodes]])  # [1, m]
        mask = self._tree_mask(nodes, parents)
        out = self.head(feats, embeds, pos, self.cache, mask)[0]  # [m, hidden]
        for r, j in enumerate(nodes):
            self._feat[j] = out[r]
        return self._logprobs(out)

    @torch.inference_mode()
    def draft(self, shape: TreeShape) -> DraftTree:
        return super().draft(shape)

    def _draft_done(self) -> None:
        self._feat = {}

    def fork(self) -> HeadDrafter:
        twin = super().fork()
        twin.last_feature = None
        return twin


class OracleDrafter(TreeDrafter):
    """The target drafting for itself: at T=0 its top-1 child is the target's argmax, so every greedy path of
    top-1 children is accepted. Tests and upper bounds only (it costs a target forward per level)."""

    def __init__(self, target: Shard):
        assert target.has_embed
        assert target.has_head
        self.target = target
        self.vocab_size = target.cfg.vocab_size
        self.reset(1)

    def _new_cache(self, capacity: int) -> KVCache:
        return self.target.new_cache(capacity)

    @torch.inference_mode()
    def feed(self, tokens: Sequence[int], features: torch.Tensor, next_token: int) -> None:
        self.cache.keep([])
        self.target(torch.tensor([list(tokens)]), self.cache)
        self.cache.commit(len(tokens))
        self.root = int(next_token)

    def _logprobs(self, feats: torch.Tensor) -> torch.Tensor:
        return _log_softmax(self.target.logits(feats))

    def _root_logprobs(self) -> torch.Tensor:
        assert self.root is not None
        mask = self._tree_mask([0], [-1])
        out = self.target(torch.tensor([[self.root]]), self.cache, mask=mask)  # [1, 1, hidden]
        return self._logprobs(out[0, 0])

    def _expand(self, nodes, tokens, parents, depth) -> torch.Tensor:
        pos = torch.tensor([[self.cache.committed + depth[j] for j in nodes]])  # [1, m]
        mask = self._tree_mask(nodes, parents)
        out = self.target(torch.tensor([[tokens[j] for j in nodes]]), self.cache, positions=pos, mask=mask)
        return self._logprobs(out[0])

    @torch.inference_mode()
    def draft(self, shape: TreeShape) -> DraftTree:
        return super().draft(shape)


def _rerank(tokens: list[int], parents: list[int], scores: list[float], shape: TreeShape) -> DraftTree:
    """The best ``total_tokens - 1`` candidates and the root; parent-closed because scores never increase along a
    path (ties go to the earlier candidate, which is never a descendant of a later one)."""
    s = torch.tensor(scores[1:], dtype=torch.float64)
    best = (torch.sort(-s, stable=True).indices[: shape.total_tokens - 1] + 1).tolist()
    chosen = [0, *(sorted(best) if shape.order == "eagle" else best)]
    return DraftTree.from_lists(tokens, parents, scores).select(chosen, keep_order=True)


def _worth_expanding(
    frontier: list[int], front_scores: torch.Tensor, scores: list[float], keep: int
) -> tuple[list[int], torch.Tensor]:
    """Drop frontier nodes none of whose descendants can make the rerank: if ``keep`` candidates already score
    at least s, a descendant (score <= its ancestor's, created later, so it loses ties) of a node scoring <= s
    never ranks among the best ``keep``. The drafted tree is unchanged; only wasted forwards are skipped."""
    if len(scores) - 1 < keep:
        return frontier, front_scores
    threshold = torch.tensor(scores[1:], dtype=torch.float64).topk(keep).values[-1]
    alive = front_scores > threshold  # [m]
    return [f for f, a in zip(frontier, alive.tolist(), strict=True) if a], front_scores[alive]


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> log-probs, float32 at least (float64 stays float64: the oracle's top-1 must be the target's
    argmax exactly); clamped at 0 so a child's cumulative score never exceeds its parent's."""
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    return torch.log_softmax(logits, dim=-1).clamp(max=0.0)
