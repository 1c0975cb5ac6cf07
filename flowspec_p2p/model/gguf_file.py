"""GGUF files by hand: the header (metadata and tensor directory) in one pass over a memory map, and the common
block types dequantised with torch.

``gguf.GGUFReader`` takes ~5 s on the tokenizer arrays; this parse takes ~0.1 s and skips them. F32/F16/BF16 and
Q8_0/Q4_0/Q4_1 dequantise with torch (~20x faster than numpy) with the same float32 operations as ``gguf.quants``,
so the values are bit-identical; the other types go through ``gguf.quants``.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import UnsupportedModel, WeightsError


@dataclass(frozen=True)
class GGUFTensor:
    name: str  # llama.cpp's name, e.g. blk.3.attn_q.weight
    qtype: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: [rows, cols]
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def np_dtype(self) -> str:
        return _GGUF_PLAIN_NP.get(self.qtype.name, "uint8")

    @property
    def byte_shape(self) -> tuple[int, ...]:
        if self.qtype.name in _GGUF_PLAIN_NP:
            return self.shape
        from gguf import GGML_QUANT_SIZES

        block, size = GGML_QUANT_SIZES[self.qtype]
        return (*self.shape[:-1], self.shape[-1] // block * size)


_GGUF_PLAIN_NP = {"F32": "float32", "F16": "float16", "F64": "float64", "I8": "int8", "I16": "int16", "I32": "int32",
                  "I64": "int64"}  # types gguf.GGUFReader exposes as typed arrays; the rest are raw bytes
_GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
# Big tokenizer arrays we never read (the tokenizer comes from transformers); skipped without decoding.
_GGUF_SKIP = ("tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.tokens")
# (the tokenizer is built from the file by transformers, once, and cached; of a skipped array only its length is
# kept, as "<key>.count")


class _Cursor:
    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str) -> tuple:
        try:
            out = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise WeightsError(f"{self.path} is truncated or not a GGUF file") from None
        self.pos += struct.calcsize(fmt)
        return out

    def string(self, keep: bool = True) -> str | None:
        (n,) = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise WeightsError(f"{self.path} is truncated or not a GGUF file")
        s = self.buf[self.pos : self.pos + n].decode("utf-8", errors="replace") if keep else None
        self.pos += n
        return s

    def value(self, vtype: int, keep: bool = True):
        if vtype == _GGUF_STRING:
            return self.string(keep)
        if vtype == _GGUF_ARRAY:
            etype, count = self.unpack("<IQ")
            if etype in (_GGUF_STRING, _GGUF_ARRAY):
                items = [self.value(etype, keep) for _ in range(count)]
                return items if keep else None
            fmt = _GGUF_SCALAR[etype]
            size = struct.calcsize(fmt)
            arr = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=count, offset=self.pos) if keep else None
            self.pos += count * size
            return None if arr is None else arr.tolist()
        if vtype not in _GGUF_SCALAR:
            raise WeightsError(f"{self.path}: unknown GGUF value type {vtype}")
        return self.unpack(_GGUF_SCALAR[vtype])[0]


def parse_gguf(buf: mmap.mmap, path: Path) -> tuple[dict, list[GGUFTensor]]:
    """Metadata and tensor directory of a GGUF (v2/v3, little-endian) file. Large tokenizer arrays are skipped."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    cur = _Cursor(buf, path)
    if buf[:4] != b"GGUF":
        raise WeightsError(f"{path} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
    cur.pos = 4
    version, n_tensors, n_kv = cur.unpack("<IQQ")
    if version not in (2, 3):
        raise UnsupportedModel(f"{path}: GGUF version {version} is not supported (2 and 3 are; big-endian is not)")
    meta: dict = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
    for _ in range(n_kv):
        key = cur.string()
        (vtype,) = cur.unpack("<I")
        keep = key not in _GGUF_SKIP
        if not keep and vtype == _GGUF_ARRAY:
            _, count = struct.unpack_from("<IQ", buf, cur.pos)
            meta[f"{key}.count"] = count
        value = cur.value(vtype, keep)
        if keep:
            meta[key] = value
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        (n_dims,) = cur.unpack("<I")
        dims = cur.unpack(f"<{n_dims}Q")
        qtype_id, offset = cur.unpack("<IQ")
        infos.append((name, dims, qtype_id, offset))
    align = int(meta.get("general.alignment", 32))
    data_start = -(-cur.pos // align) * align
    tensors = []
    for name, dims, qtype_id, offset in infos:
        try:
            qtype = GGMLQuantizationType(qtype_id)
        except ValueError:
            raise UnsupportedModel(f"{path}: tensor {name} has unknown GGML type {qtype_id}") from None
        block, size = GGML_QUANT_SIZES[qtype]
        n = math.prod(dims)
        t = GGUFTensor(name, qtype, tuple(reversed(dims)), data_start + offset, n * size // block)
        if t.offset + t.nbytes > len(buf):
            raise WeightsError(f"{path} is truncated: tensor {name} ends past the end of the file")
        tensors.append(t)
    return meta, tensors


def metadata_spans(buf: mmap.mmap, path: Path) -> list[tuple[str, int, int]]:
    """Every metadata entry of a GGUF file as (key, start, end): the byte span of the whole encoded entry (key, type,
    value), so a writer can copy entries verbatim (model/synth.py copies the tokenizer's)."""
    cur = _Cursor(buf, path)
    if buf[:4] != b"GGUF":
        raise WeightsError(f"{path} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
    cur.pos = 4
    _, _, n_kv = cur.unpack("<IQQ")
    spans = []
    for _ in range(n_kv):
        start = cur.pos
        key = cur.string()
        (vtype,) = cur.unpack("<I")
        cur.value(vtype, keep=False)
        spans.append((key, start, cur.pos))
    return spans


DEQUANT_CHUNK_BLOCKS = 1 << 16  # 2M weights (8 MB of float32) per step


def _dequantize_blocks(blocks: torch.Tensor, name: str, out: torch.Tensor) -> None:
    """blocks: [n, bytes per block] uint8 of type Q8_0 | Q4_0 | Q4_1 -> out: [n, 32] float32, with gguf.quants'
    float32 formulas (the integer quants convert exactly, so writing the products straight into ``out`` is exact)."""
    d = blocks[:, :2].contiguous().view(torch.float16).float()  # [n, 1] scale
    if name == "Q8_0":
        torch.mul(blocks[:, 2:].contiguous().view(torch.int8), d, out=out)
        return
    qs = blocks[:, -16:]  # [n, 16]: element j in the low nibble of byte j, element 16 + j in the high one
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1)  # [n, 32]
    if name == "Q4_0":
        torch.mul(d, q.to(torch.int8) - 8, out=out)
        return
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()  # [n, 1] Q4_1 minimum
    torch.mul(d, q, out=out).add_(m)


def dequantize(raw: torch.Tensor, qtype, shape: tuple[int, ...]) -> torch.Tensor:
    """GGML bytes -> float32 tensor of ``shape``. raw: [nbytes] uint8.

    F32/F16/BF16 and the Q8_0/Q4_0/Q4_1 blocks are decoded with torch (~20x faster than numpy), with the same
    float32 operations as ``gguf.quants`` so the values are bit-identical; other types go through ``gguf.quants``.
    """
    from gguf import GGML_QUANT_SIZES, quants

    name = qtype.name
    if name == "F32":
        out = raw.view(torch.float32).clone()
    elif name == "F64":  # float64 stays float64 (tests write exact checkpoints this way)
        out = raw.view(torch.float64).clone()
    elif name in ("F16", "BF16"):
        out = raw.view(torch.float16 if name == "F16" else torch.bfloat16).float()
    elif name in ("Q8_0", "Q4_0", "Q4_1"):
        block, size = GGML_QUANT_SIZES[qtype]
        blocks = raw.view(-1, size)  # [n_blocks, bytes per block]
        out = torch.empty(blocks.shape[0], block)  # [n_blocks, 32]
        for a in range(0, blocks.shape[0], DEQUANT_CHUNK_BLOCKS):  # in chunks: temporaries stay small
            _dequantize_blocks(blocks[a : a + DEQUANT_CHUNK_BLOCKS], name, out[a : a + DEQUANT_CHUNK_BLOCKS])
    else:
        block, size = GGML_QUANT_SIZES[qtype]
        rows = raw.numpy().reshape(*shape[:-1], shape[-1] // block * size)
        out = torch.from_numpy(np.array(quants.dequantize(rows, qtype), dtype=np.float32, copy=True))
    return out.reshape(shape)
