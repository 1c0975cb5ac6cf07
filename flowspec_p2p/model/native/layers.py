"""`LayerStack`: a range of decoder layers run by one native call per forward (fs_layers_forward_x): Llama's layer,
and what Qwen3, Gemma 3 and Phi-3 add (``LayerSpec``'s optional fields, ``LayerStack``'s activation and attention
scale; fs.h's fs_layer_x and fs_arch, mirrored here).

The KV cache is the caller's pair of float32 tensors [layers, kv_heads, capacity, head_dim]; a forward of n rows
writes slots [start, start + n) and attends over [0, start + n) under the mask (None: the whole prefix plus
causal among the new rows; or [n, start + n], True = visible, e.g. a draft tree's ancestor mask).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import _lib
from .qmatrix import QMatrix


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer's weights (projection shapes as in fs.h's fs_layer)."""

    q: QMatrix  # [q_heads * head_dim, hidden]
    k: QMatrix  # [kv_heads * head_dim, hidden]
    v: QMatrix  # [kv_heads * head_dim, hidden]
    o: QMatrix  # [hidden, q_heads * head_dim]
    gate: QMatrix  # [intermediate, hidden]
    up: QMatrix  # [intermediate, hidden]
    down: QMatrix  # [hidden, intermediate]
    mlp_norm: torch.Tensor  # [hidden] float32
    attn_norm: torch.Tensor | None = None  # [hidden] float32, None: no input norm (EAGLE's draft block)
    q_bias: torch.Tensor | None = None  # [q_heads * head_dim] (qwen2)
    k_bias: torch.Tensor | None = None  # [kv_heads * head_dim]
    v_bias: torch.Tensor | None = None  # [kv_heads * head_dim]
    q_norm: torch.Tensor | None = None  # [head_dim] QK-norm (qwen3, gemma3)
    k_norm: torch.Tensor | None = None  # [head_dim]
    post_attn_norm: torch.Tensor | None = None  # [hidden] the attention output's norm (gemma3)
    post_mlp_norm: torch.Tensor | None = None  # [hidden] the MLP output's norm (gemma3)
    window: int | None = None  # sliding window (keys a row sees), None: all
    rope: int = 0  # which of the forward's rotary tables (0: the first, 1: the second: gemma3's local layers)


class FsLayerX(ctypes.Structure):
    _fields_ = [("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("post_attn_norm", ctypes.c_void_p),
                ("post_mlp_norm", ctypes.c_void_p), ("window", ctypes.c_int64), ("rope", ctypes.c_int32),
                ("pad", ctypes.c_int32)]


class FsArch(ctypes.Structure):
    _fields_ = [("act", ctypes.c_int32), ("attn_scale", ctypes.c_float)]


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # fs.h's enum fs_activation


def _forward_x():
    """fs_layers_forward_x with its signature declared (once), its structs checked against the C side."""
    lib = _lib.require()
    fn = lib.fs_layers_forward_x
    if fn.argtypes is None:
        for struct, name in ((FsLayerX, b"fs_layer_x"), (FsArch, b"fs_arch")):
            if lib.fs_struct_size(name) != ctypes.sizeof(struct):
                raise RuntimeError(f"struct {name.decode()} differs from the C side")
        ptrs = ctypes.POINTER(ctypes.c_void_p)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(_lib.FsConfig), ctypes.POINTER(FsArch), ctypes.POINTER(_lib.FsLayer),
                       ctypes.POINTER(FsLayerX), ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                       ptrs, ptrs, ctypes.c_int, ctypes.c_int64, ctypes.POINTER(_lib.FsGroup), ctypes.c_int,
                       ctypes.POINTER(ctypes.c_int)]
    return fn


def _vector(t: torch.Tensor | None, size: int, what: str) -> torch.Tensor | None:
    if t is None:
        return None
    if t.shape != (size,) or t.device.type != "cpu":
        raise ValueError(f"{what}: expected a CPU [{size}], got {tuple(t.shape)} on {t.device}")
    return t.detach().to(torch.float32).contiguous()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class LayerStack:
    """Decoder layers [0, len(layers)) of a stage, with their config, ready for fs_layers_forward."""

    def __init__(self, layers: Sequence[LayerSpec], *, hidden: int, q_heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, eps: float, activation: str = "silu", attn_scale: float | None = None) -> None:
        if hidden <= 0 or q_heads <= 0 or kv_heads <= 0 or q_heads % kv_heads or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"bad config: hidden {hidden}, heads {q_heads}/{kv_heads}, head_dim {head_dim}")
        self.hidden, self.q_heads, self.kv_heads, self.head_dim = hidden, q_heads, kv_heads, head_dim
        self.intermediate, self.eps = intermediate, float(eps)
        self.config = _lib.FsConfig(hidden, q_heads, kv_heads, head_dim, intermediate, self.eps)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation: one of {', '.join(ACTIVATIONS)}, not {activation!r}")
        self.arch = FsArch(ACTIVATIONS[activation], 0.0 if attn_scale is None else float(attn_scale))
        qdim, kvdim = q_heads * head_dim, kv_heads * head_dim
        shapes = {"q": (qdim, hidden), "k": (kvdim, hidden), "v": (kvdim, hidden), "o": (hidden, qdim),
                  "gate": (intermediate, hidden), "up": (intermediate, hidden), "down": (hidden, intermediate)}
        self._keep: list[object] = []  # everything the C structs point into
        self._structs = (_lib.FsLayer * max(len(layers), 1))()
        self._xs = (FsLayerX * max(len(layers), 1))()
        self.n_rope = 1  # rotary tables a forward passes
        for i, spec in enumerate(layers):
            for name, shape in shapes.items():
                m: QMatrix = getattr(spec, name)
                if (m.rows, m.cols) != shape:
                    raise ValueError(f"layer {i} {name}: expected {shape}, got {(m.rows, m.cols)}")
            vecs = {"attn_norm": _vector(spec.attn_norm, hidden, f"layer {i} attn_norm"),
                    "mlp_norm": _vector(spec.mlp_norm, hidden, f"layer {i} mlp_norm"),
                    "q_bias": _vector(spec.q_bias, qdim, f"layer {i} q_bias"),
                    "k_bias": _vector(spec.k_bias, kvdim, f"layer {i} k_bias"),
                    "v_bias": _vector(spec.v_bias, kvdim, f"layer {i} v_bias")}
            xvecs = {"q_norm": _vector(spec.q_norm, head_dim, f"layer {i} q_norm"),
                     "k_norm": _vector(spec.k_norm, head_dim, f"layer {i} k_norm"),
                     "post_attn_norm": _vector(spec.post_attn_norm, hidden, f"layer {i} post_attn_norm"),
                     "post_mlp_norm": _vector(spec.post_mlp_norm, hidden, f"layer {i} post_mlp_norm")}
            if (spec.window is not None and spec.window < 1) or spec.rope not in (0, 1):
                raise ValueError(f"layer {i}: window {spec.window}, rope {spec.rope}")
            if vecs["mlp_norm"] is None:
                raise ValueError(f"layer {i}: mlp_norm is required")
            self._keep += [spec, *vecs.values(), *xvecs.values()]
            x = self._xs[i]
            for name, t in xvecs.items():
                setattr(x, name, _ptr(t))
            x.window = spec.window or 0
            x.rope = spec.rope
            self.n_rope = max(self.n_rope, spec.rope + 1)
            s = self._structs[i]
            for name in shapes:
                setattr(s, name, getattr(spec, name).struct())
            for name, t in vecs.items():
                setattr(s, name, _ptr(t))
        self.n_layers = len(layers)

    def new_cache(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed K and V caches [layers, kv_heads, capacity, head_dim] float32."""
        shape = (self.n_layers, self.kv_heads, capacity, self.head_dim)
        return torch.zeros(shape, dtype=torch.float32), torch.zeros(shape, dtype=torch.float32)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, start: int, mask: torch.Tensor | None = None,
                stop: ctypes.c_int | None = None) -> int:
        """Runs the layers on x [n, hidden] float32, in place (the residual stream). pos [n]: positions (rows of
        cos / sin [max_pos, head_dim] float32); caches [layers, kv_heads, capacity, head_dim] float32; mask None
        or [n, start + n] bool/uint8; stop: a ctypes.c_int another thread may set to end the forward after the
        current layer. Returns the number of layers completed."""
        n = x.shape[0] if x.ndim == 2 else -1
        return self.forward_groups(x, pos, cos, sin, [Group(k_cache, v_cache, start, n, mask)], stop)

    def forward_groups(self, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       groups: Sequence[Group], stop: ctypes.c_int | None = None,
                       local: tuple[torch.Tensor, torch.Tensor] | None = None) -> int:
        """``forward`` over the rows of several requests in one call: ``groups`` take x's rows in order, each with
        its own caches, start and mask (``Group``); the matmuls run over all rows at once, each group's rows
        attend to its own cache only. ``local``: the second rotary tables (cos, sin) the layers with ``rope`` 1
        use. Returns the number of layers completed."""
        n = x.shape[0] if x.ndim == 2 else -1
        tables = [(cos, sin)] if local is None else [(cos, sin), local]
        if len(tables) < self.n_rope:
            raise ValueError(f"the layers use {self.n_rope} rotary tables, {len(tables)} given")
        if x.dtype != torch.float32 or x.shape != (n, self.hidden) or not x.is_contiguous() or x.is_cuda:
            raise ValueError(f"x: expected contiguous CPU float32 [n, {self.hidden}], got {x.dtype} "
                             f"{tuple(x.shape)}")
        for c, s in tables:
            if c.ndim != 2 or c.shape[1] != self.head_dim or s.shape != c.shape or c.shape[0] != cos.shape[0]:
                raise ValueError(f"cos/sin: expected [max_pos, {self.head_dim}] (one max_pos), got "
                                 f"{tuple(c.shape)} {tuple(s.shape)}")
            for name, t in (("cos", c), ("sin", s)):
                if t.dtype != torch.float32 or not t.is_contiguous() or t.is_cuda:
                    raise ValueError(f"{name}: expected a contiguous CPU float32 tensor, got {t.dtype}")
        if pos.shape != (n,) or pos.dtype.is_floating_point:
            raise ValueError(f"pos: expected integer [{n}], got {pos.dtype} {tuple(pos.shape)}")
        pos32 = pos.to(torch.int32).contiguous()  # [n]
        if n and (int(pos32.min()) < 0 or int(pos32.max()) >= cos.shape[0]):
            raise ValueError(f"pos: positions must lie in [0, {cos.shape[0]})")
        if sum(g.n for g in groups) != n or any(g.n < 1 for g in groups):
            raise ValueError(f"groups: {[g.n for g in groups]} rows do not cover the {n} rows of x")
        structs = (_lib.FsGroup * max(len(groups), 1))()
        keep = []  # the masks the structs point into
        row = 0
        for i, g in enumerate(groups):
            mask8 = self._check_group(g)
            keep.append(mask8)
            structs[i] = _lib.FsGroup(g.k_cache.data_ptr(), g.v_cache.data_ptr(), _ptr(mask8), row, g.n,
                                      g.k_cache.shape[2], g.start)
            row += g.n
        cos_p = (ctypes.c_void_p * len(tables))(*(c.data_ptr() for c, _ in tables))
        sin_p = (ctypes.c_void_p * len(tables))(*(s.data_ptr() for _, s in tables))
        done = _forward_x()(
            ctypes.byref(self.config), ctypes.byref(self.arch), self._structs, self._xs, self.n_layers, x.data_ptr(),
            n, pos32.data_ptr(), cos_p, sin_p, len(tables), cos.shape[0], structs, len(groups),
            None if stop is None else ctypes.pointer(stop))
        if done < 0:
            raise RuntimeError(f"fs_layers_forward_x failed ({done})")
        return done

    def _check_group(self, g: Group) -> torch.Tensor | None:
        """The group's caches and mask checked (the C side trusts them) -> its mask as uint8, or None."""
        for name, t in (("k_cache", g.k_cache), ("v_cache", g.v_cache)):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.is_cuda:
                raise ValueError(f"{name}: expected a contiguous CPU float32 tensor, got {t.dtype}")
        cap = g.k_cache.shape[2] if g.k_cache.ndim == 4 else -1
        if g.k_cache.shape != (self.n_layers, self.kv_heads, cap, self.head_dim) or g.v_cache.shape != g.k_cache.shape:
            raise ValueError(f"caches: expected [{self.n_layers}, {self.kv_heads}, capacity, {self.head_dim}], got "
                             f"{tuple(g.k_cache.shape)} {tuple(g.v_cache.shape)}")
        if not 0 <= g.start <= cap - g.n:
            raise ValueError(f"start {g.start} + {g.n} rows exceeds the cache capacity {cap}")
        if g.mask is None:
            return None
        if g.mask.shape != (g.n, g.start + g.n) or g.mask.dtype not in (torch.bool, torch.uint8):
            raise ValueError(f"mask: expected bool/uint8 [{g.n}, {g.start + g.n}], got {g.mask.dtype} "
                             f"{tuple(g.mask.shape)}")
        return g.mask.to(torch.uint8).contiguous()  # [n, start + n]


@dataclass(frozen=True)
class Group:
    """One request's rows in a batched forward: its caches [layers, kv_heads, capacity, head_dim] float32, where its
    rows' K and V go (slots [start, start + n)) and its mask (None: the cache + causal; or [n, start + n])."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    start: int
    n: int
    mask: torch.Tensor | None = None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [n, dim] float32 -> RMSNorm(x) * weight [n, dim] float32 (the engine's own, as inside the layer stack)."""
    if x.dtype != torch.float32 or x.ndim != 2 or x.is_cuda:
        raise ValueError(f"rmsnorm: expected CPU float32 [n, dim], got {x.dtype} {tuple(x.shape)}")
    n, dim = x.shape
    w = _vector(weight, dim, "rmsnorm weight")
    x = x.contiguous()
    out = torch.empty_like(x)  # [n, dim]
    rc = _lib.require().fs_rmsnorm(x.data_ptr(), w.data_ptr(), n, dim, ctypes.c_float(eps), out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"fs_rmsnorm failed ({rc})")
    return out
