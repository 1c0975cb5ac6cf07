"""The decoding modes this package ships, in one place: ar, chunk (Chunk-PP), pipedec (PipeDec) and flowspec."""

from __future__ import annotations

from .ar import AR
from .chunk import CHUNK
from .context import DecodingMode
from .flowspec import FLOWSPEC, FlowSpecConfig, make_flowspec
from .pipedec import PIPEDEC


def builtin_modes(flowspec: FlowSpecConfig | None = None) -> list[DecodingMode]:
    """Every built-in mode; ``flowspec``: FlowSpec's settings (default: the tuned defaults)."""
    return [AR, CHUNK, PIPEDEC, FLOWSPEC if flowspec is None else make_flowspec(flowspec)]
