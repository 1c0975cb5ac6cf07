"""The torch building blocks of a decoder, the reference math every engine is checked against: RMSNorm, the rotary
tables (``rope_inv_freq``, ``Rotary``), the sliding-window mask (``window_mask``) and ``DecoderBlock`` (pre-norm GQA
attention + gated MLP, with each family's options from arch.ModelConfig). The
torch engine (torch_shard.py) and the EAGLE draft head (draft_head.py) are built from them; the native engine uses
``Rotary`` for its tables.

Numerics mirror transformers' eager Llama code (RMSNorm computed in float32, rotary tables computed in float32),
so a forward agrees with it to float rounding, in float32 and float64 alike.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .arch import ModelConfig, norm_names
from .kv_cache import KVCache


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the normalisation in float32. ``f32_product``: the product with the weight in float32
    too, then cast (Gemma's order; its weight is the multiplier 1 + w, see weights.load_tensor); else the normed x
    cast first (Llama's)."""

    def __init__(self, dim: int, eps: float, f32_product: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.f32_product = f32_product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        var = h.pow(2).sum(-1, keepdim=True).div_(h.shape[-1])  # = .mean(-1) bit for bit, dispatched faster
        h = h * torch.rsqrt(var.add_(self.eps))
        if self.f32_product:
            return (h * self.weight.float()).to(dtype)
        return self.weight * h.to(dtype)


def _default_inv_freq(theta: float, d: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))


def rope_inv_freq(cfg: ModelConfig, freq_factors: torch.Tensor | None = None, local: bool = False) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding. -> [head_dim // 2], float32

    Computed in float32 exactly as transformers does (whatever the model dtype), so that our logits agree
    with its forward to the last bit of the rotary tables. ``freq_factors`` is llama.cpp's
    ``rope_freqs.weight`` (llama3 scaling baked into a tensor), if the checkpoint has one. ``local``: the tables of
    the windowed layers (Gemma 3: their own base, unscaled). LongRoPE's two sets are ``Rotary``'s.
    """
    d = cfg.head_dim
    if local and cfg.rope_local_theta is not None:
        return _default_inv_freq(cfg.rope_local_theta, d)
    inv = _default_inv_freq(cfg.rope_theta, d)
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


def _longrope_inv_freq(cfg: ModelConfig, factors: tuple[float, ...]) -> torch.Tensor:
    """transformers' LongRoPE frequencies: 1 / (factor * theta^(2i/d)), float32."""
    d = cfg.head_dim
    shape = torch.arange(0, d, 2, dtype=torch.int64).float() / d
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * cfg.rope_theta**shape)


class Rotary:
    """Precomputed cos/sin tables (float32 math, stored in the model dtype). cos, sin: [max_pos, head_dim]

    ``local``: the windowed layers' tables (ModelConfig.local_rope). LongRoPE (Phi-3): rows below the original
    context use the short factors, the rest the long ones, all scaled by the attention factor."""

    def __init__(self, cfg: ModelConfig, max_pos: int, dtype: torch.dtype, freq_factors: torch.Tensor | None = None,
                 local: bool = False):
        pos = torch.arange(max_pos, dtype=torch.int64).float()[:, None]  # [max_pos, 1]
        lr = cfg.longrope if not local else None
        if lr is None:
            freqs = pos * rope_inv_freq(cfg, freq_factors, local)[None, :]  # [max_pos, head_dim/2]
        else:
            short, long = _longrope_inv_freq(cfg, lr.short_factor), _longrope_inv_freq(cfg, lr.long_factor)
            freqs = torch.where(pos < lr.original_max_position, pos * short[None, :], pos * long[None, :])
        emb = torch.cat((freqs, freqs), dim=-1)
        if lr is None:
            self.cos = emb.cos().to(dtype)
            self.sin = emb.sin().to(dtype)
        else:
            self.cos = (emb.cos() * lr.attention_factor).to(dtype)
            self.sin = (emb.sin() * lr.attention_factor).to(dtype)

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [batch, n] -> cos, sin: [batch, 1, n, head_dim]"""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def window_mask(mask: torch.Tensor, window: int) -> torch.Tensor:
    """``mask`` [..., kv_len] bool (True = visible) keeping only each row's last ``window`` visible keys: a sliding
    window over the row's path (ModelConfig's docstring)."""
    from_end = mask.flip(-1).cumsum(-1, dtype=torch.int32).flip(-1)  # visible keys at or after each slot
    return mask & (from_end <= window)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x.narrow(-1, half, half), x.narrow(-1, 0, half)), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., head_dim]; cos, sin broadcastable to x (e.g. x [batch, heads, n, head_dim] with cos, sin
    [batch, 1, n, head_dim], or x [batch, n, heads, head_dim] with cos, sin [batch, n, 1, head_dim])"""
    return x * cos + _rotate_half(x) * sin


class DecoderBlock(nn.Module):
    """Pre-norm attention (GQA, rotary, optional q/k/v bias, optional QK-norm) + gated MLP (SiLU or tanh-GELU),
    with Gemma's norms after the attention and the MLP where the config has them.

    Weights are stored fused (q|k|v and gate|up) and transposed to [in, out]: on a CPU, a matmul against a
    row-major [in, out] matrix streams the weights once and is 20-30% faster at the 1-16 rows decoding and
    tree verification use than ``F.linear`` against [out, in].
    """

    def __init__(self, cfg: ModelConfig, *, input_norm: bool = True):
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        f32 = cfg.norm_offset

        def norm(dim: int) -> RMSNorm:
            return RMSNorm(dim, cfg.rms_eps, f32)

        self.attn_norm = norm(h) if input_norm else nn.Identity()
        self.wqkv = nn.Parameter(torch.empty(h, cfg.q_dim + 2 * cfg.kv_dim))  # [in, out]
        self.bqkv = nn.Parameter(torch.zeros(cfg.q_dim + 2 * cfg.kv_dim)) if cfg.attention_bias else None
        self.q_norm = norm(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = norm(cfg.head_dim) if cfg.qk_norm else None
        self.wo = nn.Parameter(torch.empty(cfg.q_dim, h))
        self.post_attn_norm = norm(h) if cfg.sandwich_norms else None
        self.mlp_norm = norm(h)
        self.w13 = nn.Parameter(torch.empty(h, 2 * cfg.intermediate_size))
        self.w2 = nn.Parameter(torch.empty(cfg.intermediate_size, h))
        self.post_mlp_norm = norm(h) if cfg.sandwich_norms else None
        self.act = F.silu if cfg.activation == "silu" else functools.partial(F.gelu, approximate="tanh")

    def reset_parameters(self, std: float = 0.02) -> None:
        """Random init (draft-head training, tests)."""
        with torch.no_grad():
            for w in (self.wqkv, self.wo, self.w13, self.w2):
                w.normal_(0.0, std)
            if self.bqkv is not None:
                self.bqkv.zero_()

    def load_hf(self, t: Mapping[str, torch.Tensor], prefix: str) -> None:
        """Copy weights named like transformers' ``model.layers.{i}.`` (``prefix``) into the fused layout (norm
        weights as multipliers: weights.load_tensor)."""
        with torch.no_grad():
            for role, name in norm_names(self.cfg).items():
                module = getattr(self, role)
                if isinstance(module, RMSNorm):
                    module.weight.copy_(t[prefix + name])
            a = prefix + "self_attn."
            self.wqkv.copy_(torch.cat([t[a + f"{x}_proj.weight"] for x in "qkv"]).t())
            if self.bqkv is not None:
                self.bqkv.copy_(torch.cat([t[a + f"{x}_proj.bias"] for x in "qkv"]))
            self.wo.copy_(t[a + "o_proj.weight"].t())
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
        qkv = self.attn_norm(x) @ self.wqkv  # [b, n, (hq + 2 hk) hd]
        if self.bqkv is not None:
            qkv = qkv + self.bqkv
        # q and k rotated together, as [b, n, hq + hk, hd] (half the small ops of rotating each); narrow rather
        # than tuple indexing throughout: decoding one token is bound by per-op overhead outside the matmuls
        qk = qkv.narrow(-1, 0, cfg.q_dim + cfg.kv_dim).view(b, n, hq + hk, hd)
        if self.q_norm is not None:  # QK-norm: each head's q and k normed over head_dim, before the rotation
            qk = torch.cat([self.q_norm(qk.narrow(2, 0, hq)), self.k_norm(qk.narrow(2, hq, hk))], dim=2)
        qk = apply_rotary(qk, cos.transpose(1, 2), sin.transpose(1, 2))
        q = qk.narrow(2, 0, hq).transpose(1, 2)  # [b, hq, n, hd]
        k = qk.narrow(2, hq, hk).transpose(1, 2)  # [b, hk, n, hd]
        v = qkv.narrow(-1, cfg.q_dim + cfg.kv_dim, cfg.kv_dim).view(b, n, hk, hd).transpose(1, 2)  # [b, hk, n, hd]
        if kv is not None:
            cache, layer, start = kv
            k, v = cache.write(layer, start, k, v)  # [b, kv_heads, start + n, hd]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True,
                                           scale=cfg.attn_scale)
        o = o.transpose(1, 2).reshape(b, n, cfg.q_dim) @ self.wo
        x = x + (o if self.post_attn_norm is None else self.post_attn_norm(o))
        gate, up = (self.mlp_norm(x) @ self.w13).chunk(2, dim=-1)
        y = (self.act(gate) * up) @ self.w2
        return x + (y if self.post_mlp_norm is None else self.post_mlp_norm(y))
