"""Architecture description of a Llama-family decoder, read from a HF ``config.json`` or GGUF metadata.

One frozen ``ModelConfig`` describes every supported checkpoint; the differences between the families are
flags on it, never separate code paths:

    llama    RMSNorm, SwiGLU MLP, rotary embeddings (optionally scaled: linear or llama3), GQA
    mistral  = llama (+ an optional sliding window, which we reject beyond the cache size)
    qwen2    = llama + bias on the q/k/v projections
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict

from ..errors import UnsupportedModel

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


class RopeScaling(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


class ModelConfig(BaseModel):
    """Shape and numerics of a Llama-family decoder. Field names follow the paper-neutral HF vocabulary."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    arch: Literal["llama", "mistral", "qwen2"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False
    tie_embeddings: bool = True
    max_position: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_params(self) -> int:
        """Parameters in one decoder block (weights only, norms included)."""
        h = self.hidden_size
        attn = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h
        if self.attention_bias:
            attn += self.q_dim + 2 * self.kv_dim
        mlp = 3 * h * self.intermediate_size
        return attn + mlp + 2 * h

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """K and V bytes one token costs in one layer."""
        return 2 * self.kv_dim * dtype_bytes


def _check_arch(arch: str) -> str:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModel(
            f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)} "
            "(Llama family: SmolLM2, TinyLlama, Llama 2/3, Qwen2/2.5, Mistral)"
        )
    return arch


def _eos_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 writes `rope_parameters`; older configs write `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or params)
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=float(scaling["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            kind="llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position=int(scaling.get("original_max_position_embeddings", 8192)),
        )
    raise UnsupportedModel(f"rope scaling {kind!r} is not supported; supported: default, linear, llama3")


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from the dict of a HF ``config.json``."""
    arch = _check_arch(str(cfg.get("model_type", "?")))
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    theta, scaling = _rope_from_hf(cfg)
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "mistral") else None
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    if window is not None and int(window) < max_pos:
        max_pos = int(window)  # attention beyond the window would differ from full attention: cap the context
    return ModelConfig(
        arch=arch,  # type: ignore[arg-type]
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position=max_pos,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_tuple(cfg.get("eos_token_id")),
    )


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata (``general.architecture`` and ``{arch}.*`` keys)."""
    arch = str(meta.get("general.architecture", "?"))
    name = str(meta.get("general.name", "")).lower()
    if arch == "llama" and "mistral" in name:
        arch = "mistral"
    _check_arch(arch)
    key = "llama" if arch == "mistral" else arch

    def get(field: str, default: Any = None) -> Any:
        return meta.get(f"{key}.{field}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size")
    if vocab is None:
        vocab = meta["tokenizer.ggml.tokens.count"] if "tokenizer.ggml.tokens.count" in meta \
            else len(meta["tokenizer.ggml.tokens"])
    scaling = None
    kind = get("rope.scaling.type")
    if kind == "linear":
        scaling = RopeScaling(kind="linear", factor=float(get("rope.scaling.factor")))
    elif kind not in (None, "none"):
        raise UnsupportedModel(f"GGUF rope scaling {kind!r} is not supported; supported: none, linear, llama3")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        arch=arch,  # type: ignore[arg-type]
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        tie_embeddings="output.weight" not in tensor_names,
        max_position=int(get("context_length", 2048)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_tuple(eos),
    )


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
