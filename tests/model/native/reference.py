"""Test helpers: random valid GGUF tensors of every type, and numpy references (float64) for the engine's math.

The activation quantization is re-implemented here with numpy float32 operations, which round exactly as the C
code does, so references can use the same quantized activations the kernels see.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from flowspec_p2p.model.native.formats import TYPES

EPS32 = 2.0 ** -24
INT_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
FLOAT_TYPES = ["F32", "F16", "BF16"]
ALL_TYPES = INT_TYPES + FLOAT_TYPES
ASYM_TYPES = {"Q4_1", "Q5_1", "Q4_K", "Q5_K"}

# byte offsets, inside a GGUF block, of the fp16 scale fields (d first) and of the offset field (m / dmin)
_FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
                "Q5_K": (0, 2), "Q6_K": (208,)}
_OFFSET_FIELD = {"Q4_1": 2, "Q5_1": 2, "Q4_K": 2, "Q5_K": 2}


def block_cols(type_name: str) -> int:
    """The column granularity of a type in these tests (float types: the activation block, 32)."""
    return max(TYPES[type_name].block, 32)


def random_gguf(type_name: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.02) -> np.ndarray:
    """Random valid GGUF bytes [rows, cols] of a type: random quant bytes, finite fp16 scales of magnitude ~scale
    (random signs), float types ~N(0, scale)."""
    t = TYPES[type_name]
    if t.is_float:
        w = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if type_name == "F32":
            return w.view(np.uint8).reshape(rows, -1)
        if type_name == "F16":
            return w.astype(np.float16).view(np.uint8).reshape(rows, -1)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
    nb = rows * cols // t.block
    blocks = rng.integers(0, 256, (nb, t.block_bytes), dtype=np.uint8)
    per = scale / (t.block if t.block == 256 else 8)  # K-quants' d multiplies a 6-8 bit sub-scale
    for off in _FP16_FIELDS[type_name]:
        d = (rng.uniform(0.25, 1.0, nb) * rng.choice([-1.0, 1.0], nb) * (per if t.block == 256 else scale / 8))
        blocks[:, off:off + 2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
    return blocks.reshape(rows, -1)


def gguf_dequant(type_name: str, raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """gguf.quants' dequantization -> float32 [rows, cols]."""
    return np.asarray(dequantize(raw.reshape(rows, -1), GGMLQuantizationType[type_name]),
                      dtype=np.float32).reshape(rows, cols)


def weight_parts(type_name: str, raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(dw * q, mw) per element, float64 [rows, cols]: the two terms of w = dw q + mw (mw = 0: symmetric)."""
    w = gguf_dequant(type_name, raw, rows, cols).astype(np.float64)
    if type_name not in _OFFSET_FIELD:
        return w, np.zeros_like(w)
    t = TYPES[type_name]
    blocks = raw.reshape(-1, t.block_bytes).copy()
    off = _OFFSET_FIELD[type_name]
    blocks[:, off:off + 2] = 0
    dwq = gguf_dequant(type_name, blocks, rows, cols).astype(np.float64)
    return dwq, w - dwq


def quantize_act(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [n, cols] float32 -> (v [n, cols] int16, d [n, cols / 32] float32), as the engine quantizes."""
    n, cols = x.shape
    xb = x.astype(np.float32).reshape(n, cols // 32, 32)
    amax = np.abs(xb).max(axis=2)  # [n, nb]
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(amax > 0, np.float32(32767.0) / amax, np.float32(0)).astype(np.float32)
        d = np.where(amax > 0, amax / np.float32(32767.0), np.float32(0)).astype(np.float32)
    f = np.clip((xb * inv[..., None]).astype(np.float32), -32767, 32767)
    v = np.rint(f).astype(np.int16)
    return v.reshape(n, cols), d


def dequant_act(x: np.ndarray) -> np.ndarray:
    """x [n, cols] -> d_b v_k [n, cols] float64: the activations the kernel multiplies."""
    v, d = quantize_act(x)
    n, cols = x.shape
    return (v.reshape(n, cols // 32, 32).astype(np.float64) * d[..., None].astype(np.float64)).reshape(n, cols)


def matmul_refs(type_name: str, raw: np.ndarray, rows: int, cols: int, x: np.ndarray):
    """-> (ref on the quantized activations, its tolerance, ref on the raw activations, its tolerance), each
    [n, rows] float64. The tolerances follow from the kernel's float32 sequence (two roundings per block plus a
    few per term) and, for the raw reference, from the activation quantization error (<= d_b / 2 per element)."""
    w = gguf_dequant(type_name, raw, rows, cols).astype(np.float64)
    x64 = x.astype(np.float64)
    if TYPES[type_name].is_float:
        ref = x64 @ w.T
        tol = (cols + 4) * EPS32 * (np.abs(x64) @ np.abs(w).T) + 1e-30
        return ref, tol, ref, tol
    dwq, mw = weight_parts(type_name, raw, rows, cols)
    xq = dequant_act(x)
    ref_q = xq @ w.T
    nb = cols // 32
    terms = np.abs(xq) @ (np.abs(dwq) + np.abs(mw)).T
    tol_q = (2 * nb + 8) * EPS32 * terms + 1e-30
    _, d = quantize_act(x)
    amax = d.astype(np.float64) * 32767.0
    err = np.repeat(0.5 * d.astype(np.float64) + 4 * EPS32 * amax, 32, axis=1)  # [n, cols] per-element bound
    tol_raw = tol_q + err @ np.abs(w).T
    return ref_q, tol_q, x64 @ w.T, tol_raw
