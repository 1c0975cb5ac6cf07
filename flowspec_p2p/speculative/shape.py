"""The EAGLE-2 draft-tree budget, apart from the drafters so that configuration can name it without torch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..types import Settings


class TreeShape(Settings):
    """EAGLE-2 tree budget. total_tokens counts the root (EAGLE's ``total_token``)."""

    total_tokens: int = Field(12, ge=1)
    depth: int = Field(5, ge=0)  # deepest drafted node; expansion levels
    top_k: int = Field(4, ge=1)  # children per expanded node, and frontier width
    order: Literal["eagle", "score"] = "eagle"
    # the longest prompt-lookup chain merged below the root (ngram.LookupDrafter); None: as deep as the tree. A
    # chain deeper than a small tree pays where the reply copies its context (docs/experiments.md)
    lookup: int | None = Field(None, ge=0)

    def capped(self, max_depth: int) -> TreeShape:
        """The same shape drafting no deeper than ``max_depth`` (the reply's remaining token budget), the lookup
        chain included."""
        m = max(0, max_depth)
        update = {k: m for k, v in (("depth", self.depth), ("lookup", self.lookup)) if v is not None and v > m}
        return self.model_copy(update=update) if update else self

    @property
    def lookup_depth(self) -> int:
        """The longest prompt-lookup chain this shape's trees take."""
        return self.depth if self.lookup is None else self.lookup

    def draft_slots(self) -> int:
        """Drafter KV slots one tree may use on top of the committed context."""
        return 1 + self.top_k * self.depth
