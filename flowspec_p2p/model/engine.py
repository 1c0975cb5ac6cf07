"""The engine seam: all that code outside model/ knows of an engine and of the shards it runs.

    Engine     how a model's layers are run and what they cost: the native quantized engine (native_shard.py) or the
               torch reference (torch_shard.py). Chosen once (``AgentConfig.engine``, ``--engine``; FLOWSPEC_ENGINE
               only fills in) by ``model.load.get_engine``, named in every PlanUpdate so that every stage of a plan
               runs the same engine, and *asked* for its numbers (bytes of each tensor, KV bytes per token, a layer's
               seconds) by the planner, the device profile, the drafter and the benchmarks
    Shard      layers ``[start, end)`` of a decoder on an engine, plus the embedding (it takes token ids) and/or the
               final norm (it returns features) and the LM head where its role needs them
    HeadRows   some rows of a shard's LM head as a matmul (the draft vocabulary's)
    DraftNet   an EAGLE draft head's network on an engine (fc + one decoder block), built from its state dict
    StopFlag   "stop at the next layer", raised from an event loop while a forward runs on a compute thread

A new model family is added on this seam once: its config (arch.py), tensor names (weights.py), the reference block
(blocks.py / torch_shard.py) and the engine's kernels (native/), nothing outside model/.

Glossary (shapes as every Shard takes them):
    hidden     residual-stream activations between layers            [batch, n, hidden]
    features   final-normed hidden states (input of the LM head)      [batch, n, hidden]
    mask       which keys a new token may attend to, over [cache | new tokens]: [batch, n, cache_len + n] bool
               (True = visible); ``None`` means "all of the cache, causal among the new tokens"
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from ..types import LayerRange
from .arch import ModelConfig
from .kv_cache import KVCache

EngineName = Literal["native", "torch"]


class StopFlag:
    """A flag the forward loop reads before each layer (the native engine reads ``c`` from C; the torch engine calls
    it); set from another thread."""

    def __init__(self) -> None:
        self.c = ctypes.c_int(0)

    def set(self) -> None:
        self.c.value = 1

    def is_set(self) -> bool:
        return bool(self.c.value)

    __call__ = is_set


@dataclass(frozen=True)
class BatchRows:
    """One request's part of a batched forward (Shard.forward_batch): its rows, its cache, their positions and
    mask, as Shard.__call__ takes them for one request (batch 1)."""

    x: torch.Tensor  # ids [1, n] if the shard embeds, else hidden [1, n, hidden]
    cache: KVCache
    positions: torch.Tensor | None = None  # [1, n] absolute; default cache.length + arange(n)
    mask: torch.Tensor | None = None  # [1, n, cache.length + n] bool, or None (the cache + causal)


class HeadRows(Protocol):
    rows: int  # rows of the LM head held (the draft vocabulary's size)

    @property
    def nbytes(self) -> int: ...

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] -> [..., rows]"""
        ...


class Shard(Protocol):
    cfg: ModelConfig
    layers: LayerRange
    dtype: torch.dtype  # of the activations it takes and returns
    max_position: int

    @property
    def engine(self) -> Engine: ...

    @property
    def has_embed(self) -> bool: ...

    @property
    def has_head(self) -> bool: ...

    @property
    def nbytes(self) -> int:
        """Bytes of weights this shard holds."""
        ...

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., hidden] (only where has_embed)"""
        ...

    def __call__(
        self,
        x: torch.Tensor,  # ids [batch, n] if has_embed else hidden [batch, n, hidden]
        cache: KVCache | None,
        positions: torch.Tensor | None = None,  # [batch, n] absolute; default cache.length + arange(n)
        mask: torch.Tensor | None = None,  # [batch, n, cache.length + n] bool, or None (the cache + causal)
        stop: Callable[[], bool] | None = None,  # a StopFlag: raise ForwardStopped before the next layer once set
    ) -> torch.Tensor:
        """K/V of the new rows appended to ``cache``; -> hidden [batch, n, hidden], or features if has_head."""
        ...

    def forward_batch(self, items: Sequence[BatchRows], stop: Callable[[], bool] | None = None
                      ) -> list[torch.Tensor]:
        """The rows of several requests, each with its own cache, positions and mask, in one call; -> per item what
        ``__call__`` returns for it alone, bit for bit on a batch-invariant engine."""
        ...

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache: ...

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """features: [..., hidden] -> [..., vocab] (only where it holds the LM head)"""
        ...

    def greedy_tokens(self, features: torch.Tensor) -> torch.Tensor:
        """features: [..., hidden] -> [...] int64, ``logits(features).argmax(-1)`` bit for bit (the lowest index
        among equal maxima), without holding the [..., vocab] logits where the engine can: what greedy decoding
        needs of the LM head (only where it holds the LM head)"""
        ...

    def head_rows(self, rows: torch.Tensor | None, dtype: torch.dtype | None = None) -> HeadRows:
        """The LM head restricted to ``rows`` [V_d] target ids (None: all of it)."""
        ...

    def warm_up(self, max_rows: int = 8) -> None:
        """One forward of each size 1..max_rows through a scratch cache, so the first request pays no set-up."""
        ...


class DraftNet(Protocol):
    dtype: torch.dtype

    @property
    def nbytes(self) -> int: ...

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache: ...

    def __call__(
        self,
        features: torch.Tensor,  # [1, n, hidden]  f_t (target features, or the head's own predictions)
        next_embeds: torch.Tensor,  # [1, n, hidden]  embed(x_t+1)
        positions: torch.Tensor,  # [1, n]  t
        cache: KVCache | None = None,
        mask: torch.Tensor | None = None,  # [1, n, cache.length + n] bool, or None (causal)
    ) -> torch.Tensor:
        """-> predicted features f^_t+1 [1, n, hidden]; appends to ``cache``."""
        ...


class Engine(Protocol):
    name: EngineName
    dtype: torch.dtype  # the compute dtype of its shards

    def describe(self) -> str:
        """For logs and reports, e.g. "native (avx512vnni)"."""
        ...

    def load(self, source, layers: LayerRange, *, embed: bool, head: bool, lm_head: bool | None = None,
             donors: Sequence[Shard] = (), progress: bool = False) -> Shard:
        """The shard of ``layers`` of ``source`` (a weights.WeightSource). ``head``: the final norm (features
        out); ``lm_head`` (default ``head``): the LM head too. Tensors a donor (a shard of the same model on this
        engine) holds are shared, not loaded again. Raises UnsupportedModel for a model the engine cannot run."""
        ...

    def tensor_bytes(self, source, name: str) -> int:
        """Bytes this engine holds for the stored tensor ``name`` of ``source`` once loaded."""
        ...

    def kv_bytes_per_token(self, cfg: ModelConfig) -> int:
        """K + V of one token in one layer, in this engine's cache."""
        ...

    def draft_net(self, cfg: ModelConfig, state: dict[str, torch.Tensor], max_position: int) -> DraftNet:
        """An EAGLE draft head's network from its state dict (draft_head.DraftHead's keys, any float dtype)."""
        ...

    def layer_seconds(self, cfg: ModelConfig, tokens: int, context: int, repeats: int) -> float:
        """Median seconds of one decoder layer of ``cfg``'s shape on random weights: ``tokens`` rows over
        ``context`` cached ones (the device profile's benchmark)."""
        ...
