"""Loading a whole model (or a role's slice) with its tokenizer: the one place callers go to get a target."""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import env
from ..errors import ConfigError, UnsupportedModel
from ..types import LayerRange
from . import native_shard
from .native_shard import NativeShard
from .shard import Shard
from .tokenizer import Tokenizer
from .weights import GGUFSource, SafetensorsSource, WeightSource, model_fingerprint, open_source

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    source: GGUFSource | SafetensorsSource
    shard: Shard | NativeShard
    tokenizer: Tokenizer

    @property
    def path(self) -> Path:
        return self.source.path

    def fingerprint(self) -> str:
        return model_fingerprint(self.source)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to trim
        return None


def release_heap() -> None:
    """Give the C heap's free memory back to the OS (glibc keeps freed blocks: a tokenizer's or a load's
    temporaries would otherwise stay in the resident set)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def set_threads(n: int | None) -> int:
    """Compute threads for torch and the native engine: ``n``, or this device's physical cores. -> the count."""
    n = n or env.physical_cores()
    torch.set_num_threads(n)
    native_shard.set_threads(n)
    return n


def use_native(dtype: torch.dtype, engine: str | None = None) -> bool:
    """Whether shards in ``dtype`` run on the native engine: ``engine`` (default FLOWSPEC_ENGINE) "auto" picks it
    for float32 where it runs here; "native" insists (ConfigError if it can't); "torch" never."""
    engine = engine or env.engine()
    if engine == "torch":
        return False
    if dtype != torch.float32:
        if engine == "native":
            raise ConfigError(f"the native engine computes in float32, not {dtype}")
        return False
    ok = native_shard.available()
    if not ok and engine == "native":
        raise ConfigError("the native engine is unavailable here (see the warning above: it needs a C compiler); "
                          f"unset {env.ENGINE} to fall back to the torch engine")
    return ok


def load_shard(source: WeightSource, layers: LayerRange, *, embed: bool, head: bool, lm_head: bool | None = None,
               dtype: torch.dtype = torch.float32, engine: str | None = None, quantize: str | None = None,
               donors: Sequence[Shard | NativeShard] = ()) -> Shard | NativeShard:
    """A shard of ``source`` on the engine ``use_native`` picks (the torch engine loads the LM head whenever
    ``head``). ``donors``: shards of the same model whose layers may be shared (the native engine, which shows a
    progress bar on stderr while it packs)."""
    if use_native(dtype, engine):
        native_donors = [d for d in donors if isinstance(d, NativeShard)]
        try:
            return NativeShard.from_source(source, layers, embed=embed, head=head, lm_head=lm_head,
                                           quantize=quantize, donors=native_donors, progress=True)
        except UnsupportedModel as e:
            if (engine or env.engine()) == "native":
                raise
            log.warning("%s; this model runs on the torch engine", e)
    return Shard.from_source(source, layers, embed=embed, head=head, dtype=dtype).eval()


def load_model(
    path: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    layers: LayerRange | None = None,
    tokenizer: bool = True,
    engine: str | None = None,
    quantize: str | None = None,
) -> LoadedModel:
    """Open ``path`` (default: the packaged SmolLM2 GGUF) and materialise the whole model, or ``layers`` of it, on
    the engine ``use_native`` picks."""
    t0 = time.perf_counter()
    source = open_source(path)
    cfg = source.config
    rng = layers or LayerRange(start=0, end=cfg.num_layers)
    # the tokenizer first: what its loading leaves free goes back to the OS before the weights arrive
    tok = Tokenizer.load(source.path, cfg.eos_token_ids) if tokenizer else None
    release_heap()
    shard = load_shard(source, rng, embed=True, head=True, dtype=dtype, engine=engine, quantize=quantize)
    release_heap()
    log.info("loaded %s (%s, %d layers, %s, %s engine) in %.1f s", source.path.name, cfg.arch, len(rng), dtype,
             "native" if isinstance(shard, NativeShard) else "torch", time.perf_counter() - t0)
    return LoadedModel(source, shard, tok)  # type: ignore[arg-type]
