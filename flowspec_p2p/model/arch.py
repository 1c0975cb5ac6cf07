"""Architecture description of a decoder-only transformer, read from a HF ``config.json`` or GGUF metadata.

One frozen ``ModelConfig`` describes every supported checkpoint; the differences between the families are
flags on it, never separate code paths:

    llama    RMSNorm, SwiGLU MLP, rotary embeddings (optionally scaled: linear or llama3), GQA
    mistral  = llama (+ an optional sliding window, which caps the context at the window)
    qwen2    = llama + bias on the q/k/v projections
    qwen3    = llama + QK-norm (an RMSNorm over each head's q and k before the rotary embedding)
    gemma3   = QK-norm + four norms per block (pre/post attention, pre/post MLP), GeGLU MLP (tanh GELU), embeddings
               scaled by sqrt(hidden), attention scaled by query_pre_attn_scalar^-1/2, norm weights stored as offsets
               from one (HF; GGUF stores 1 + w), interleaved sliding-window / global layers with their own rotary
               bases, optional final logit soft-capping
    phi3     = llama with fused q|k|v and gate|up matrices (split by rows when read), LongRoPE scaling (per-position
               short/long factors), an optional sliding window on every layer

Sliding windows are honoured: a windowed layer's query sees the last ``sliding_window`` keys of its path (its own
position and the window - 1 before it), which equals transformers' ``kv_pos > q_pos - window`` on every path a
decoding mode builds (a node always sees exactly one key per position 0..its own).
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from ..errors import UnsupportedModel
from ..types import LayerRange

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3")
_HF_MODEL_TYPES = {"gemma3_text": "gemma3"}  # HF model_type -> our arch, where they differ


class RopeScaling(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


class LongRope(BaseModel):
    """Phi-3's LongRoPE: inverse frequencies divided by ``short_factor`` for positions below
    ``original_max_position``, by ``long_factor`` from there on, cos/sin scaled by ``attention_factor``. (transformers
    switches every position to the long factors once a forward reaches the original length; decoding one token at a
    time that is this per-position rule, which stays the same whatever the chunking.)"""

    model_config = ConfigDict(frozen=True, extra="forbid")

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position: int
    attention_factor: float = 1.0


# Fields added after fingerprints were first published: left out of canonical_json while at their defaults, so a
# Llama/Qwen2/Mistral model keeps the fingerprint its draft heads were trained for.
_LATER_FIELDS = {"qk_norm": False, "sandwich_norms": False, "norm_offset": False, "activation": "silu",
                 "embed_scale": None, "attn_scale": None, "final_softcap": None, "sliding_window": None,
                 "sliding_layers": (), "rope_local_theta": None, "longrope": None}


class ModelConfig(BaseModel):
    """Shape and numerics of a decoder. Field names follow the paper-neutral HF vocabulary."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    arch: Literal["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"]
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
    qk_norm: bool = False  # an RMSNorm [head_dim] over each head's q and k before the rotary embedding
    sandwich_norms: bool = False  # norms after the attention and after the MLP too (Gemma)
    norm_offset: bool = False  # norms multiply by 1 + w, in float32 (Gemma; HF stores w, GGUF 1 + w: load_tensor)
    activation: Literal["silu", "gelu_tanh"] = "silu"  # of the gated MLP: act(gate) * up
    embed_scale: float | None = None  # the embedding rows are multiplied by this (Gemma: sqrt(hidden))
    attn_scale: float | None = None  # softmax scale of q.k; None: 1 / sqrt(head_dim)
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    sliding_window: int | None = None  # keys a windowed layer's query sees (its own included)
    sliding_layers: tuple[int, ...] = ()  # the windowed layers
    rope_local_theta: float | None = None  # rotary base of the windowed layers (None: rope_theta, unscaled too)
    longrope: LongRope | None = None

    def canonical_json(self) -> str:
        d = self.model_dump(mode="json")
        for name, default in _LATER_FIELDS.items():
            if d[name] == (list(default) if isinstance(default, tuple) else default):
                del d[name]
        return json.dumps(d, sort_keys=True)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: it attends to the whole context)."""
        return self.sliding_window if layer in self.sliding_layers else None

    def local_rope(self, layer: int) -> bool:
        """Whether ``layer`` uses the local rotary tables (rope_local_theta, no scaling)."""
        return self.rope_local_theta is not None and layer in self.sliding_layers

    def layer_params(self) -> int:
        """Parameters in one decoder block (weights only, norms included)."""
        h = self.hidden_size
        attn = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h
        if self.attention_bias:
            attn += self.q_dim + 2 * self.kv_dim
        mlp = 3 * h * self.intermediate_size
        norms = (4 if self.sandwich_norms else 2) * h + (2 * self.head_dim if self.qk_norm else 0)
        return attn + mlp + norms

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """K and V bytes one token costs in one layer."""
        return 2 * self.kv_dim * dtype_bytes

    def plain(self) -> ModelConfig:
        """The same shapes as a plain Llama block, q/k/v biases kept (what an EAGLE draft head for this model is built
        as: its own network, fed the target's scaled embeddings and features)."""
        return self.model_copy(update=_LATER_FIELDS)


def _check_arch(arch: str) -> str:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModel(
            f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)} "
            "(SmolLM2, TinyLlama, Llama 2/3.x, Qwen2/2.5, Qwen3, Mistral, Gemma 3, Phi-3/3.5/4-mini)"
        )
    return arch


def _eos_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_scaling(scaling: dict[str, Any]) -> RopeScaling | None:
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(scaling["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position=int(scaling.get("original_max_position_embeddings", 8192)),
        )
    raise UnsupportedModel(f"rope scaling {kind!r} is not supported; supported: default, linear, llama3, longrope")


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None, dict[str, Any]]:
    """-> (theta, scaling, the rope parameters dict) of the model's (global) layers. transformers >= 5 writes
    `rope_parameters` (per layer type for Gemma 3); older configs write `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    if "full_attention" in params:
        params = dict(params["full_attention"] or {})
    scaling = dict(cfg.get("rope_scaling") or params)
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
        return theta, None, scaling
    return theta, _rope_scaling(scaling), scaling


def _longrope_attention_factor(max_position: int, original: int) -> float:
    """transformers' (and llama.cpp's) default: sqrt(1 + ln(scale) / ln(original)), 1 when not extended."""
    scale = max_position / original
    return 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))


def _longrope_from_hf(cfg: dict[str, Any], params: dict[str, Any], max_pos: int) -> LongRope:
    original = int(params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                   or max_pos)
    factor = params.get("factor")
    factor = max_pos / original if factor is None else float(factor)
    attn = params.get("attention_factor")
    if attn is None:  # as transformers' _compute_longrope_parameters
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    # float32, as transformers uses them (its factors are a float32 tensor, the attention factor multiplies one)
    return LongRope(short_factor=tuple(_f32(x) for x in params["short_factor"]),
                    long_factor=tuple(_f32(x) for x in params["long_factor"]), original_max_position=original,
                    attention_factor=_f32(attn))


def _f32(x: float) -> float:
    """x rounded to float32."""
    return struct.unpack("<f", struct.pack("<f", float(x)))[0]


def _embed_scale(hidden: int) -> float:
    """sqrt(hidden) rounded to float32, as Gemma's embedding multiplies by it (a float32 buffer; llama.cpp too)."""
    return _f32(hidden**0.5)


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from the dict of a HF ``config.json``."""
    model_type = str(cfg.get("model_type", "?"))
    if model_type == "gemma3" and isinstance(cfg.get("text_config"), dict):
        raise UnsupportedModel("a multimodal Gemma 3 checkpoint (Gemma3ForConditionalGeneration): use its GGUF file or "
                               "a text-only (Gemma3ForCausalLM) checkpoint")
    arch = _check_arch(_HF_MODEL_TYPES.get(model_type, model_type))
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    theta, scaling, rope_params = _rope_from_hf(cfg)
    if float(rope_params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise UnsupportedModel("partial rotary embeddings (partial_rotary_factor < 1, e.g. Phi-4-mini) are not "
                               "supported yet")
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    extra: dict[str, Any] = {}
    if arch == "mistral":
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        if window is not None and int(window) < max_pos:
            max_pos = int(window)  # attention beyond the window would differ from full attention: cap the context
    elif arch == "phi3":
        if cfg.get("sliding_window"):
            extra |= {"sliding_window": int(cfg["sliding_window"]),
                      "sliding_layers": tuple(range(int(cfg["num_hidden_layers"])))}
        if rope_params.get("rope_type", rope_params.get("type")) in ("longrope", "su"):
            extra["longrope"] = _longrope_from_hf(cfg, rope_params, max_pos)
    elif arch == "qwen3":
        extra["qk_norm"] = True
        types = cfg.get("layer_types") or ()
        if cfg.get("use_sliding_window") and cfg.get("sliding_window") and "sliding_attention" in types:
            extra |= {"sliding_window": int(cfg["sliding_window"]),
                      "sliding_layers": tuple(i for i, t in enumerate(types) if t == "sliding_attention")}
    elif arch == "gemma3":
        extra |= _gemma3_from_hf(cfg, hidden)
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise UnsupportedModel(f"MLP activation {act!r} is not supported; supported: silu, gelu_pytorch_tanh")
    return ModelConfig(
        arch=arch,  # type: ignore[arg-type]
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", arch == "gemma3")),
        max_position=max_pos,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_tuple(cfg.get("eos_token_id")),
        activation="gelu_tanh" if act == "gelu_pytorch_tanh" else "silu",
        **extra,
    )


def _gemma3_from_hf(cfg: dict[str, Any], hidden: int) -> dict[str, Any]:
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % int(cfg.get("sliding_window_pattern", 6)) else "full_attention"
        for i in range(n)]
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise UnsupportedModel(f"Gemma 3 local rope scaling {local.get('rope_type')!r} is not supported")
    if cfg.get("attn_logit_softcapping") is not None:
        raise UnsupportedModel("attention logit soft-capping (Gemma 2) is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModel("bidirectional attention (an embedding model) is not a decoder")
    window = cfg.get("sliding_window")
    return {"qk_norm": True, "sandwich_norms": True, "norm_offset": True, "embed_scale": _embed_scale(hidden),
            "attn_scale": float(cfg.get("query_pre_attn_scalar", cfg.get("head_dim", 256))) ** -0.5,
            "final_softcap": cfg.get("final_logit_softcapping"),
            "sliding_window": int(window) if window else None,
            "sliding_layers": tuple(i for i, t in enumerate(types) if t == "sliding_attention") if window else (),
            "rope_local_theta": float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))}


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str], read=None) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata (``general.architecture`` and ``{arch}.*`` keys). ``read(name)``: a
    float tensor of the file by its GGUF name (Phi-3's LongRoPE factors are stored as tensors)."""
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
    head_dim = int(get("attention.key_length", hidden // heads))
    layers = int(get("block_count"))
    vocab = get("vocab_size")
    if vocab is None:
        vocab = meta["tokenizer.ggml.tokens.count"] if "tokenizer.ggml.tokens.count" in meta \
            else len(meta["tokenizer.ggml.tokens"])
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedModel("partial rotary embeddings (rope.dimension_count < head size, e.g. Phi-4-mini) are "
                               "not supported yet")
    scaling = None
    kind = get("rope.scaling.type")
    if kind == "linear":
        scaling = RopeScaling(kind="linear", factor=float(get("rope.scaling.factor")))
    elif kind not in (None, "none"):
        raise UnsupportedModel(f"GGUF rope scaling {kind!r} is not supported; supported: none, linear, llama3")
    max_pos = int(get("context_length", 2048))
    extra: dict[str, Any] = {}
    if arch == "qwen3":
        extra["qk_norm"] = True
    elif arch == "gemma3":
        window = get("attention.sliding_window")
        # llama.cpp's Gemma 3: every 6th layer global, local rope base 10000, attention scale 1/sqrt(head_dim)
        # (query_pre_attn_scalar; hidden / heads for the 62-layer 27B), GELU-tanh
        scalar = hidden / heads if layers == 62 else head_dim
        extra |= {"qk_norm": True, "sandwich_norms": True, "norm_offset": True, "embed_scale": _embed_scale(hidden),
                  "attn_scale": float(scalar) ** -0.5, "final_softcap": get("final_logit_softcapping"),
                  "sliding_window": int(window) if window else None,
                  "sliding_layers": tuple(i for i in range(layers) if (i + 1) % 6) if window else (),
                  "rope_local_theta": 10000.0, "activation": "gelu_tanh"}
    elif arch == "phi3":
        if get("attention.sliding_window"):
            extra |= {"sliding_window": int(get("attention.sliding_window")), "sliding_layers": tuple(range(layers))}
        if "rope_factors_long.weight" in tensor_names:
            original = int(get("rope.scaling.original_context_length", max_pos))
            attn = get("rope.scaling.attn_factor")
            extra["longrope"] = LongRope(
                short_factor=tuple(float(x) for x in read("rope_factors_short.weight")),
                long_factor=tuple(float(x) for x in read("rope_factors_long.weight")), original_max_position=original,
                attention_factor=_f32(attn if attn is not None else _longrope_attention_factor(max_pos, original)))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        arch=arch,  # type: ignore[arg-type]
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        attention_bias="blk.0.attn_q.bias" in tensor_names or "blk.0.attn_qkv.bias" in tensor_names,
        tie_embeddings="output.weight" not in tensor_names,
        max_position=max_pos,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_tuple(eos),
        **extra,
    )


# ------------------------------------------------------------------------- canonical tensor names


def norm_names(cfg: ModelConfig) -> dict[str, str]:
    """A block's norms by role -> their canonical (HF) name suffix. Llama's pre-MLP norm is HF's
    ``post_attention_layernorm``; Gemma's is ``pre_feedforward_layernorm`` (its ``post_attention_layernorm`` is the
    norm after the attention)."""
    names = {"attn_norm": "input_layernorm.weight"}
    if cfg.sandwich_norms:
        names |= {"post_attn_norm": "post_attention_layernorm.weight", "mlp_norm": "pre_feedforward_layernorm.weight",
                  "post_mlp_norm": "post_feedforward_layernorm.weight"}
    else:
        names["mlp_norm"] = "post_attention_layernorm.weight"
    if cfg.qk_norm:
        names |= {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
    return names


def is_norm(name: str) -> bool:
    return name.endswith(("layernorm.weight", "norm.weight"))


def layer_tensor_names(cfg: ModelConfig, layer: int) -> list[str]:
    p = f"model.layers.{layer}."
    norms = norm_names(cfg)
    names = [p + norms["attn_norm"], *(p + f"self_attn.{x}_proj.weight" for x in "qkvo")]
    names += [p + norms[r] for r in ("q_norm", "k_norm", "post_attn_norm") if r in norms]
    names += [p + norms["mlp_norm"], *(p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down"))]
    names += [p + norms["post_mlp_norm"]] if "post_mlp_norm" in norms else []
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
