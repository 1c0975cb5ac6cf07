"""The native CPU inference engine: quantized GGUF weights kept in their blocks, few-row matmuls whose cost
barely grows from 1 to 32 rows, and a fused decoder-layer stack (one C call per stage forward).

Glossary:
  panel        16 consecutive output rows of a weight matrix, packed so SIMD lanes are output rows.
  act block    32 consecutive activation columns quantized to int16 with one float32 scale.
  batch invariance  a row's result is bit-identical whether computed alone or among any other rows, on any
               thread count: what lets a draft tree be verified exactly against autoregressive decoding.

`library()` loads the library built into the package at install time (setup.py), or in a source checkout builds the
C sources on first use (into CACHE_DIR or the argument), self-tests it; it is None, with one logged warning, where
that fails (callers then keep torch). Everything else needs it.
"""

from __future__ import annotations

from . import _lib
from ._lib import library
from .formats import TYPES, WeightType, weight_type
from .layers import Group, LayerSpec, LayerStack, rmsnorm
from .qmatrix import QMatrix, WeightArena, q8_0_bytes, quantize_q8_0

__all__ = [
    "TYPES",
    "Group",
    "LayerSpec",
    "LayerStack",
    "QMatrix",
    "WeightArena",
    "WeightType",
    "available_isas",
    "isa",
    "library",
    "q8_0_bytes",
    "quantize_q8_0",
    "rmsnorm",
    "set_isa",
    "set_threads",
    "threads",
    "weight_type",
]

ISAS = ("avx512vnni", "avx512", "avx2", "neon", "portable")


def set_threads(n: int) -> int:
    """Resizes the engine's thread pool (n >= 1, the calling thread included) -> the thread count now used."""
    if n < 1:
        raise ValueError(f"set_threads: n must be >= 1, got {n}")
    return _lib.require().fs_init(int(n))


def threads() -> int:
    return _lib.require().fs_threads()


def isa() -> str:
    """The ISA path in use ("avx512vnni", "avx512", "avx2", "neon" or "portable")."""
    return _lib.require().fs_isa().decode()


def available_isas() -> list[str]:
    """The ISA paths this build runs on this CPU, best first."""
    lib = _lib.require()
    return [name for name in ISAS if lib.fs_isa_available(name.encode())]


def set_isa(name: str | None) -> None:
    """Forces an ISA path (tests), or the best one again with None. Raises ValueError if it can't run here."""
    if _lib.require().fs_set_isa(name.encode() if name else None) != 0:
        raise ValueError(f"ISA {name!r} is not available here (available: {available_isas()})")
