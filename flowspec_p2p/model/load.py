"""Loading a whole model (or a role's slice) with its tokenizer: the one place callers go to get a target."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..types import LayerRange
from .shard import Shard
from .tokenizer import Tokenizer
from .weights import GGUFSource, SafetensorsSource, model_fingerprint, open_source

log = logging.getLogger(__name__)

@dataclass
class LoadedModel:
    source: GGUFSource | SafetensorsSource
    shard: Shard
    tokenizer: Tokenizer

    @property
    def path(self) -> Path:
        return self.source.path

    def fingerprint(self) -> str:
        return model_fingerprint(self.source)


def load_model(
    path: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    layers: LayerRange | None = None,
    tokenizer: bool = True,
) -> LoadedModel:
    """Open ``path`` (default: the packaged SmolLM2 GGUF) and materialise the whole model, or ``layers`` of it."""
    t0 = time.perf_counter()
    source = open_source(path)
    cfg = source.config
    rng = layers or LayerRange(start=0, end=cfg.num_layers)
    shard = Shard.from_source(source, rng, embed=True, head=True, dtype=dtype).eval()
    tok = Tokenizer.load(source.path, cfg.eos_token_ids) if tokenizer else None
    log.info("loaded %s (%s, %d layers, %s) in %.1f s", source.path.name, cfg.arch, len(rng), dtype,
             time.perf_counter() - t0)
    return LoadedModel(source, shard, tok)  # type: ignore[arg-type]
