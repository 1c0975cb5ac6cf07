"""Choosing an engine (``get_engine``) and loading a shard or a whole model with its tokenizer on it: the one place
callers outside model/ go to get a target."""

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
from .engine import Engine, Shard
from .native_shard import NativeEngine
from .tokenizer import Tokenizer
from .torch_shard import TorchEngine
from .weights import GGUFSource, SafetensorsSource, WeightSource, model_fingerprint, open_source

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


def get_engine(choice: str | None = None, dtype: torch.dtype = torch.float32, *, quantize: str | None = None
               ) -> Engine:
    """The engine for ``choice`` (``auto``, ``native`` or ``torch``; None: FLOWSPEC_ENGINE, else auto) computing
    in ``dtype``. ``auto`` takes the native engine for float32 where it runs here, else the torch engine; ``native``
    insists (ConfigError when it cannot run: another dtype, or no built engine). ``quantize``: what the native
    engine quantizes float checkpoints to at load."""
    choice = choice or env.engine()
    if choice not in env.ENGINES:
        raise ConfigError(f"engine: one of {', '.join(env.ENGINES)}, not {choice!r}")
    if choice == "torch":
        return TorchEngine(dtype)
    if dtype != torch.float32:
        if choice == "native":
            raise ConfigError(f"the native engine computes in float32, not {dtype}")
        return TorchEngine(dtype)
    if not native_shard.available():
        if choice == "native":
            raise ConfigError("the native engine is unavailable here (see the warning above: it needs a C compiler); "
                              "use --engine auto or torch to run on the torch engine")
        return TorchEngine(dtype)
    return NativeEngine(quantize)


def load_shard(source: WeightSource, layers: LayerRange, *, embed: bool, head: bool, lm_head: bool | None = None,
               engine: Engine | str | None = None, dtype: torch.dtype = torch.float32, quantize: str | None = None,
               donors: Sequence[Shard] = (), progress: bool = True) -> Shard:
    """A shard of ``source`` on ``engine`` (an Engine, or a choice for ``get_engine``). Where the choice was
    ``auto`` and the native engine cannot run this model, it runs on the torch engine (logged). ``donors``:
    shards of the same model whose tensors may be shared."""
    if engine is None or isinstance(engine, str):
        auto = (engine or env.engine()) == "auto"
        eng = get_engine(engine, dtype, quantize=quantize)
    else:
        auto, eng = False, engine
    try:
        return eng.load(source, layers, embed=embed, head=head, lm_head=lm_head, donors=donors, progress=progress)
    except UnsupportedModel as e:
        if eng.name == "torch" or not auto:
            raise
        log.warning("%s; this model runs on the torch engine", e)
    return TorchEngine(dtype).load(source, layers, embed=embed, head=head, lm_head=lm_head, donors=donors,
                                   progress=progress)


def load_model(
    path: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    layers: LayerRange | None = None,
    tokenizer: bool = True,
    engine: Engine | str | None = None,
    quantize: str | None = None,
) -> LoadedModel:
    """Open ``path`` (default: the packaged SmolLM2 GGUF) and materialise the whole model, or ``layers`` of it, on
    ``engine`` (see load_shard)."""
    t0 = time.perf_counter()
    source = open_source(path)
    cfg = source.config
    rng = layers or LayerRange(start=0, end=cfg.num_layers)
    # the tokenizer first: what its loading leaves free goes back to the OS before the weights arrive
    tok = Tokenizer.load(source.path, cfg.eos_token_ids) if tokenizer else None
    release_heap()
    shard = load_shard(source, rng, embed=True, head=True, dtype=dtype, engine=engine, quantize=quantize)
    release_heap()
    log.info("loaded %s (%s, %d layers, %s engine) in %.1f s", source.path.name, cfg.arch, len(rng),
             shard.engine.describe(), time.perf_counter() - t0)
    return LoadedModel(source, shard, tok)  # type: ignore[arg-type]
