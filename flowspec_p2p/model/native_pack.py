"""Packing a shard's stored tensors into the native engine's layout: which engine type each stored tensor becomes
(``describe``), the bytes to pack (as stored, un-permuted, re-encoded or dequantized to F16), and packing big tensors
a window of rows at a time with each window's file pages dropped before the next is read, so loading never holds a
whole embedding table twice.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import UnsupportedModel
from ..types import LayerRange
from . import native
from .arch import ModelConfig
from .native.qmatrix import PANEL
from .weights import NORM, WeightSource, gguf_tensor_from_raw, layer_tensor_names, unpermute_rows

log = logging.getLogger(__name__)

CHUNK_ROWS = 2048  # rows of a big tensor packed at a time (a multiple of the engine's 16-row panels)


@dataclass(frozen=True)
class StoredTensor:
    """How a stored tensor becomes a packed matrix: its engine type and logical [rows, cols]."""

    name: str
    type_name: str  # an engine type (native.TYPES), what the stored bytes are packed as
    rows: int
    cols: int
    stored: str  # the stored type (GGUF qtype or safetensors dtype)


_WARNED: set[str] = set()


def describe(source: WeightSource, name: str, quantize: str | None) -> StoredTensor:
    info = source.raw_info(name)
    if info["format"] == "gguf":
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        qtype = info["qtype"]
        shape = list(info["byte_shape"])
        if np.dtype(info["dtype"]) == np.uint8:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
            shape[-1] = shape[-1] // size * block
        rows, cols = (1, shape[0]) if len(shape) == 1 else shape
        engine_type = qtype if qtype in native.TYPES else "F16"
        if engine_type != qtype and qtype not in _WARNED:
            _WARNED.add(qtype)
            log.warning("the native engine has no kernel for %s: those tensors are dequantized to F16", qtype)
        return StoredTensor(name, engine_type, rows, cols, qtype)
    dtype = info["dtype"]
    rows, cols = info["shape"]
    if dtype not in ("F16", "BF16", "F32"):
        raise UnsupportedModel(f"{name}: the native engine runs F16, BF16 and F32 checkpoints, not {dtype}")
    return StoredTensor(name, quantize or dtype, rows, cols, dtype)


def stored_bytes(source: WeightSource, t: StoredTensor, cfg: ModelConfig, quantize: str | None) -> np.ndarray:
    """The bytes to pack for ``t``: as stored (q/k rows un-permuted for llama.cpp's files), or re-encoded."""
    info = source.raw_info(t.name)
    if info["format"] == "gguf" and t.type_name == t.stored:
        raw = np.frombuffer(source.raw_bytes(t.name), dtype=np.uint8).reshape(t.rows, -1)  # [rows, row bytes]
        if cfg.arch in ("llama", "mistral") and t.name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if t.name.endswith("q_proj.weight") else cfg.num_kv_heads
            raw = unpermute_rows(raw, heads)
        return np.ascontiguousarray(raw)
    if info["format"] == "gguf":  # no kernel for the stored type: dequantized, kept in 16 bits
        w = gguf_tensor_from_raw(cfg, t.name, info, source.raw_bytes(t.name))
        return w.to(torch.float16).numpy().view(np.uint8)
    if quantize == "Q8_0":
        return native.q8_0_bytes(source.load(t.name))
    return np.frombuffer(source.raw_bytes(t.name), dtype=np.uint8)


def sorted_rows(source: WeightSource, t, ids: np.ndarray):
    """Rows ``ids`` (increasing) of the GGUF tensor ``t`` as stored, in chunks for QMatrix.from_row_chunks (each a
    multiple of PANEL rows but the last): one window of CHUNK_ROWS source rows read at a time and its file pages
    dropped, so neither the table nor a full copy of the picked rows is ever resident."""
    raw = np.frombuffer(source.raw_bytes(t.name), dtype=np.uint8).reshape(t.rows, -1)  # [rows, row bytes]
    bounds = np.searchsorted(ids, np.arange(0, t.rows + CHUNK_ROWS, CHUNK_ROWS))
    pending: list[np.ndarray] = []
    for w, (i, j) in enumerate(itertools.pairwise(bounds)):
        if j > i:
            pending.append(raw[ids[i:j]])  # a copy: the window's pages can go
        release(source, t.name, w * CHUNK_ROWS * raw.shape[1], min(t.rows, (w + 1) * CHUNK_ROWS) * raw.shape[1])
        if sum(len(x) for x in pending) >= CHUNK_ROWS:
            buf = np.concatenate(pending)
            k = len(buf) // PANEL * PANEL
            yield buf[:k]
            pending = [buf[k:]]
    if sum(len(x) for x in pending):
        yield np.concatenate(pending)


def release(source: WeightSource, name: str, start: int = 0, end: int | None = None) -> None:
    release = getattr(source, "release", None)
    if release is not None:
        release(name, start, end)


def pack(source: WeightSource, t: StoredTensor, cfg: ModelConfig, quantize: str | None,
          arena: native.WeightArena) -> native.QMatrix:
    """``t`` packed into ``arena``. A big GGUF tensor packed as stored goes in chunks of CHUNK_ROWS rows, each
    chunk's file pages dropped before the next is read, so loading never holds a whole embedding table twice."""
    info = source.raw_info(t.name)
    permuted = cfg.arch in ("llama", "mistral") and t.name.endswith(("q_proj.weight", "k_proj.weight"))
    if info["format"] == "gguf" and t.type_name == t.stored and not permuted and t.rows > CHUNK_ROWS:
        raw = np.frombuffer(source.raw_bytes(t.name), dtype=np.uint8).reshape(t.rows, -1)  # [rows, row bytes]
        row_bytes = raw.shape[1]

        def chunks():
            for a in range(0, t.rows, CHUNK_ROWS):
                yield raw[a : a + CHUNK_ROWS]
                release(source, t.name, a * row_bytes, min(t.rows, a + CHUNK_ROWS) * row_bytes)

        return native.QMatrix.from_row_chunks(t.type_name, t.rows, t.cols, chunks(), arena)
    m = native.QMatrix.from_gguf_bytes(t.type_name, t.rows, t.cols, stored_bytes(source, t, cfg, quantize), arena)
    release(source, t.name)
    return m


def names_read(cfg: ModelConfig, layers: LayerRange, *, embed: bool, head: bool, tensors) -> list[str]:
    """Every stored tensor a shard of these layers reads: its matrices (``tensors``), norms, biases, rope factors."""
    names = [*tensors, *(n for i in layers.indices() for n in layer_tensor_names(cfg, i) if n not in tensors)]
    if head:
        names.append(NORM)
    return names
