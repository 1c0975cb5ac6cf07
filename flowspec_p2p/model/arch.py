"""Architecture description of a Llama-family decoder, read from a HF ``config.json`` or GGUF metadata.

One frozen ``ModelConfig`` describes every supported checkpoint; the differences between the families are
flags on it, never separate code paths:

    llama    RMSNorm, SwiGLU MLP, rotary embeddings (optionally scaled: linear or llama3), GQA
    mistral  = llama (+ an optional sliding window, which we reject beyond the cache size)
    qwen2    = llama + bias on the q/k/v projections
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from ..errors import UnsupportedModel
from ..types import LayerRange

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


# ------------------------------------------------------------------------- canonical tensor names


def layer_tensor_names(cfg: ModelConfig, layer: int) -> list[str]:
    p = f"model.layers.{layer}."
    names = [
        p + "input_layernorm.weight",
        p + "self_attn.q_proj.weight",
        p + "self_attn.k_proj.weight",
        p + "self_attn.v_proj.weight",
        p + "self_attn.o_proj.weight",
        p + "post_attention_layernorm.weight",
        p + "mlp.gate_proj.weight",
        p + "mlp.up_proj.weight",
        p + "mlp.down_proj.weight",
    ]
    if cfg.attention_bias:
        names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
    return names


EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
HEAD = "lm_head.weight"
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's baked llama3 rope factors (GGUF only)


def shard_tensor_names(cfg: ModelConfig, layers: LayerRange, *, embed: bool, head: bool) -> list[str]:
    """Canonical names a shard needs. ``head`` means final norm + LM head (the tied embedding if tied)."""
    names: list[str] = []
    if embed:
        names.append(EMBED)
    for i in layers.indices():
        names += layer_tensor_names(cfg, i)
    if head:
        names += [NORM, EMBED if cfg.tie_embeddings else HEAD]
    return list(dict.fromkeys(names))
