"""Shared vocabulary: identifiers and layer ranges."""

from __future__ import annotations

from typing import NewType

from pydantic import BaseModel, ConfigDict, model_validator

PeerId = NewType("PeerId", str)
RequestId = NewType("RequestId", str)


class FrozenModel(BaseModel):
    """Base for value objects: immutable, no unknown fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")


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
