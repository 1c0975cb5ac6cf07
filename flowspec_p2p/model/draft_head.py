"""The EAGLE draft head's network (EAGLE-1/2 design, arXiv 2401.15077 §4; speculative-decoding-notes §1.1), in
torch: the trainable module and the torch engine's DraftNet (engine.py). The native engine runs the same weights
with its own kernels (native_draft.py); the draft head's file format and the drafters are speculative/'s.

    h     = fc([embed(x_t+1) ; f_t])                 fc: 2H -> H (bias)
    f^t+1 = DecoderBlock(h)  (no input norm, as EAGLE's layer 0; the same block code as the target)

Positions: the pair at draft position t uses rotary position t. The head keeps its own one-layer KV cache.
"""

from __future__ import annotations

import torch
from torch import nn

from .arch import ModelConfig
from .blocks import DecoderBlock, Rotary
from .kv_cache import KVCache


class DraftHead(nn.Module):
    """The trainable part of the drafter: ``fc`` and one decoder block. Embedding and LM head are the target's."""

    def __init__(self, cfg: ModelConfig, max_position: int = 4096):
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg  # the target's config (DraftBundle records it); the network is a plain Llama block:
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.block = DecoderBlock(cfg.plain(), input_norm=False)  # whatever the target's family
        self.max_position = max_position
        self._rotary: Rotary | None = None
        self.reset_parameters()

    def reset_parameters(self, seed: int = 0, std: float = 0.02) -> DraftHead:
        """Random init for training: fc and the block's matrices ~ N(0, std), biases zero, norms one."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in (self.fc.weight, self.block.wqkv, self.block.wo, self.block.w13, self.block.w2):
                p.copy_(torch.randn(p.shape, generator=g) * std)
            for p in (self.fc.bias, self.block.bqkv):
                if p is not None:
                    p.zero_()
            self.block.mlp_norm.weight.fill_(1.0)
        return self

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def rotary(self) -> Rotary:
        dtype = self.dtype
        if self._rotary is None or self._rotary.cos.dtype != dtype:
            self._rotary = Rotary(self.cfg.plain(), self.max_position, dtype)
        return self._rotary

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        c = self.cfg
        return KVCache(1, c.num_kv_heads, c.head_dim, capacity, batch=batch, dtype=self.dtype)

    def forward(
        self,
        features: torch.Tensor,  # [batch, n, hidden]  f_t (target features, or the head's own predictions)
        next_embeds: torch.Tensor,  # [batch, n, hidden]  embed(x_t+1)
        positions: torch.Tensor,  # [batch, n]  t
        cache: KVCache | None = None,
        mask: torch.Tensor | None = None,  # [batch, n, cache.length + n] bool, or None (causal)
    ) -> torch.Tensor:
        """-> predicted features f^_t+1 [batch, n, hidden]. Appends to ``cache`` when given."""
        x = self.fc(torch.cat([next_embeds, features], dim=-1))
        _b, n, _ = x.shape
        cos, sin = self.rotary().gather(positions)
        start = 0 if cache is None else cache.reserve(n)
        attn_mask, causal = None, False
        if mask is not None:
            attn_mask = mask.unsqueeze(1)
        elif n > 1:
            if start == 0:
                causal = True
            else:
                attn_mask = torch.ones(n, start + n, dtype=torch.bool).tril(start)[None, None]
        out = self.block(x, cos, sin, None if cache is None else (cache, 0, start), attn_mask, causal)
        if cache is not None:
            cache.advance(n)
        return out
