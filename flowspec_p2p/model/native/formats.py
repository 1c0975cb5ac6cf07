"""The weight types the engine runs, by their GGUF names, with their GGUF block geometry."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightType:
    """A GGUF tensor type: `block` columns take `block_bytes` bytes in the file."""

    name: str
    id: int  # ggml's type id (csrc/fs.h enum fs_type)
    block: int
    block_bytes: int

    @property
    def is_float(self) -> bool:
        """Float types take float32 activations; the others quantize activations to int16 blocks."""
        return self.block == 1

    def gguf_nbytes(self, rows: int, cols: int) -> int:
        """Bytes of a [rows, cols] tensor in a GGUF file."""
        if cols % self.block:
            raise ValueError(f"{self.name}: {cols} columns is not a multiple of the block size {self.block}")
        return rows * (cols // self.block) * self.block_bytes


TYPES: dict[str, WeightType] = {t.name: t for t in (
    WeightType("F32", 0, 1, 4),
    WeightType("F16", 1, 1, 2),
    WeightType("BF16", 30, 1, 2),
    WeightType("Q4_0", 2, 32, 18),
    WeightType("Q4_1", 3, 32, 20),
    WeightType("Q5_0", 6, 32, 22),
    WeightType("Q5_1", 7, 32, 24),
    WeightType("Q8_0", 8, 32, 34),
    WeightType("Q4_K", 12, 256, 144),
    WeightType("Q5_K", 13, 256, 176),
    WeightType("Q6_K", 14, 256, 210),
)}


def weight_type(name: str) -> WeightType:
    """The type called `name` (GGUF spelling: "Q4_1", "F16", ...). Raises ValueError for one the engine lacks."""
    try:
        return TYPES[name]
    except KeyError:
        raise ValueError(f"weight type {name!r} is not supported by the native engine "
                         f"(supported: {', '.join(TYPES)})") from None
