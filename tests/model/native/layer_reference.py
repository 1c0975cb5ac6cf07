"""A tiny random Llama/qwen2-style model for the layer-stack tests, and a straightforward float64 torch reference
of the same layer math (activations quantized as the engine does, for the integer weight types)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from flowspec_p2p.model.native import LayerSpec, LayerStack, QMatrix
from flowspec_p2p.model.native.formats import TYPES

from .reference import dequant_act, gguf_dequant, random_gguf

NAMES = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass
class TinyModel:
    hidden: int = 64
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 96
    n_layers: int = 2
    eps: float = 1e-5
    types: dict[str, str] = field(default_factory=lambda: dict.fromkeys(NAMES, "F32"))
    bias: bool = False
    attn_norm: bool = True
    seed: int = 0
    window: int | None = None  # a sliding window on every layer (the ISA tests; reference_forward has none)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        qd, kvd = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        shapes = {"q": (qd, self.hidden), "k": (kvd, self.hidden), "v": (kvd, self.hidden), "o": (self.hidden, qd),
                  "gate": (self.intermediate, self.hidden), "up": (self.intermediate, self.hidden),
                  "down": (self.hidden, self.intermediate)}
        self.layers = []  # per layer: {name: (QMatrix, float64 weight)} plus norms and biases (float32 tensors)
        self.raw = []  # per layer: {name: GGUF bytes}
        for _ in range(self.n_layers):
            layer, raws = {}, {}
            for name, (r, c) in shapes.items():
                raw = raws[name] = random_gguf(self.types[name], r, c, rng, scale=1.0 / np.sqrt(c))
                w64 = torch.from_numpy(gguf_dequant(self.types[name], raw, r, c).astype(np.float64))
                layer[name] = (QMatrix.from_gguf_bytes(self.types[name], r, c, raw), w64)
            layer["attn_norm"] = (torch.from_numpy(rng.uniform(0.5, 1.5, self.hidden).astype(np.float32))
                                  if self.attn_norm else None)
            layer["mlp_norm"] = torch.from_numpy(rng.uniform(0.5, 1.5, self.hidden).astype(np.float32))
            for name, size in (("q_bias", qd), ("k_bias", kvd), ("v_bias", kvd)):
                layer[name] = (torch.from_numpy((rng.standard_normal(size) * 0.1).astype(np.float32))
                               if self.bias else None)
            self.layers.append(layer)
            self.raw.append(raws)

    def stack(self) -> LayerStack:
        specs = [LayerSpec(*(lay[n][0] for n in NAMES), mlp_norm=lay["mlp_norm"], attn_norm=lay["attn_norm"],
                           q_bias=lay["q_bias"], k_bias=lay["k_bias"], v_bias=lay["v_bias"], window=self.window)
                 for lay in self.layers]
        return LayerStack(specs, hidden=self.hidden, q_heads=self.q_heads, kv_heads=self.kv_heads,
                          head_dim=self.head_dim, intermediate=self.intermediate, eps=self.eps)


def rope_tables(max_pos: int, head_dim: int, theta: float = 1e5) -> tuple[torch.Tensor, torch.Tensor]:
    """HF Llama's cos / sin [max_pos, head_dim] float32."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().contiguous(), emb.sin().contiguous()


def _rmsnorm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    if w is None:
        return x
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # x [n, heads, hd]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rot * sin[:, None]


def reference_forward(m: TinyModel, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x [n, hidden] at positions pos [n], attending under mask [n, n] (bool, True = visible, over the same n
    rows: a reference of the whole sequence at once) -> x after the layers, float64."""
    cos, sin = (t.double()[pos] for t in rope_tables(int(pos.max()) + 1, m.head_dim))
    x = x.double()
    n, hd, group = x.shape[0], m.head_dim, m.q_heads // m.kv_heads

    def mm(name, layer, h):
        w = layer[name][1]
        if not TYPES[m.types[name]].is_float:
            h = torch.from_numpy(dequant_act(h.to(torch.float32).numpy()))
        return h @ w.T

    def bias(layer, name):
        b = layer[name]
        return 0.0 if b is None else b.double()

    for layer in m.layers:
        h = _rmsnorm(x, layer["attn_norm"], m.eps)
        q = (mm("q", layer, h) + bias(layer, "q_bias")).view(n, m.q_heads, hd)
        k = (mm("k", layer, h) + bias(layer, "k_bias")).view(n, m.kv_heads, hd)
        v = (mm("v", layer, h) + bias(layer, "v_bias")).view(n, m.kv_heads, hd)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        scores = scores.masked_fill(~mask[None], float("-inf"))
        att = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v).reshape(n, -1)
        x = x + mm("o", layer, att)
        h = _rmsnorm(x, layer["mlp_norm"], m.eps)
        g, u = mm("gate", layer, h), mm("up", layer, h)
        x = x + mm("down", layer, torch.nn.functional.silu(g) * u)
    return x
