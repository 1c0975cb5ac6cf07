"""Shared vocabulary: identifiers, layer ranges, and the two model bases (strict messages, lax settings)."""

from __future__ import annotations

from typing import NewType

from pydantic import BaseModel, ConfigDict, model_validator

PeerId = NewType("PeerId", str)
RequestId = NewType("RequestId", str)


class FrozenModel(BaseModel):
    """Base for messages and value objects: immutable, no unknown fields, strict types (a peer's message must say
    exactly what it means: no string for a number, no float for an int). JSON input (``model_validate_json``) maps
    arrays onto tuples."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class Settings(FrozenModel):
    """Base for configuration a user writes (flags, TOML profiles, JSON options): immutable and closed like a
    FrozenModel, but values convert as a user would expect (a path from a string, a tuple from a list)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)


class LayerRange(FrozenModel):
    """Half-open range of decoder layers ``[start, end)``. May be empty (a leader holding no layers)."""

    start: int
    end: int

    @model_validator(mode="after")
    def _ordered(self) -> LayerRange:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"layer range [{self.start}, {self.end}) must satisfy 0 <= start <= end")
        return self

    def __len__(self) -> int:
        return self.end - self.start

    def indices(self) -> range:
        return range(self.start, self.end)

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"
