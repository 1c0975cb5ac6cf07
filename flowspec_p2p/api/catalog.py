"""What the leader serves, described once for every route that lists or shows it (``/v1/models``, Ollama's
``/api/tags``, ``/api/show``, ``/api/ps``): the model under each of its names (the one it was started by first, then
the registry's other names for the same file), its format, family, size and quantization, and its context."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from gguf import LlamaFileType

from ..decoding.leader import Leader
from ..model.arch import ModelConfig


@dataclass(frozen=True)
class ServedModel:
    """The served model, as the listing routes show it."""

    names: tuple[str, ...]  # the first is the model's id in replies
    family: str  # the architecture (llama, qwen2, ...)
    context_length: int  # the leader's context limit per request
    format: str = "gguf"
    parameters: int = 0
    quantization: str = ""  # GGUF's file type (Q4_1, Q4_K_M, F16, ...); "" when unknown
    size: int = 0  # bytes of the file(s)
    digest: str = ""  # the model's fingerprint (weights.model_fingerprint)
    modified_at: float = 0.0  # the file's mtime
    template: str = ""  # the chat template's source
    info: dict = field(default_factory=dict)  # GGUF-style keys for /api/show's model_info

    @property
    def name(self) -> str:
        return self.names[0]

    def modified_iso(self) -> str:
        return datetime.datetime.fromtimestamp(self.modified_at, datetime.UTC).isoformat().replace("+00:00", "Z")

    def parameter_size(self) -> str:
        n = self.parameters
        for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if n >= scale:
                return f"{n / scale:.1f}".removesuffix(".0") + unit
        return str(n)


def parameter_count(cfg: ModelConfig) -> int:
    """Weights of the decoder: the embedding, every block, the final norm, an untied LM head."""
    embed = cfg.vocab_size * cfg.hidden_size
    return embed * (1 if cfg.tie_embeddings else 2) + cfg.num_layers * cfg.layer_params() + cfg.hidden_size


def _model_info(cfg: ModelConfig, context: int, parameters: int) -> dict:
    a = cfg.arch
    return {"general.architecture": a, "general.parameter_count": parameters, f"{a}.context_length": context,
            f"{a}.embedding_length": cfg.hidden_size, f"{a}.block_count": cfg.num_layers,
            f"{a}.feed_forward_length": cfg.intermediate_size, f"{a}.attention.head_count": cfg.num_heads,
            f"{a}.attention.head_count_kv": cfg.num_kv_heads, f"{a}.rope.freq_base": cfg.rope_theta,
            f"{a}.vocab_size": cfg.vocab_size}


def _quantization(metadata: dict) -> str:
    value = metadata.get("general.file_type")
    try:
        return LlamaFileType(int(value)).name.removeprefix("MOSTLY_") if value is not None else ""
    except ValueError:
        return ""


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _template(tokenizer) -> str:
    return getattr(tokenizer, "template_source", None) or ""  # tokenizers without a chat template have none


def served_model(source, names: list[str], *, context: int, digest: str = "", tokenizer=None) -> ServedModel:
    """The description of ``source`` (a weights.WeightSource) served under ``names`` with ``tokenizer``."""
    cfg, path = source.config, Path(source.path)
    params = parameter_count(cfg)
    gguf = path.suffix == ".gguf"
    return ServedModel(names=tuple(dict.fromkeys(names)), family=cfg.arch, context_length=context,
                       format="gguf" if gguf else "safetensors", parameters=params,
                       quantization=_quantization(getattr(source, "metadata", {})) if gguf else "",
                       size=_size(path), digest=digest, modified_at=path.stat().st_mtime, template=_template(tokenizer),
                       info=_model_info(cfg, context, params))


def default_served(leader: Leader) -> ServedModel:
    """What a leader serves when nobody described it (tests, the in-process ring): its id, config and context."""
    cfg = leader.head.cfg
    params = parameter_count(cfg)
    return ServedModel(names=(leader.model_id,), family=cfg.arch, context_length=leader.settings.max_context,
                       parameters=params, template=_template(leader.tokenizer),
                       info=_model_info(cfg, leader.settings.max_context, params))


SERVED = web.AppKey("served", ServedModel)  # the app's ServedModel (create_app sets it)
