"""A slice of a Llama-family decoder: layers ``[start, end)``, plus the embedding and/or the final norm + LM head
where the slice's role needs them. One block implementation serves llama, mistral and qwen2 (and the draft head).

Glossary:
    hidden     residual-stream activations between layers            [batch, n, hidden]
    features   final-normed hidden states (input of the LM head);     [batch, n, hidden]
               EAGLE calls these the target's features
    mask       which keys a new token may attend to, over [cache | new tokens]: [batch, n, cache_len + n] bool
               (True = visible). ``None`` means "all of the cache, causal among the new tokens".

Numerics mirror transformers' eager Llama code (RMSNorm computed in float32, rotary tables computed in float32),
so this forward agrees with it to float rounding, in float32 and float64 alike.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import env
from ..errors import ContextOverflow, ForwardStopped
from ..types import LayerRange
from . import kernels as fewrow
from .arch import ModelConfig
from .kv_cache import KVCache
from .weights import EMBED, HEAD, NORM, ROPE_FREQS, WeightSource, shard_tensor_names

# -- matmuls of a few rows -----------------------------------------------------------------------------------------
# MKL's sgemm streams the whole weight matrix once per row when a matmul has only a few rows (2-32: tree
# verification, pipeline segments, the draft head's frontier), so an n-node forward would cost close to n one-node
# ones. A backend that reads the weights once for all rows makes a few rows cost about what one does, with a second
# copy of each weight in its layout, made once. Two backends, best first:
#   fewrow  this package's AVX2 kernel (kernels.py, csrc/fewrow.c; needs a C compiler, built on first use, one
#           torch thread);
#   onednn  oneDNN with weights reordered into its blocked layout.
# One row stays on MKL's gemv (faster there). The same holds for the LM head and the draft head's reduced LM head
# (``project``); big prompt chunks stay on MKL. The copy doubles a block's weight memory, is made lazily on the
# first few-row inference forward (pipeline stages make it when they load: Shard.warm_up), and is remade if the
# weights change. float32 only. ``python -m flowspec_p2p.bench.kernels`` times the backends; the figures are in
# docs/experiments.md. FLOWSPEC_PACKED_WEIGHTS (env.py): 1 (default) the best available backend, ``fewrow`` or
# ``onednn`` that one, 0 none (e.g. to save memory).
PACKED_MAX_ROWS = 32  # above this MKL's blocking is as good, and prompt chunks keep MKL's numerics
_PACK_HINT = 16  # oneDNN's batch-size hint for the reorder; 4-64 measured alike for 2-16 rows


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x: [..., in] float32 @ a weight reordered by _onednn_pack -> [..., out]"""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _onednn_pack(w_t: torch.Tensor) -> torch.Tensor:
    """w_t: [in, out] -> oneDNN's blocked copy"""
    return torch.ops.mkldnn._reorder_linear_weight(w_t.detach().t().contiguous(), _PACK_HINT)


@dataclass(frozen=True)
class Backend:
    """How few-row matmuls (2..PACKED_MAX_ROWS rows) run: ``pack`` makes the copy of an [in, out] weight,
    ``matmul(x, copy)`` uses it."""

    name: str
    pack: Callable[[torch.Tensor], object]
    matmul: Callable[[torch.Tensor, object], torch.Tensor]


ONEDNN = Backend("onednn", _onednn_pack, _onednn_linear)
FEWROW = Backend("fewrow", fewrow.pack, fewrow.matmul)


@functools.cache
def _onednn_available() -> bool:
    try:
        y = _onednn_linear(torch.ones(2, 3), _onednn_pack(torch.ones(3, 2)))
    except (AttributeError, RuntimeError):
        return False
    return torch.backends.mkldnn.is_available() and torch.equal(y, torch.full((2, 2), 3.0))


def backend(dtype: torch.dtype = torch.float32) -> Backend | None:
    """The few-row backend for ``dtype`` now (FLOWSPEC_PACKED_WEIGHTS, what this host has, torch's thread count:
    the fewrow kernel is single-threaded), or None: plain matmuls."""
    choice = env.packed_weights()
    if dtype != torch.float32 or choice == "0":
        return None
    if choice in ("1", "fewrow") and torch.get_num_threads() == 1 and fewrow.library() is not None:
        return FEWROW
    if choice in ("1", "onednn", "fewrow") and _onednn_available():
        return ONEDNN
    return None


def packing_enabled(dtype: torch.dtype = torch.float32) -> bool:
    """Whether few-row matmuls in ``dtype`` use packed copies (and so weights take twice the memory)."""
    return backend(dtype) is not None


def _backend_for(rows: int, dtype: torch.dtype) -> Backend | None:
    """The backend a matmul of ``rows`` rows in ``dtype`` goes through, or None (inference only: autograd never
    sees a packed copy)."""
    if not 1 < rows <= PACKED_MAX_ROWS or torch.is_grad_enabled():
        return None
    return backend(dtype)


class PackedWeights:
    """One backend's copies of some [in, out] weights, remade when any of them (or the backend) changes."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.weights: list = []

    def get(self, ws: list[torch.Tensor], b: Backend) -> list:
        key = (b.name, *(w._version for w in ws), *(w.data_ptr() for w in ws))
        if key != self.key:
            with torch.inference_mode():
                self.weights = [b.pack(w) for w in ws]
            self.key = key
        return self.weights


def project(x: torch.Tensor, w_t: torch.Tensor, packed: PackedWeights) -> torch.Tensor:
    """x: [..., in] @ w_t: [in, out] -> [..., out], through ``packed``'s copy of w_t for a few rows."""
    b = _backend_for(x.numel() // x.shape[-1], w_t.dtype)
    if b is not None:
        return b.matmul(x, packed.get([w_t], b)[0])
    return x @ w_t


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        var = h.pow(2).sum(-1, keepdim=True).div_(h.shape[-1])  # = .mean(-1) bit for bit, dispatched faster
        h = h * torch.rsqrt(var.add_(self.eps))
        return self.weight * h.to(dtype)


def rope_inv_freq(cfg: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding. -> [head_dim // 2], float32

    Computed in float32 exactly as transformers does (whatever the model dtype), so that our logits agree
    with its forward to the last bit of the rotary tables. ``freq_factors`` is llama.cpp's
    ``rope_freqs.weight`` (llama3 scaling baked into a tensor), if the checkpoint has one.
    """
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if freq_factors is not None:
        return inv / freq_factors.float()
    s = cfg.rope_scaling
    if s is None:
        return inv
    if s.kind == "linear":
        return inv / s.factor
    # llama3: keep high frequencies, divide low ones by `factor`, blend in between (Llama 3.1 reference code).
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    mid = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(mid, smoothed, scaled)


class Rotary:
    """Precomputed cos/sin tables (float32 math, stored in the model dtype). cos, sin: [max_pos, head_dim]"""

    def __init__(self, cfg: ModelConfig, max_pos: int, dtype: torch.dtype, freq_factors: torch.Tensor | None = None):
        inv = rope_inv_freq(cfg, freq_factors)  # [head_dim/2]
        freqs = torch.arange(max_pos, dtype=torch.int64).float()[:, None] * inv[None, :]  # [max_pos, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [batch, n] -> cos, sin: [batch, 1, n, head_dim]"""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x.narrow(-1, half, half), x.narrow(-1, 0, half)), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., head_dim]; cos, sin broadcastable to x (e.g. x [batch, heads, n, head_dim] with cos, sin
    [batch, 1, n, head_dim], or x [batch, n, heads, head_dim] with cos, sin [batch, n, 1, head_dim])"""
    return x * cos + _rotate_half(x) * sin


class DecoderBlock(nn.Module):
    """Pre-norm attention (GQA, rotary, optional q/k/v bias) + SwiGLU MLP.

    Weights are stored fused (q|k|v and gate|up) and transposed to [in, out]: on a CPU, a matmul against a
    row-major [in, out] matrix streams the weights once and is 20-30% faster at the 1-16 rows decoding and
    tree verification use than ``F.linear`` against [out, in].
    """

    def __init__(self, cfg: ModelConfig, *, input_norm: bool = True):
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.attn_norm = RMSNorm(h, cfg.rms_eps) if input_norm else nn.Identity()
        self.wqkv = nn.Parameter(torch.empty(h, cfg.q_dim + 2 * cfg.kv_dim))  # [in, out]
        self.bqkv = nn.Parameter(torch.zeros(cfg.q_dim + 2 * cfg.kv_dim)) if cfg.attention_bias else None
        self.wo = nn.Parameter(torch.empty(cfg.q_dim, h))
        self.mlp_norm = RMSNorm(h, cfg.rms_eps)
        self.w13 = nn.Parameter(torch.empty(h, 2 * cfg.intermediate_size))
        self.w2 = nn.Parameter(torch.empty(cfg.intermediate_size, h))
        self._packed = PackedWeights()

    def _weights(self, rows: int) -> tuple[Callable, list[torch.Tensor]]:
        """(matmul, [wqkv, wo, w13, w2]) for a forward of ``rows`` rows: the few-row backend with its copies when
        one applies (see above), else ``@`` with the parameters themselves."""
        ws = [self.wqkv, self.wo, self.w13, self.w2]
        b = _backend_for(rows, self.wqkv.dtype)
        if b is not None:
            return b.matmul, self._packed.get(ws, b)
        return torch.matmul, ws

    def reset_parameters(self, std: float = 0.02) -> None:
        """Random init (draft-head training, tests)."""
        with torch.no_grad():
            for w in (self.wqkv, self.wo, self.w13, self.w2):
                w.normal_(0.0, std)
            if self.bqkv is not None:
                self.bqkv.zero_()

    def load_hf(self, t: Mapping[str, torch.Tensor], prefix: str) -> None:
        """Copy weights named like transformers' ``model.layers.{i}.`` (``prefix``) into the fused layout."""
        with torch.no_grad():
            if isinstance(self.attn_norm, RMSNorm):
                self.attn_norm.weight.copy_(t[prefix + "input_layernorm.weight"])
            a = prefix + "self_attn."
            self.wqkv.copy_(torch.cat([t[a + f"{x}_proj.weight"] for x in "qkv"]).t())
            if self.bqkv is not None:
                self.bqkv.copy_(torch.cat([t[a + f"{x}_proj.bias"] for x in "qkv"]))
            self.wo.copy_(t[a + "o_proj.weight"].t())
            self.mlp_norm.weight.copy_(t[prefix + "post_attention_layernorm.weight"])
            m = prefix + "mlp."
            self.w13.copy_(torch.cat([t[m + "gate_proj.weight"], t[m + "up_proj.weight"]]).t())
            self.w2.copy_(t[m + "down_proj.weight"].t())

    def forward(
        self,
        x: torch.Tensor,  # [batch, n, hidden]
        cos: torch.Tensor,  # [batch, 1, n, head_dim]
        sin: torch.Tensor,
        kv: tuple[KVCache, int, int] | None,  # (cache, layer index in cache, first slot) or None: no cache
        mask: torch.Tensor | None,  # [batch, 1, n, kv_len] bool, or None
        causal: bool,
    ) -> torch.Tensor:
        cfg = self.cfg
        b, n, _ = x.shape
        hq, hk, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        mm, (wqkv, wo, w13, w2) = self._weights(b * n)
        qkv = mm(self.attn_norm(x), wqkv)  # [b, n, (hq + 2 hk) hd]
        if self.bqkv is not None:
            qkv = qkv + self.bqkv
        # q and k rotated together, as [b, n, hq + hk, hd] (half the small ops of rotating each); narrow rather
        # than tuple indexing throughout: decoding one token is bound by per-op overhead outside the matmuls
        qk = qkv.narrow(-1, 0, cfg.q_dim + cfg.kv_dim).view(b, n, hq + hk, hd)
        qk = apply_rotary(qk, cos.transpose(1, 2), sin.transpose(1, 2))
        q = qk.narrow(2, 0, hq).transpose(1, 2)  # [b, hq, n, hd]
        k = qk.narrow(2, hq, hk).transpose(1, 2)  # [b, hk, n, hd]
        v = qkv.narrow(-1, cfg.q_dim + cfg.kv_dim, cfg.kv_dim).view(b, n, hk, hd).transpose(1, 2)  # [b, hk, n, hd]
        if kv is not None:
            cache, layer, start = kv
            k, v = cache.write(layer, start, k, v)  # [b, kv_heads, start + n, hd]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
        x = x + mm(o.transpose(1, 2).reshape(b, n, cfg.q_dim), wo)
        gate, up = mm(self.mlp_norm(x), w13).chunk(2, dim=-1)
        return x + mm(F.silu(gate) * up, w2)


class _LazyTensors(Mapping[str, torch.Tensor]):
    """Tensors of ``names``, read from ``source`` (in ``dtype``) on each lookup and not kept."""

    def __init__(self, source: WeightSource, dtype: torch.dtype, names: list[str]):
        self.source, self.dtype, self.names = source, dtype, names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise KeyError(name)
        return self.source.load(name).to(self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class Shard(nn.Module):
    """Layers ``[start, end)`` of a decoder; ``embed`` if it receives token ids, ``head`` if it ends the model."""

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
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size,
                                  dtype=dtype)) if embed else None
        self.blocks = nn.ModuleList(DecoderBlock(cfg) for _ in layers.indices())
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps) if head else None
        self.head_t: torch.Tensor | None = None  # [hidden, vocab]: the LM head, transposed (see DecoderBlock)
        self._head_packed = PackedWeights()  # its few-row copy (see the top of the file)
        self.max_position = max_position or cfg.max_position
        self.rotary = Rotary(cfg, self.max_position, dtype, rope_freqs)
        self.to(dtype)

    @classmethod
    def from_source(
        cls,
        source: WeightSource,
        layers: LayerRange,
        *,
        embed: bool,
        head: bool,
        dtype: torch.dtype = torch.float32,
        max_position: int | None = None,
    ) -> Shard:
        """Materialise only this shard's tensors from ``source``."""
        cfg = source.config
        if layers.end > cfg.num_layers:
            raise ValueError(f"layer range {layers} exceeds the model's {cfg.num_layers} layers")
        freqs = source.load(ROPE_FREQS) if ROPE_FREQS in source.names() else None
        shard = cls(cfg, layers, embed=embed, head=head, dtype=dtype, max_position=max_position, rope_freqs=freqs)
        # Each tensor is read when its parameter is filled and dropped right after: peak memory stays at the
        # shard's size plus one tensor, and nothing outside shard_tensor_names is ever read.
        shard.load_hf(_LazyTensors(source, dtype, shard_tensor_names(cfg, layers, embed=embed, head=head)))
        return shard

    def load_hf(self, t: Mapping[str, torch.Tensor]) -> None:
        """Copy weights named like transformers' checkpoints (``model.layers.{i}.``, ``lm_head.weight``, ...)."""
        with torch.no_grad():
            if self.embed is not None:
                self.embed.weight.copy_(t[EMBED])
            for block, i in zip(self.blocks, self.layers.indices(), strict=True):
                block.load_hf(t, f"model.layers.{i}.")
            if self.norm is not None:
                self.norm.weight.copy_(t[NORM])
                if self.cfg.tie_embeddings and self.embed is not None:
                    w = self.embed.weight  # [vocab, hidden], already loaded
                else:
                    w = t[EMBED if self.cfg.tie_embeddings else HEAD]
                self.head_t = w.to(self.dtype).t().contiguous()  # [hidden, vocab]
                if self.cfg.tie_embeddings and self.embed is not None:
                    # one table, not two: the embedding becomes a [vocab, hidden] view of the head (a lookup of a
                    # few strided rows costs microseconds; the head's matmuls keep their contiguous layout)
                    self.embed.weight = nn.Parameter(self.head_t.t(), requires_grad=False)

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
        if positions is None:  # consecutive positions: a view of the tables, no gather
            cos = self.rotary.cos[start : start + n].expand(b, 1, n, -1)  # [b, 1, n, head_dim]
            sin = self.rotary.sin[start : start + n].expand(b, 1, n, -1)
        else:
            cos, sin = self.rotary.gather(positions)
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
        for i, block in enumerate(self.blocks):
            if stop is not None and stop():
                if cache is not None:
                    cache.advance(n)
                raise ForwardStopped(f"stopped before layer {i} of {len(self.blocks)}")
            h = block(h, cos, sin, None if cache is None else (cache, i, start), attn_mask, causal)
        if cache is not None:
            cache.advance(n)
        if self.norm is not None:
            h = self.norm(h)
        return h

    def warm_up(self, max_rows: int = 8) -> None:
        """Make the blocks' few-row copies now and run a tree forward of each size 1..max_rows through a
        scratch cache (a stage does at load). Otherwise the first tree forward pays for the copies (~0.2 s for a
        quarter of the default model) and (with oneDNN) the first of each size for its set-up of that shape, and an
        emulated slow device multiplies both."""
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
        return project(features, self.head_t, self._head_packed)

    def head_rows(self, rows: torch.Tensor | None, dtype: torch.dtype | None = None) -> HeadRows:
        """The LM head restricted to ``rows`` (a draft vocabulary of target ids; None: all), in ``dtype``."""
        assert self.head_t is not None, "this shard holds no LM head"
        head_t = self.head_t if rows is None else self.head_t[:, rows]
        return HeadRows(head_t.to(dtype or self.dtype).contiguous())


class HeadRows:
    """Some rows of an LM head as a matmul: ``matmul(x)`` [..., hidden] -> [..., rows] (few rows through the
    few-row backend's copy, as the head itself)."""

    def __init__(self, head_t: torch.Tensor):
        self.head_t = head_t  # [hidden, rows]
        self.rows = head_t.shape[1]
        self._packed = PackedWeights()

    @property
    def nbytes(self) -> int:
        return self.head_t.numel() * self.head_t.element_size()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return project(x.to(self.head_t.dtype), self.head_t, self._packed)
