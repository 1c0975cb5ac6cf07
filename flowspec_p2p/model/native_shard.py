"""The native engine (model/native/): a layer range whose weights stay in their GGUF blocks, run by one C call per
forward.

    NativeShard    layers [start, end) + (optionally) the embedding, the final norm and the LM head, packed from a
                   weight source (a GGUF file, a HF folder, or the tensors a member fetched) into one arena
                   (engine.Shard)
    NativeEngine   how the native engine loads shards and what they cost in memory (engine.Engine)

Weights: every matrix is packed from the source's stored bytes into the engine's layout (no float copy, no second
copy; native_pack.py); after packing a GGUF tensor its file pages are dropped from memory. A type the engine has no
kernel for is dequantized and kept as F16 (logged once per type). Float checkpoints keep their 16 bits (F16/BF16) or
float32, or are quantized to Q8_0 at load (``quantize="Q8_0"``). Activations between layers are float32; the
integer kernels quantize them to 16 bits per 32-element block inside each matmul, which keeps greedy output equal to
a float32 reference (docs/experiments.md) and every row's result independent of the other rows in its batch: a
tree forward scores a node exactly as decoding it alone would.

The engine runs batch 1 (one request's rows). Training and float64 work use the torch engine (torch_shard.py).
"""

from __future__ import annotations

import functools
import itertools
import logging
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from tqdm import tqdm

from ..errors import ContextOverflow, ForwardStopped
from ..types import LayerRange
from . import native
from .arch import ModelConfig, norm_names
from .blocks import Rotary
from .engine import BatchRows, StopFlag
from .kv_cache import KVCache
from .native_draft import NativeDraftHead
from .native_pack import CHUNK_ROWS, StoredTensor, describe, names_read, pack, release, sorted_rows
from .weights import EMBED, HEAD, NORM, ROPE_FREQS, WeightSource, load_tensor, tensor_shape

log = logging.getLogger(__name__)

MATRICES = ("q", "k", "v", "o", "gate", "up", "down")
_HF = {"q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
       "o": "self_attn.o_proj.weight", "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
       "down": "mlp.down_proj.weight"}
QUANTIZE = ("Q8_0",)
# the rotary tables' first size in positions (4 KB each for head_dim 256: Gemma 3's two pairs of tables take 1 MB at
# first, not 4); they grow to twice their size or to what a forward needs, in multiples of it
ROTARY_CHUNK = 256


@functools.cache
def available() -> bool:
    """Whether the native engine runs here (built, loaded, self-tested; the reason is logged once if not)."""
    return native.library() is not None


def set_threads(n: int | None) -> None:
    """The engine's worker threads (None: leave as is). Torch's are set by the caller."""
    if n is not None and available():
        native.set_threads(n)


class _Norm:
    """The final RMSNorm on the engine: [..., hidden] -> [..., hidden] float32."""

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight = weight.to(torch.float32).contiguous()  # [hidden]
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.to(torch.float32).reshape(-1, x.shape[-1])
        return native.rmsnorm(flat, self.weight, self.eps).view(x.shape)


class _Embedding:
    """Embedding lookups from a packed matrix: ids [...] -> [..., hidden] float32, times ``scale`` if given (Gemma)."""

    def __init__(self, matrix: native.QMatrix, scale: float | None = None):
        self.matrix = matrix
        self.scale = scale

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self.matrix.rows_f32(flat).view(*ids.shape, self.matrix.cols)
        return rows if self.scale is None else rows.mul_(self.scale)


class NativeShard:
    """Layers ``[start, end)`` of a decoder on the native engine (engine.Shard)."""

    dtype = torch.float32
    quantize: str | None = None  # what float checkpoints were quantized to at load (from_source)

    def __init__(self, cfg: ModelConfig, layers: LayerRange, stack: native.LayerStack, *,
                 embed: native.QMatrix | None, norm: torch.Tensor | None, lm_head: native.QMatrix | None,
                 rope_freqs: torch.Tensor | None, max_position: int, specs: Sequence[native.LayerSpec]):
        self.cfg = cfg
        self.layers = layers
        self.stack = stack
        self.specs = list(specs)  # per layer: what a later shard of the same model may share (a re-plan)
        self.embed_matrix = embed
        self.embed = None if embed is None else _Embedding(embed, cfg.embed_scale)
        self.norm = None if norm is None else _Norm(norm, cfg.rms_eps)
        self.lm_head = lm_head
        self.head_source: tuple[WeightSource, StoredTensor] | None = None  # where the LM head's rows are stored
        self.rope_freqs = rope_freqs
        self.max_position = max_position
        self.rotary = Rotary(cfg, min(max_position, ROTARY_CHUNK), torch.float32, rope_freqs)  # grown on demand
        self.local = any(s.rope for s in self.specs)  # some layers use the local tables (Gemma 3's windowed ones)
        self.rotary_local = Rotary(cfg, self.rotary.cos.shape[0], torch.float32, local=True) if self.local else None

    @property
    def engine(self) -> NativeEngine:
        return NativeEngine(self.quantize)

    @property
    def has_embed(self) -> bool:
        return self.embed is not None

    @property
    def has_head(self) -> bool:
        return self.norm is not None

    @property
    def nbytes(self) -> int:
        """Bytes of the weights this shard holds, shared ones included: its packed matrices and float32 vectors
        (norms, biases)."""
        held = {id(m): m.nbytes for s in self.specs for m in (getattr(s, n) for n in MATRICES)}
        for m in (self.embed_matrix, self.lm_head):
            if m is not None:
                held[id(m)] = m.nbytes
        vectors = [v for s in self.specs for v in (s.attn_norm, s.mlp_norm, s.q_bias, s.k_bias, s.v_bias, s.q_norm,
                                                   s.k_norm, s.post_attn_norm, s.post_mlp_norm)]
        if self.norm is not None:
            vectors.append(self.norm.weight)
        held.update({id(v): v.numel() * v.element_size() for v in vectors if v is not None})
        return sum(held.values())

    @classmethod
    def from_source(cls, source: WeightSource, layers: LayerRange, *, embed: bool, head: bool,
                    lm_head: bool | None = None, max_position: int | None = None, quantize: str | None = None,
                    donors: Sequence[NativeShard] = (), progress: bool = False) -> NativeShard:
        """Pack this shard's tensors from ``source``. ``head``: the final norm (features out); ``lm_head``
        (default ``head``): the LM head too. Layers a donor (a shard of the same model) holds are shared, not
        packed again. ``progress``: a bar on stderr (bytes, rate, time left) while it packs."""
        cfg = source.config
        if layers.end > cfg.num_layers:
            raise ValueError(f"layer range {layers} exceeds the model's {cfg.num_layers} layers")
        if quantize is not None and quantize not in QUANTIZE:
            raise ValueError(f"quantize: one of {', '.join(QUANTIZE)}, not {quantize!r}")
        lm_head = head if lm_head is None else lm_head
        donated = {i: d.specs[i - d.layers.start] for d in donors for i in d.layers.indices()}
        names = {i: {k: f"model.layers.{i}.{v}" for k, v in _HF.items()} for i in layers.indices()
                 if i not in donated}
        want = [n for per in names.values() for n in per.values()]
        tied = cfg.tie_embeddings
        # a donor's embedding and LM head (one matrix when tied) are shared too: a leader's head shard and its
        # first stage hold the embedding once
        emb_donor = next((d.embed_matrix for d in donors if d.embed_matrix is not None), None)
        head_donor = next((d for d in donors if d.lm_head is not None), None)
        if tied and emb_donor is None and head_donor is not None:
            emb_donor = head_donor.lm_head
        if embed and emb_donor is None:
            want.append(EMBED)
        if lm_head and head_donor is None and not (tied and (embed or emb_donor is not None)):
            want.append(EMBED if tied else HEAD)
        tensors = {n: describe(source, n, quantize) for n in dict.fromkeys(want)}
        arena = native.WeightArena.for_matrices([(t.type_name, t.rows, t.cols) for t in tensors.values()])
        packed: dict[str, native.QMatrix] = {}
        total = sum(len(source.raw_bytes(n)) for n in tensors)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"packing layers {layers}", leave=False,
                  disable=None if progress else True, file=sys.stderr) as bar:
            for name, t in tensors.items():
                packed[name] = pack(source, t, cfg, quantize, arena)
                bar.update(len(source.raw_bytes(name)))
        specs = []
        for i in layers.indices():
            if i in donated:
                specs.append(donated[i])
                continue
            p = f"model.layers.{i}."
            bias = {f"{x}_bias": source.load(p + f"self_attn.{x}_proj.bias").float() for x in "qkv"} \
                if cfg.attention_bias else {}
            norms = {role: load_tensor(source, p + name).float() for role, name in norm_names(cfg).items()}
            for name in (*norm_names(cfg).values(), *(f"self_attn.{x}_proj.bias" for x in "qkv" if bias)):
                release(source, p + name)  # now, not at the end: a large-folio file maps far more than the vector
            specs.append(native.LayerSpec(**{k: packed[n] for k, n in names[i].items()}, **norms, **bias,
                                          window=cfg.window(i), rope=int(cfg.local_rope(i))))
        stack = native.LayerStack(specs, hidden=cfg.hidden_size, q_heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                                  head_dim=cfg.head_dim, intermediate=cfg.intermediate_size, eps=cfg.rms_eps,
                                  activation=cfg.activation, attn_scale=cfg.attn_scale)
        emb = (emb_donor if emb_donor is not None else packed.get(EMBED)) if embed else None
        head_m = head_source = None
        if lm_head:
            if head_donor is not None:
                head_m, head_source = head_donor.lm_head, head_donor.head_source
            elif tied:
                head_m = emb_donor if emb_donor is not None else packed[EMBED]
            else:
                head_m = packed[HEAD]
            if head_source is None:
                stored = EMBED if tied else HEAD
                head_source = (source, tensors[stored] if stored in tensors else describe(source, stored, quantize))
        freqs = source.load(ROPE_FREQS) if ROPE_FREQS in source.names() else None
        norm = load_tensor(source, NORM).float() if head else None
        for name in names_read(cfg, layers, embed=embed, head=head, tensors=tensors):
            release(source, name)  # the norms' (and biases') pages too: everything is packed or copied now
        shard = cls(cfg, layers, stack, embed=emb, norm=norm, lm_head=head_m, rope_freqs=freqs,
                    max_position=max_position or cfg.max_position, specs=specs)
        shard.head_source = head_source
        shard.quantize = quantize
        return shard

    # ------------------------------------------------------------------------------------------- running

    def eval(self) -> NativeShard:
        return self

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        assert batch == 1, "the native engine runs one request's rows"
        c = self.cfg
        return KVCache(len(self.layers), c.num_kv_heads, c.head_dim, capacity, dtype=torch.float32)

    def __call__(
        self,
        x: torch.Tensor,  # ids [1, n] if has_embed else hidden [1, n, hidden]
        cache: KVCache | None,
        positions: torch.Tensor | None = None,  # [1, n] absolute; default cache.length + arange(n)
        mask: torch.Tensor | None = None,  # [1, n, cache.length + n] bool, or None: the cache + causal
        stop: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """As engine.Shard: K/V of the new rows appended to ``cache``; -> hidden [1, n, hidden], or features if
        it holds the final norm. ``stop``: a StopFlag the engine reads before each layer (any other callable is
        asked once, before the first); when set, raises ForwardStopped with the rows' slots reserved."""
        if cache is None:
            cache = self.new_cache(x.shape[1])
        return self.forward_batch([BatchRows(x, cache, positions, mask)], stop)[0]

    def forward_batch(self, items: Sequence[BatchRows], stop: Callable[[], bool] | None = None
                      ) -> list[torch.Tensor]:
        """The rows of several requests in one engine call (engine.Shard.forward_batch): each item's rows attend
        to its own cache under its own mask; every row's result is bit-identical to a forward of its item alone."""
        hs, groups, pos = [], [], []
        top = 0
        for it in items:
            if self.embed is not None and not it.x.dtype.is_floating_point:
                h = self.embed(it.x)  # [1, n, hidden], a fresh tensor
            else:
                # a copy: the engine updates the rows in place (several items are copied by the cat below)
                h = it.x.to(torch.float32, copy=len(items) == 1)
            b, n, _ = h.shape
            assert b == 1, "the native engine takes one request's rows per item"
            start = it.cache.reserve(n)
            p = torch.arange(start, start + n) if it.positions is None else it.positions.reshape(n)  # [n]
            last = int(p.max()) if n else start
            if last >= self.max_position:
                it.cache.advance(n)
                raise ContextOverflow(f"position {last} exceeds the model limit {self.max_position}")
            if it.mask is not None:
                assert it.mask.shape == (1, n, start + n), (tuple(it.mask.shape), (1, n, start + n))
            hs.append(h.view(n, -1))
            pos.append(p)
            top = max(top, last + 1)
            if n:
                groups.append(native.Group(it.cache.k[:, 0], it.cache.v[:, 0], start, n,
                                           None if it.mask is None else it.mask[0]))
        rows = hs[0].contiguous() if len(hs) == 1 else torch.cat(hs)  # [N, hidden], all items' rows
        flag = stop.c if isinstance(stop, StopFlag) else None
        done = len(self.layers)
        if stop is not None and flag is None and stop():
            done = 0
        elif groups and len(self.layers):
            rot = self._rotary_upto(top)
            local = (self.rotary_local.cos, self.rotary_local.sin) if self.rotary_local is not None else None
            done = self.stack.forward_groups(rows, torch.cat(pos), rot.cos, rot.sin, groups, flag, local)
        for it in items:
            it.cache.advance(it.x.shape[1])
        if done < len(self.layers):
            raise ForwardStopped(f"stopped before layer {done} of {len(self.layers)}")
        if self.norm is not None:
            rows = self.norm(rows)
        return [o[None] for o in rows.split([h.shape[0] for h in hs])]

    forward = __call__

    def _rotary_upto(self, positions: int) -> Rotary:
        """The rotary tables, grown (doubled, or more in ROTARY_CHUNK steps; up to max_position) to cover
        ``positions``. A table's rows do not depend on its size, so growing it changes no result."""
        have = self.rotary.cos.shape[0]
        if positions > have:
            size = min(self.max_position, max(2 * have, -(-positions // ROTARY_CHUNK) * ROTARY_CHUNK))
            self.rotary = Rotary(self.cfg, size, torch.float32, self.rope_freqs)
            if self.local:
                self.rotary_local = Rotary(self.cfg, size, torch.float32, local=True)
        return self.rotary

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """features: [..., hidden] -> [..., vocab]"""
        assert self.lm_head is not None, "this shard holds no LM head"
        logits = self.lm_head.matmul(features.to(torch.float32))
        cap = self.cfg.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def greedy_tokens(self, features: torch.Tensor) -> torch.Tensor:
        """features: [..., hidden] -> [...] int64, logits(features).argmax(-1) bit for bit. One LM-head call in
        which each thread keeps the maxima of the vocabulary slices it computes (QMatrix.argmax): no [..., vocab]
        logits (1 MiB a row on a 262k vocabulary). A soft-capped head (Gemma 2) takes the logits: tanh can map
        different logits to one value, which changes which is first."""
        assert self.lm_head is not None, "this shard holds no LM head"
        if self.cfg.final_softcap is not None:
            return self.logits(features).argmax(-1)
        return self.lm_head.argmax(features.to(torch.float32))

    def head_rows(self, rows: torch.Tensor | None, dtype: torch.dtype | None = None) -> native.QMatrix:
        """The LM head restricted to ``rows`` (a draft vocabulary of target ids; None: all): a packed matrix of
        those rows in the head's stored type (Q8_0 for a float head), which the draft head scores its
        vocabulary with (float32 in, float32 out)."""
        assert self.lm_head is not None, "this shard holds no LM head"
        if rows is None:
            return self.lm_head
        ids = rows.to(torch.long).numpy()  # [V_d]
        if self.head_source is not None:
            source, t = self.head_source
            if source.raw_info(t.name)["format"] == "gguf" and t.type_name == t.stored and bool(
                    (ids[1:] > ids[:-1]).all()):
                return native.QMatrix.from_row_chunks(t.type_name, len(ids), t.cols, sorted_rows(source, t, ids))
            if source.raw_info(t.name)["format"] == "gguf" and t.type_name == t.stored:
                raw = np.frombuffer(source.raw_bytes(t.name), dtype=np.uint8).reshape(t.rows, -1)
                picked = np.empty((len(ids), raw.shape[1]), dtype=np.uint8)  # [V_d, row bytes], as stored
                order = np.argsort(ids, kind="stable")
                bounds = np.searchsorted(ids[order], np.arange(0, t.rows + CHUNK_ROWS, CHUNK_ROWS))
                for w, (i, j) in enumerate(itertools.pairwise(bounds)):  # one window of rows at a
                    sel = order[i:j]  # time, its pages dropped before the next: never the whole table resident
                    picked[sel] = raw[ids[sel]]
                    release(source, t.name, w * CHUNK_ROWS * raw.shape[1],
                             min(t.rows, (w + 1) * CHUNK_ROWS) * raw.shape[1])
                return native.QMatrix.from_gguf_bytes(t.type_name, len(ids), t.cols, picked)
        chunks = (native.q8_0_bytes(self.lm_head.rows_f32(torch.from_numpy(ids[a : a + CHUNK_ROWS])))
                  for a in range(0, len(ids), CHUNK_ROWS))  # a float head: Q8_0, a chunk at a time
        return native.QMatrix.from_row_chunks("Q8_0", len(ids), self.cfg.hidden_size, chunks)

    def warm_up(self, max_rows: int = 8) -> None:
        """One forward of each size 1..max_rows through a scratch cache: the engine's scratch buffers and the
        weights' pages are in place before the first request."""
        cache = self.new_cache(max_rows)
        for m in range(1, max_rows + 1):
            x = torch.zeros(1, m, dtype=torch.long) if self.embed is not None else torch.zeros(
                1, m, self.cfg.hidden_size)
            mask = torch.eye(m, dtype=torch.bool)[None]  # [1, m, m]: each node sees itself
            self(x, cache, positions=torch.zeros(1, m, dtype=torch.long), mask=mask)
            cache.keep([])


@dataclass(frozen=True)
class NativeEngine:
    """The native engine (engine.Engine): float32 activations over weights in their stored blocks."""

    quantize: str | None = None  # what float checkpoints are quantized to at load (None: kept in their 16 bits)
    name: ClassVar[str] = "native"
    dtype: ClassVar[torch.dtype] = torch.float32

    def describe(self) -> str:
        return f"native ({native.isa()})"

    def load(self, source: WeightSource, layers: LayerRange, *, embed: bool, head: bool, lm_head: bool | None = None,
             donors: Sequence = (), progress: bool = False) -> NativeShard:
        return NativeShard.from_source(source, layers, embed=embed, head=head, lm_head=lm_head,
                                       quantize=self.quantize, progress=progress,
                                       donors=[d for d in donors if isinstance(d, NativeShard)])

    def tensor_bytes(self, source: WeightSource, name: str) -> int:
        shape = tensor_shape(source, name)
        if len(shape) == 1:  # norms and biases: float32 copies
            return shape[0] * 4
        t = describe(source, name, self.quantize)
        return native.QMatrix.packed_size(t.type_name, t.rows, t.cols)

    def kv_bytes_per_token(self, cfg: ModelConfig) -> int:
        return cfg.kv_bytes_per_token(4)  # the cache is float32

    def draft_net(self, cfg: ModelConfig, state: dict[str, torch.Tensor], max_position: int) -> NativeDraftHead:
        return NativeDraftHead(cfg, state, max_position)

    def layer_seconds(self, cfg: ModelConfig, tokens: int, context: int, repeats: int, warmup: int = 2) -> float:
        """Random Q4_1 weights (the default model's type: the device's speed, not a model's values)."""
        rng = np.random.default_rng(0)

        def q4_1(rows: int, cols: int) -> native.QMatrix:
            blocks = rng.integers(0, 256, (rows * cols // 32, 20), dtype=np.uint8)
            scales = rng.uniform(0.001, 0.01, (blocks.shape[0], 2)).astype(np.float16)
            blocks[:, :4] = scales.view(np.uint8)
            return native.QMatrix.from_gguf_bytes("Q4_1", rows, cols, blocks)

        h, q, kv, inter = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.intermediate_size
        spec = native.LayerSpec(q=q4_1(q, h), k=q4_1(kv, h), v=q4_1(kv, h), o=q4_1(h, q), gate=q4_1(inter, h),
                                up=q4_1(inter, h), down=q4_1(h, inter), mlp_norm=torch.ones(h),
                                attn_norm=torch.ones(h))
        stack = native.LayerStack([spec], hidden=h, q_heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                                  head_dim=cfg.head_dim, intermediate=inter, eps=cfg.rms_eps)
        rotary = Rotary(cfg, context + tokens, torch.float32)
        k, v = stack.new_cache(context + tokens)
        pos = torch.arange(context, context + tokens)
        times = []
        for i in range(warmup + repeats):
            x = torch.randn(tokens, h)  # [tokens, hidden]
            t0 = time.perf_counter()
            stack.forward(x, pos, rotary.cos, rotary.sin, k, v, context)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)
