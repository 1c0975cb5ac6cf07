"""The torch engine: the reference implementation every other engine is tested against. A slice of a Llama-family
decoder, layers ``[start, end)``, plus the embedding and/or the final norm + LM head where the slice's role needs
them, built from blocks.py's DecoderBlock (one block implementation serves llama, mistral and qwen2, and the draft
head), in any float dtype: float64 for exactness on tiny models, float32 to agree with transformers to float rounding.

    TorchShard     the layers as an nn.Module (engine.Shard); training and float64 work run on it
    TorchEngine    how the torch engine loads shards and what they cost in memory (engine.Engine)

Glossary:
    hidden     residual-stream activations between layers            [batch, n, hidden]
    features   final-normed hidden states (input of the LM head);     [batch, n, hidden]
               EAGLE calls these the target's features
    mask       which keys a new token may attend to, over [cache | new tokens]: [batch, n, cache_len + n] bool
               (True = visible). ``None`` means "all of the cache, causal among the new tokens".
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from tqdm import tqdm

from ..errors import ContextOverflow, ForwardStopped
from ..types import LayerRange
from .arch import EMBED, HEAD, NORM, ModelConfig
from .blocks import DecoderBlock, RMSNorm, Rotary, window_mask
from .draft_head import DraftHead
from .engine import BatchRows
from .kv_cache import KVCache
from .weights import ROPE_FREQS, WeightSource, load_tensor, shard_tensor_names, tensor_shape


class _LazyTensors(Mapping[str, torch.Tensor]):
    """Tensors of ``names``, read from ``source`` (in ``dtype``) on each lookup and not kept."""

    def __init__(self, source: WeightSource, dtype: torch.dtype, names: list[str]):
        self.source, self.dtype, self.names = source, dtype, names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise KeyError(name)
        return load_tensor(self.source, name).to(self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class ScaledEmbedding(nn.Embedding):
    """An embedding whose rows are multiplied by ``scale`` (Gemma: sqrt(hidden)); ``weight`` is the table as stored
    (a tied LM head shares it)."""

    def __init__(self, num: int, dim: int, scale: float | None, **kwargs):
        super().__init__(num, dim, **kwargs)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = super().forward(ids)
        return rows if self.scale is None else rows * torch.tensor(self.scale, dtype=rows.dtype)


class TorchShard(nn.Module):
    """Layers ``[start, end)`` of a decoder on the torch engine; ``embed`` if it receives token ids, ``head`` if it
    ends the model. Implements engine.Shard."""

    def __init__(
        self,
        cfg: ModelConfig,
        layers: LayerRange,
        *,
        embed: bool,
        head: bool,
        dtype: torch.dtype = torch.float32,
        max_position: int | None = None,
        rope_freqs: torch.Tensor | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        self.layers = layers
        self.has_embed = embed
        self.has_head = head
        self.dtype = dtype
        # _weight: skip the random init of a [vocab, hidden] table that is about to be overwritten
        self.embed = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.embed_scale, _weight=torch.empty(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype)) if embed else None
        self.blocks = nn.ModuleList(DecoderBlock(cfg) for _ in layers.indices())
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.norm_offset) if head else None
        self.head_t: torch.Tensor | None = None  # [hidden, vocab]: the LM head, transposed (see DecoderBlock)
        self.max_position = max_position or cfg.max_position
        self.rotary = Rotary(cfg, self.max_position, dtype, rope_freqs)
        local = any(cfg.local_rope(i) for i in layers.indices())
        self.rotary_local = Rotary(cfg, self.max_position, dtype, local=True) if local else None
        self.to(dtype)

    @property
    def engine(self) -> TorchEngine:
        return TorchEngine(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors this shard holds (a tied embedding, a view of the LM head, counted once)."""
        seen: dict[int, int] = {}
        for t in (*self.parameters(), *((self.head_t,) if self.head_t is not None else ())):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())

    @classmethod
    def from_source(
        cls,
        source: WeightSource,
        layers: LayerRange,
        *,
        embed: bool,
        head: bool,
        lm_head: bool | None = None,
        dtype: torch.dtype = torch.float32,
        max_position: int | None = None,
        donors: Sequence[TorchShard] = (),
        progress: bool = False,
    ) -> TorchShard:
        """Materialise only this shard's tensors from ``source``. ``head``: the final norm; ``lm_head`` (default
        ``head``): the LM head too. Blocks, the embedding and the norm that a donor (a shard of the same model in
        ``dtype``) holds are shared, not loaded again (weights are read-only at inference). ``progress``: a bar on a
        terminal's stderr."""
        cfg = source.config
        if layers.end > cfg.num_layers:
            raise ValueError(f"layer range {layers} exceeds the model's {cfg.num_layers} layers")
        lm_head = head if lm_head is None else lm_head
        freqs = source.load(ROPE_FREQS) if ROPE_FREQS in source.names() else None
        shard = cls(cfg, layers, embed=embed, head=head, dtype=dtype, max_position=max_position, rope_freqs=freqs)
        donors = [d for d in donors if d.dtype == dtype]
        # Each tensor is read when its parameter is filled and dropped right after: peak memory stays at the
        # shard's size plus one tensor, and nothing outside shard_tensor_names is ever read.
        t = _LazyTensors(source, dtype, shard_tensor_names(cfg, layers, embed=embed, head=lm_head) + (
            [NORM] if head and not lm_head else []))
        with torch.no_grad():
            for i, layer in enumerate(tqdm(layers.indices(), desc=f"loading layers {layers}", unit="layer",
                                           leave=False, disable=None if progress else True, file=sys.stderr)):
                donor = next((d for d in donors if d.layers.start <= layer < d.layers.end), None)
                if donor is not None:
                    shard.blocks[i] = donor.blocks[layer - donor.layers.start]
                else:
                    shard.blocks[i].load_hf(t, f"model.layers.{layer}.")
            if embed:
                donor = next((d for d in donors if d.embed is not None), None)
                if donor is not None:
                    shard.embed = donor.embed
                else:
                    shard.embed.weight.copy_(t[EMBED])
            if head:
                donor = next((d for d in donors if d.norm is not None), None)
                if donor is not None:
                    shard.norm = donor.norm
                else:
                    shard.norm.weight.copy_(t[NORM])
            if lm_head:
                shard._load_lm_head(t)
        return shard.eval()

    def _load_lm_head(self, t: Mapping[str, torch.Tensor]) -> None:
        tied = self.cfg.tie_embeddings
        w = self.embed.weight if tied and self.embed is not None else t[EMBED if tied else HEAD]  # [vocab, hidden]
        self.head_t = w.to(self.dtype).t().contiguous()  # [hidden, vocab]
        if tied and self.embed is not None:
            # one table, not two: the embedding becomes a [vocab, hidden] view of the head (a lookup of a few
            # strided rows costs microseconds; the head's matmuls keep their contiguous layout)
            self.embed.weight = nn.Parameter(self.head_t.t(), requires_grad=False)

    def load_hf(self, t: Mapping[str, torch.Tensor]) -> None:
        """Copy weights named like transformers' checkpoints (``model.layers.{i}.``, ``lm_head.weight``, ...)."""
        with torch.no_grad():
            if self.embed is not None:
                self.embed.weight.copy_(t[EMBED])
            for block, i in zip(self.blocks, self.layers.indices(), strict=True):
                block.load_hf(t, f"model.layers.{i}.")
            if self.norm is not None:
                self.norm.weight.copy_(t[NORM])
                self._load_lm_head(t)

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        c = self.cfg
        return KVCache(len(self.blocks), c.num_kv_heads, c.head_dim, capacity, batch=batch, dtype=self.dtype)

    def forward(
        self,
        x: torch.Tensor,  # ids [batch, n] if has_embed else hidden [batch, n, hidden]
        cache: KVCache | None,
        positions: torch.Tensor | None = None,  # [batch, n] absolute; default cache.length + arange(n)
        mask: torch.Tensor | None = None,  # [batch, n, cache.length + n] bool, or None (see module doc)
        stop: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """Run the shard; K/V of the new tokens are appended to ``cache``. -> hidden, or features if has_head.
        ``stop`` is asked before each layer; when it says yes the forward raises ForwardStopped, with the new
        tokens' slots reserved in ``cache`` but unwritten from that layer on (the caller discards them)."""
        h = self.embed(x) if self.embed is not None else x.to(self.dtype)
        b, n, _ = h.shape
        start = 0 if cache is None else cache.reserve(n)
        last = start + n - 1 if positions is None else int(positions.max())
        if last >= self.max_position:
            raise ContextOverflow(f"position {last} exceeds the model limit {self.max_position}")
        tables = {False: self.rotary, True: self.rotary_local}
        rope = {}
        for local, rot in tables.items():
            if rot is None:
                continue
            if positions is None:  # consecutive positions: a view of the tables, no gather
                rope[local] = (rot.cos[start : start + n].expand(b, 1, n, -1),  # [b, 1, n, head_dim]
                               rot.sin[start : start + n].expand(b, 1, n, -1))
            else:
                rope[local] = rot.gather(positions)
        causal = False
        attn_mask = None
        if mask is not None:
            assert mask.shape == (b, n, start + n), (tuple(mask.shape), (b, n, start + n))
            attn_mask = mask.unsqueeze(1)  # [b, 1, n, kv_len]
        elif n > 1:
            if start == 0:
                causal = True
            else:  # all of the cache, causal among the new tokens
                attn_mask = torch.ones(n, start + n, dtype=torch.bool).tril(start)[None, None]
        masks = self._window_masks(attn_mask, n, start)
        for i, block in enumerate(self.blocks):
            if stop is not None and stop():
                if cache is not None:
                    cache.advance(n)
                raise ForwardStopped(f"stopped before layer {i} of {len(self.blocks)}")
            layer = self.layers.start + i
            cos, sin = rope[self.cfg.local_rope(layer)]
            w = self.cfg.window(layer)
            m, c = (attn_mask, causal) if w is None or w not in masks else (masks[w], False)
            h = block(h, cos, sin, None if cache is None else (cache, i, start), m, c)
        if cache is not None:
            cache.advance(n)
        if self.norm is not None:
            h = self.norm(h)
        return h

    def _window_masks(self, attn_mask: torch.Tensor | None, n: int, start: int) -> dict[int, torch.Tensor]:
        """The masks [b or 1, 1, n, start + n] of this shard's windowed layers, by window (none where every row sees
        at most the window anyway)."""
        windows = {w for i in self.layers.indices() if (w := self.cfg.window(i)) is not None and start + n > w}
        if not windows:
            return {}
        full = attn_mask if attn_mask is not None else torch.ones(n, start + n, dtype=torch.bool).tril(start)[
            None, None]
        return {w: window_mask(full, w) for w in windows}

    def forward_batch(self, items: Sequence[BatchRows], stop: Callable[[], bool] | None = None
                      ) -> list[torch.Tensor]:
        """engine.Shard.forward_batch on the reference: each item's forward in turn (the reference is for
        exactness, not speed; the native engine runs a batch in one call)."""
        return [self(it.x, it.cache, positions=it.positions, mask=it.mask, stop=stop) for it in items]

    def warm_up(self, max_rows: int = 8) -> None:
        """Run a tree forward of each size 1..max_rows through a scratch cache (a stage does at load), so the first
        request does not pay for torch's first-call set-up of each shape."""
        cache = self.new_cache(max_rows)
        with torch.inference_mode():
            for m in range(1, max_rows + 1):
                if self.embed is not None:
                    x = torch.zeros(1, m, dtype=torch.long)  # [1, m] ids
                else:
                    x = torch.zeros(1, m, self.cfg.hidden_size, dtype=self.dtype)  # [1, m, hidden]
                mask = torch.eye(m, dtype=torch.bool)[None]  # [1, m, m]: each node sees itself
                self(x, cache, positions=torch.zeros(1, m, dtype=torch.long), mask=mask)
                cache.keep([])

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """features: [..., hidden] -> [..., vocab]"""
        assert self.head_t is not None, "this shard holds no LM head"
        logits = features @ self.head_t
        cap = self.cfg.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def greedy_tokens(self, features: torch.Tensor) -> torch.Tensor:
        """features: [..., hidden] -> [...] int64, the argmax of the logits (the reference: computed from them)"""
        return self.logits(features).argmax(-1)

    def head_rows(self, rows: torch.Tensor | None, dtype: torch.dtype | None = None) -> TorchHeadRows:
        """The LM head restricted to ``rows`` (a draft vocabulary of target ids; None: all), in ``dtype``."""
        assert self.head_t is not None, "this shard holds no LM head"
        head_t = self.head_t if rows is None else self.head_t[:, rows]
        return TorchHeadRows(head_t.to(dtype or self.dtype).contiguous())


class TorchHeadRows:
    """Some rows of an LM head as a matmul: ``matmul(x)`` [..., hidden] -> [..., rows]. Implements
    engine.HeadRows."""

    def __init__(self, head_t: torch.Tensor):
        self.head_t = head_t  # [hidden, rows]
        self.rows = head_t.shape[1]

    @property
    def nbytes(self) -> int:
        return self.head_t.numel() * self.head_t.element_size()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.head_t.dtype) @ self.head_t


@dataclass(frozen=True)
class TorchEngine:
    """The torch engine (engine.Engine), the reference: shards as nn.Modules in any float dtype, plain torch ops."""

    dtype: torch.dtype = torch.float32
    name: ClassVar[str] = "torch"

    def describe(self) -> str:
        return "torch" if self.dtype == torch.float32 else f"torch ({str(self.dtype).removeprefix('torch.')})"

    def load(self, source: WeightSource, layers: LayerRange, *, embed: bool, head: bool, lm_head: bool | None = None,
             donors: Sequence = (), progress: bool = False) -> TorchShard:
        return TorchShard.from_source(source, layers, embed=embed, head=head, lm_head=lm_head, dtype=self.dtype,
                                      donors=[d for d in donors if isinstance(d, TorchShard)], progress=progress)

    def tensor_bytes(self, source: WeightSource, name: str) -> int:
        return math.prod(tensor_shape(source, name)) * self.dtype.itemsize

    def kv_bytes_per_token(self, cfg: ModelConfig) -> int:
        return cfg.kv_bytes_per_token(self.dtype.itemsize)

    def draft_net(self, cfg: ModelConfig, state: dict[str, torch.Tensor], max_position: int) -> DraftHead:
        head = DraftHead(cfg, max_position)
        head.load_state_dict({k: v.to(torch.float32) for k, v in state.items()})
        return head.to(self.dtype).eval()

    def layer_seconds(self, cfg: ModelConfig, tokens: int, context: int, repeats: int, warmup: int = 2) -> float:
        block = DecoderBlock(cfg).to(self.dtype)
        block.reset_parameters()  # random weights: the device's speed, not a model's values
        rot = Rotary(cfg, context + tokens, self.dtype)
        cache = KVCache(1, cfg.num_kv_heads, cfg.head_dim, context + tokens, dtype=self.dtype)
        cache.length = cache.committed = context
        x = torch.randn(1, tokens, cfg.hidden_size, dtype=self.dtype)  # [1, tokens, hidden]
        cos, sin = rot.gather(torch.arange(context, context + tokens)[None])  # [1, 1, tokens, head_dim]
        mask = torch.ones(1, 1, tokens, context + tokens, dtype=torch.bool).tril(context)  # [1, 1, tokens, kv_len]
        times = []
        with torch.inference_mode():
            for i in range(warmup + repeats):
                t0 = time.perf_counter()
                block(x, cos, sin, (cache, 0, context), mask, False)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
        return statistics.median(times)
