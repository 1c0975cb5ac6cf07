"""The EAGLE draft head (draft_head.py) on the native engine, the native engine's DraftNet (engine.py): its fc and
decoder block quantized to Q8_0 at load and run by the engine's kernels, so drafting costs a few native calls per
level instead of torch ops, and the head takes a quarter of the memory of its float32 torch twin. Same inputs and
outputs as ``DraftHead``:

    h     = fc([embed(x_t+1) ; f_t])      [n, 2H] @ [H, 2H]^T + bias   (Q8_0 weights, float32 activations)
    f^t+1 = block(h)                      one LayerStack layer, no input norm, its own one-layer KV cache
"""

from __future__ import annotations

import torch

from . import native
from .arch import ModelConfig
from .blocks import Rotary
from .kv_cache import KVCache
from .native.qmatrix import Q8_0_BLOCK

ROTARY_CHUNK = 1024  # positions the rotary tables grow by


def _f16(w: torch.Tensor) -> native.QMatrix:
    """w [rows, cols] (out, in) -> an F16 matrix."""
    w16 = w.detach().to(torch.float16).contiguous()
    return native.QMatrix.from_gguf_bytes("F16", w16.shape[0], w16.shape[1], w16.view(torch.uint8).reshape(-1))


def _q8_0(w: torch.Tensor) -> native.QMatrix:
    """w [rows, cols] (out, in) -> Q8_0 (a draft needs no exact weights: on the shipped head it agrees with the
    target exactly as often as F16 does, and a head forward reads half the bytes: 0.53 against 0.73 ms for 4
    rows), or F16 where the columns do not make whole 32-value blocks."""
    if w.shape[1] % Q8_0_BLOCK:
        return _f16(w)
    return native.quantize_q8_0(w.detach())


class NativeDraftHead:
    """A trained DraftHead's weights on the engine. ``__call__`` as DraftHead.forward (float32)."""

    dtype = torch.float32

    def __init__(self, cfg: ModelConfig, state: dict[str, torch.Tensor], max_position: int = 4096,
                 weights: str = "Q8_0"):
        """``state``: DraftHead's state_dict (any float dtype; the block's matrices stored [in, out]); ``weights``:
        Q8_0 (the default) or F16, the type the matrices are kept in."""
        if weights not in ("Q8_0", "F16"):
            raise ValueError(f"weights: Q8_0 or F16, not {weights!r}")
        _matrix = _q8_0 if weights == "Q8_0" else _f16
        self.cfg = cfg  # the target's; the block is a plain Llama block whatever its family, as DraftHead's
        self.max_position = max_position
        q, kv = cfg.q_dim, cfg.kv_dim
        wqkv = state["block.wqkv"].t()  # [q + 2 kv, hidden]
        w13 = state["block.w13"].t()  # [2 inter, hidden]
        inter = cfg.intermediate_size
        bias = {}
        if "block.bqkv" in state:
            b = state["block.bqkv"].float()
            bias = {"q_bias": b[:q], "k_bias": b[q : q + kv], "v_bias": b[q + kv :]}
        spec = native.LayerSpec(q=_matrix(wqkv[:q]), k=_matrix(wqkv[q : q + kv]), v=_matrix(wqkv[q + kv :]),
                                o=_matrix(state["block.wo"].t()), gate=_matrix(w13[:inter]), up=_matrix(w13[inter:]),
                                down=_matrix(state["block.w2"].t()), mlp_norm=state["block.mlp_norm.weight"].float(),
                                attn_norm=None, **bias)
        self.spec = spec
        self.stack = native.LayerStack([spec], hidden=cfg.hidden_size, q_heads=cfg.num_heads,
                                       kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, intermediate=inter,
                                       eps=cfg.rms_eps)
        self.fc = _matrix(state["fc.weight"])  # [hidden, 2 hidden]
        self.fc_bias = state["fc.bias"].float().contiguous()  # [hidden]
        self.rotary = Rotary(cfg.plain(), min(max_position, ROTARY_CHUNK), torch.float32)

    @property
    def nbytes(self) -> int:
        """Bytes of its packed matrices and float32 vectors."""
        mats = sum(getattr(self.spec, n).nbytes for n in ("q", "k", "v", "o", "gate", "up", "down"))
        vecs = sum(t.numel() * 4 for t in (self.spec.mlp_norm, self.spec.q_bias, self.spec.k_bias, self.spec.v_bias,
                                           self.fc_bias) if t is not None)
        return mats + self.fc.nbytes + vecs

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        assert batch == 1, "the native engine runs one request's rows"
        c = self.cfg
        return KVCache(1, c.num_kv_heads, c.head_dim, capacity, dtype=torch.float32)

    def __call__(
        self,
        features: torch.Tensor,  # [1, n, hidden]  f_t (target features, or the head's own predictions)
        next_embeds: torch.Tensor,  # [1, n, hidden]  embed(x_t+1)
        positions: torch.Tensor,  # [1, n]  t
        cache: KVCache | None = None,
        mask: torch.Tensor | None = None,  # [1, n, cache.length + n] bool, or None (causal)
    ) -> torch.Tensor:
        """-> predicted features f^_t+1 [1, n, hidden]. Appends to ``cache``."""
        n = features.shape[1]
        pair = torch.cat([next_embeds, features], dim=-1).reshape(n, -1).to(torch.float32)  # [n, 2 hidden]
        x = self.fc.matmul(pair).add_(self.fc_bias)  # [n, hidden], the residual stream the layer updates
        cache = cache if cache is not None else self.new_cache(n)
        start = cache.reserve(n)
        pos = positions.reshape(n)
        top = int(pos.max()) + 1 if n else 0
        if top > self.rotary.cos.shape[0]:
            size = min(max(self.max_position, top), -(-top // ROTARY_CHUNK) * ROTARY_CHUNK)
            self.rotary = Rotary(self.cfg.plain(), size, torch.float32)
        self.stack.forward(x, pos, self.rotary.cos, self.rotary.sin, cache.k[:, 0], cache.v[:, 0], start,
                           None if mask is None else mask[0])
        cache.advance(n)
        return x[None]
