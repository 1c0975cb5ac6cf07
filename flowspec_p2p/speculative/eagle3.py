"""EAGLE-3 drafting on one device (arXiv 2503.01840 §3; the checkpoint format is eagle.py's).

EAGLE-3 drafts from more of the target than its last features: the hidden states entering three of its layers
(low, middle, high; ``taps``), fused by ``fc``. Our engines return a shard's output only, so the target runs as a
chain of its own shards cut at those layers (``TappedTarget``, sharing every tensor with the whole model), and its
*features* are widened to carry the tapped states: [..., H + k*H] = final features ; state entering taps[0] ; ...
``logits`` reads the first H. A chain of shards computes what the whole model does (the stages of a cluster rely
on it), so decoding stays lossless.

Glossary (as in drafter.py; H the head's width, V_d its draft vocabulary):
    g_t     the fused target states of token t: fc([a_t ; b_t ; c_t])                       fc: 3H -> H, no bias
    step    h = x + Attn([norm_in(embed(x_t+1)) ; norm_h(x)])  (x = g_t, or the head's own h for a drafted node;
            attention 2H -> heads, rotary at draft position t), then h = h + MLP(norm_post(h))
    logits  lm_head(norm(h)) over V_d; draft id i is target id i + d2t[i]

What the native engine lacks for it (so the network runs in torch, float32, on the CPU): a forward that returns
the states entering chosen layers in one call (the chain costs one engine call per piece), and kernels for the
2H-wide attention and the head's own LM head. In a cluster the tapped layers sit on other stages, which would have
to send those states to the leader: EAGLE-3 heads are single-device only (``flowspec generate``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, WeightsError
from ..model.arch import ModelConfig
from ..model.blocks import RMSNorm, Rotary, apply_rotary
from ..model.engine import Shard
from ..model.kv_cache import KVCache
from ..types import LayerRange
from .drafter import TreeDrafter
from .eagle import EagleCheckpoint


class ChainCache:
    """One KV cache per piece of a TappedTarget, moved in step (every piece sees the same rows)."""

    def __init__(self, caches: Sequence[KVCache]):
        self.caches = list(caches)

    @property
    def length(self) -> int:
        return self.caches[0].length

    @property
    def committed(self) -> int:
        return self.caches[0].committed

    @property
    def pending(self) -> int:
        return self.caches[0].pending

    @property
    def capacity(self) -> int:
        return self.caches[0].capacity

    def commit(self, n: int) -> None:
        for c in self.caches:
            c.commit(n)

    def keep(self, indices) -> None:
        for c in self.caches:
            c.keep(indices)

    def truncate(self, length: int) -> None:
        for c in self.caches:
            c.truncate(length)


class TappedTarget:
    """The target as shards cut at ``taps`` (see the module docstring); a Shard to the single-device decoders."""

    def __init__(self, pieces: Sequence[Shard], taps: Sequence[int]):
        self.pieces = list(pieces)
        self.taps = tuple(taps)
        first, last = self.pieces[0], self.pieces[-1]
        assert first.has_embed
        assert last.has_head
        assert all(a.layers.end == b.layers.start for a, b in itertools.pairwise(self.pieces))
        self.cfg: ModelConfig = first.cfg
        self.layers = LayerRange(start=first.layers.start, end=last.layers.end)
        self.dtype = last.dtype
        self.max_position = min(p.max_position for p in self.pieces)
        self.has_embed, self.has_head = True, True
        self.width = self.cfg.hidden_size * (1 + len(self.taps))  # of the widened features

    @classmethod
    def load(cls, target: Shard, source, taps: Sequence[int]) -> TappedTarget:
        """Cut the whole-model ``target`` (of weights ``source``) at ``taps``; the pieces share its tensors."""
        n = target.cfg.num_layers
        cuts = [0, *sorted(set(taps)), n]
        pieces = [target.engine.load(source, LayerRange(start=a, end=b), embed=a == 0, head=b == n, donors=[target])
                  for a, b in itertools.pairwise(cuts)]
        return cls(pieces, taps)

    @property
    def engine(self):
        return self.pieces[0].engine

    @property
    def nbytes(self) -> int:
        return self.pieces[-1].nbytes  # the pieces share one copy of the weights

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.pieces[0].embed(ids)

    def new_cache(self, capacity: int, batch: int = 1) -> ChainCache:
        return ChainCache([p.new_cache(capacity, batch) for p in self.pieces])

    def __call__(self, x: torch.Tensor, cache: ChainCache, positions: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None, stop=None) -> torch.Tensor:
        """x: ids [B, n] -> [B, n, H + k*H]: the features, then the state entering each tapped layer."""
        entering: dict[int, torch.Tensor] = {}
        h = x
        for piece, c in zip(self.pieces, cache.caches, strict=True):
            h = piece(h, c, positions=positions, mask=mask, stop=stop)  # [B, n, H]
            entering[piece.layers.end] = h
        return torch.cat([h, *(entering[t].to(h.dtype) for t in self.taps)], dim=-1)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[..., H + k*H] (or [..., H]) -> [..., vocab]"""
        return self.pieces[-1].logits(features[..., : self.cfg.hidden_size])

    def greedy_tokens(self, features: torch.Tensor) -> torch.Tensor:
        """[..., H + k*H] (or [..., H]) -> [...] int64"""
        return self.pieces[-1].greedy_tokens(features[..., : self.cfg.hidden_size])

    def head_rows(self, rows, dtype=None):
        return self.pieces[-1].head_rows(rows, dtype)

    def warm_up(self, max_rows: int = 8) -> None:
        for p in self.pieces:
            p.warm_up(max_rows)


class Eagle3Net(nn.Module):
    """EAGLE-3's draft network (the module docstring's step and logits), weights in the published [out, in] layout."""

    def __init__(self, cfg: ModelConfig, target_hidden: int, draft_vocab: int, taps: int, max_position: int):
        super().__init__()
        h, self.cfg, self.max_position = cfg.hidden_size, cfg, max_position
        self.fc = nn.Linear(taps * target_hidden, h, bias=False)
        self.input_norm, self.hidden_norm = RMSNorm(h, cfg.rms_eps), RMSNorm(h, cfg.rms_eps)
        self.q = nn.Linear(2 * h, cfg.q_dim, bias=cfg.attention_bias)
        self.k = nn.Linear(2 * h, cfg.kv_dim, bias=cfg.attention_bias)
        self.v = nn.Linear(2 * h, cfg.kv_dim, bias=cfg.attention_bias)
        self.o = nn.Linear(cfg.q_dim, h, bias=False)
        self.post_norm = RMSNorm(h, cfg.rms_eps)
        self.gate, self.up = nn.Linear(h, cfg.intermediate_size, bias=False), nn.Linear(h, cfg.intermediate_size,
                                                                                         bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.norm = RMSNorm(h, cfg.rms_eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        self._rotary: Rotary | None = None

    # our parameter's module -> its name in the published checkpoints
    PUBLISHED: ClassVar[dict[str, str]] = {
        "fc": "fc", "input_norm": "midlayer.input_layernorm", "hidden_norm": "midlayer.hidden_norm",
        "q": "midlayer.self_attn.q_proj", "k": "midlayer.self_attn.k_proj", "v": "midlayer.self_attn.v_proj",
        "o": "midlayer.self_attn.o_proj", "post_norm": "midlayer.post_attention_layernorm",
        "gate": "midlayer.mlp.gate_proj", "up": "midlayer.mlp.up_proj", "down": "midlayer.mlp.down_proj",
        "norm": "norm", "lm_head": "lm_head"}

    def load_published(self, state: dict[str, torch.Tensor]) -> Eagle3Net:
        ours = {}
        for name in self.state_dict():
            module, _, param = name.partition(".")
            key = f"{self.PUBLISHED[module]}.{param}"
            if key not in state:
                raise WeightsError(f"the EAGLE-3 head has no {key}")
            ours[name] = state[key].to(torch.float32)
        self.load_state_dict(ours)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        c = self.cfg
        return KVCache(1, c.num_kv_heads, c.head_dim, capacity, batch=batch, dtype=self.dtype)

    def forward(
        self,
        hidden: torch.Tensor,  # [1, n, k*H_target] fused target states (fuse) or [1, n, H] the head's own h
        embeds: torch.Tensor,  # [1, n, H]  embed(x_t+1)
        positions: torch.Tensor,  # [1, n]  t
        cache: KVCache,
        mask: torch.Tensor | None = None,  # [1, n, cache.length + n] bool, or None (causal)
        fuse: bool = False,
    ) -> torch.Tensor:
        """-> h [1, n, H] (before the final norm: the next step's input); appends to ``cache``."""
        c = self.cfg
        x = self.fc(hidden) if fuse else hidden  # [1, n, H]
        b, n, _ = x.shape
        if self._rotary is None or self._rotary.cos.dtype != self.dtype:
            self._rotary = Rotary(c, self.max_position, self.dtype)
        cos, sin = self._rotary.gather(positions)  # [1, 1, n, head_dim]
        both = torch.cat([self.input_norm(embeds), self.hidden_norm(x)], dim=-1)  # [1, n, 2H]
        q = apply_rotary(self.q(both).view(b, n, c.num_heads, c.head_dim).transpose(1, 2), cos, sin)
        k = apply_rotary(self.k(both).view(b, n, c.num_kv_heads, c.head_dim).transpose(1, 2), cos, sin)
        v = self.v(both).view(b, n, c.num_kv_heads, c.head_dim).transpose(1, 2)  # [1, kv_heads, n, head_dim]
        start = cache.reserve(n)
        k, v = cache.write(0, start, k, v)  # [1, kv_heads, start + n, head_dim]
        attn_mask = mask.unsqueeze(1) if mask is not None else (
            torch.ones(n, start + n, dtype=torch.bool).tril(start)[None, None])
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)  # [1, heads, n, head_dim]
        cache.advance(n)
        x = x + self.o(o.transpose(1, 2).reshape(b, n, c.q_dim))
        post = self.post_norm(x)
        return x + self.down(F.silu(self.gate(post)) * self.up(post))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V_d]"""
        return self.lm_head(self.norm(h))


def _to_target_table(ckpt: EagleCheckpoint, vocab: int, draft_vocab: int) -> torch.Tensor:
    """[V_d] target ids of the draft ids, from d2t's offsets, checked against t2d."""
    d2t = ckpt.state.get("d2t")
    if d2t is None:
        if draft_vocab != vocab:
            raise WeightsError(f"{ckpt.path}: a draft vocabulary of {draft_vocab} < {vocab} needs its d2t map")
        return torch.arange(vocab)
    table = torch.arange(draft_vocab) + d2t.to(torch.long)  # [V_d]
    if d2t.numel() != draft_vocab or int(table.min()) < 0 or int(table.max()) >= vocab:
        raise WeightsError(f"{ckpt.path}: d2t maps draft ids outside the target's vocabulary of {vocab}")
    t2d = ckpt.state.get("t2d")
    if t2d is not None and (t2d.numel() != vocab or int(t2d.sum()) != draft_vocab or not bool(t2d.bool()[table].all())):
        raise WeightsError(f"{ckpt.path}: t2d and d2t disagree about the draft vocabulary")
    return table


class Eagle3Drafter(TreeDrafter):
    """EAGLE-2 tree search (drafter.py) with an EAGLE-3 head over a TappedTarget's widened features."""

    def __init__(self, net: Eagle3Net, target: TappedTarget, table: torch.Tensor,
                 embed_table: torch.Tensor | None = None):
        self.net = net
        self.target_hidden = target.cfg.hidden_size
        self.table = table  # [V_d] target ids
        self.vocab_size = int(table.numel())
        self.dtype = net.dtype
        self._embed = (lambda ids: F.embedding(ids, embed_table)) if embed_table is not None else target.embed
        self.last: torch.Tensor | None = None  # [H] the root's h
        self._h: dict[int, torch.Tensor] = {}
        self.reset(1)

    @classmethod
    def from_checkpoint(cls, ckpt: EagleCheckpoint, target: TappedTarget, dtype: torch.dtype = torch.float32
                        ) -> Eagle3Drafter:
        why = ckpt.mismatch(target.cfg)
        if why is not None:
            raise ConfigError(why)
        draft_vocab = int(ckpt.state["lm_head.weight"].shape[0])
        net = Eagle3Net(ckpt.head, ckpt.target_hidden, draft_vocab, len(target.taps), target.max_position)
        net = net.load_published(ckpt.state).to(dtype).eval()
        embed = ckpt.state.get("embed_tokens.weight")
        table = _to_target_table(ckpt, target.cfg.vocab_size, draft_vocab)
        return cls(net, target, table, None if embed is None else embed.to(dtype))

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.net.parameters())

    def _new_cache(self, capacity: int) -> KVCache:
        return self.net.new_cache(capacity)

    def _to_target(self, ids: torch.Tensor) -> list[int]:
        return self.table[ids].tolist()

    def _embeds(self, ids: torch.Tensor) -> torch.Tensor:
        return self._embed(ids).to(self.dtype)

    def _tapped(self, features: torch.Tensor) -> torch.Tensor:
        """[n, H + k*H] widened features -> [1, n, k*H] the tapped states"""
        assert features.shape[-1] > self.target_hidden, "EAGLE-3 drafts from a TappedTarget's widened features"
        return features[None, :, self.target_hidden :].to(self.dtype)

    @torch.inference_mode()
    def feed(self, tokens: Sequence[int], features: torch.Tensor, next_token: int) -> None:
        n = len(tokens)
        assert features.shape[0] == n, (tuple(features.shape), n)
        nxt = torch.tensor([[*list(tokens)[1:], next_token]], dtype=torch.long)  # [1, n]: x_t+1
        self.cache.keep([])
        c = self.cache.committed
        pos = torch.arange(c, c + n)[None]  # [1, n]
        out = self.net(self._tapped(features), self._embeds(nxt), pos, self.cache, fuse=True)  # [1, n, H]
        self.cache.commit(n)
        self.last = out[0, -1]
        self.root = int(next_token)

    def _logprobs(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V_d] log-probabilities (float32 at least), clamped at 0 as drafter.py's are"""
        logits = self.net.logits(h)
        return torch.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1).clamp(max=0.0)

    @torch.inference_mode()
    def agreement(self, tokens: Sequence[int], features: torch.Tensor, target_next: torch.Tensor) -> float:
        """Teacher-forced top-1 agreement with the target on a probe (HeadDrafter.agreement's test)."""
        n = len(tokens)
        assert n >= 3
        nxt = torch.tensor([[*list(tokens)[1:]]], dtype=torch.long)  # [1, n - 1]
        pos = torch.arange(n - 1)[None]
        out = self.net(self._tapped(features[: n - 1]), self._embeds(nxt), pos, self.net.new_cache(n), fuse=True)
        guess = torch.as_tensor(self._to_target(self.net.logits(out[0]).argmax(-1)))  # [n - 1]
        return float((guess == target_next[1:]).double().mean())

    def _root_logprobs(self) -> torch.Tensor:
        assert self.last is not None
        self._h = {0: self.last}
        return self._logprobs(self.last)

    def _expand(self, nodes, tokens, parents, depth) -> torch.Tensor:
        h = torch.stack([self._h[parents[j]] for j in nodes])[None]  # [1, m, H] the parents' h
        embeds = self._embeds(torch.tensor([[tokens[j] for j in nodes]]))  # [1, m, H]
        pos = torch.tensor([[self.cache.committed + depth[j] - 1 for j in nodes]])  # [1, m]
        out = self.net(h, embeds, pos, self.cache, self._tree_mask(nodes, parents))[0]  # [m, H]
        for r, j in enumerate(nodes):
            self._h[j] = out[r]
        return self._logprobs(out)

    @torch.inference_mode()
    def draft(self, shape):
        return super().draft(shape)

    def _draft_done(self) -> None:
        self._h = {}

    def fork(self) -> Eagle3Drafter:
        twin = super().fork()
        twin.last = None
        return twin
