"""Packed weight matrices: `QMatrix` (a GGUF tensor re-laid out for the engine's kernels, still in its quantized
blocks) and `quantize_q8_0` for float checkpoints loaded with the option to quantize.

Every argument is checked here: the C side trusts its pointers and sizes.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from . import _lib
from .formats import WeightType, weight_type

Q8_0_BLOCK = 32
PANEL = 16  # output rows per packed panel (csrc/fs_internal.h): chunks of a multiple pack independently
ALIGN = 64  # bytes: the packed data's alignment
HUGE_PAGE = 2 << 20  # bytes


def _as_bytes(raw: bytes | bytearray | memoryview | np.ndarray | torch.Tensor) -> np.ndarray:
    """GGUF tensor bytes from any of the forms a reader hands out -> a contiguous uint8 numpy array (no copy
    where possible)."""
    if isinstance(raw, torch.Tensor):
        raw = raw.detach().cpu().contiguous().view(torch.uint8).numpy()
    elif isinstance(raw, (bytes, bytearray, memoryview)):
        raw = np.frombuffer(raw, dtype=np.uint8)
    return np.ascontiguousarray(np.asarray(raw).view(np.uint8).reshape(-1))


class QMatrix:
    """A weight matrix W [rows, cols] (y = x @ W^T) in the engine's packed layout (csrc/formats.c)."""

    __slots__ = ("cols", "packed", "rows", "wtype")

    def __init__(self, type_name: str, rows: int, cols: int, packed: torch.Tensor) -> None:
        self.wtype: WeightType = weight_type(type_name)
        self.rows, self.cols = int(rows), int(cols)
        size = _lib.require().fs_packed_size(self.wtype.id, self.rows, self.cols)
        if size < 0:
            raise ValueError(f"{type_name} [{rows}, {cols}]: unsupported shape for the native engine")
        if packed.dtype != torch.uint8 or packed.shape != (size,) or not packed.is_contiguous() or packed.is_cuda:
            raise ValueError(f"packed: expected a contiguous CPU uint8 [{size}], got {packed.dtype} "
                             f"{tuple(packed.shape)}")
        self.packed = packed  # [nbytes] uint8

    @staticmethod
    def packed_size(type_name: str, rows: int, cols: int) -> int:
        """Bytes of the packed form of a [rows, cols] matrix (ValueError if the engine can't run that shape)."""
        size = _lib.require().fs_packed_size(weight_type(type_name).id, rows, cols)
        if size < 0:
            raise ValueError(f"{type_name} [{rows}, {cols}]: unsupported shape for the native engine")
        return size

    @classmethod
    def from_gguf_bytes(cls, type_name: str, rows: int, cols: int, raw: bytes | np.ndarray | torch.Tensor,
                        arena: WeightArena | None = None) -> QMatrix:
        """Packs a tensor's GGUF bytes (row-major [rows, cols], as ggml stores it), into `arena` if given."""
        lib, wtype = _lib.require(), weight_type(type_name)
        src = _as_bytes(raw)
        if src.size != wtype.gguf_nbytes(rows, cols):
            raise ValueError(f"{type_name} [{rows}, {cols}]: expected {wtype.gguf_nbytes(rows, cols)} bytes, "
                             f"got {src.size}")
        size = cls.packed_size(type_name, rows, cols)
        packed = arena.take(size) if arena is not None else WeightArena(size).take(size)
        if lib.fs_pack(wtype.id, rows, cols, src.ctypes.data, packed.data_ptr()) != 0:
            raise RuntimeError(f"fs_pack failed for {type_name} [{rows}, {cols}]")
        return cls(type_name, rows, cols, packed)

    @classmethod
    def from_row_chunks(cls, type_name: str, rows: int, cols: int, chunks: Iterable[np.ndarray],
                        arena: WeightArena | None = None) -> QMatrix:
        """Packs a tensor handed over as consecutive row chunks of its GGUF bytes ([n, row bytes] each; every chunk
        but the last a multiple of PANEL rows), so a caller can free each chunk's source before the next one."""
        lib, wtype = _lib.require(), weight_type(type_name)
        size = cls.packed_size(type_name, rows, cols)
        packed = arena.take(size) if arena is not None else WeightArena(size).take(size)
        row, offset = 0, 0
        for chunk in chunks:
            src = _as_bytes(chunk)
            n = src.size // max(1, wtype.gguf_nbytes(1, cols))
            if n == 0 or src.size != wtype.gguf_nbytes(n, cols) or row + n > rows or (row + n < rows and n % PANEL):
                raise ValueError(f"{type_name} [{rows}, {cols}]: a chunk of {src.size} bytes at row {row} does not fit")
            part = cls.packed_size(type_name, n, cols)
            if lib.fs_pack(wtype.id, n, cols, src.ctypes.data, packed.data_ptr() + offset) != 0:
                raise RuntimeError(f"fs_pack failed for {type_name} rows [{row}, {row + n})")
            row, offset = row + n, offset + part
        if row != rows:
            raise ValueError(f"{type_name} [{rows}, {cols}]: the chunks held {row} rows")
        return cls(type_name, rows, cols, packed)

    @property
    def type_name(self) -> str:
        return self.wtype.name

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def struct(self) -> _lib.FsMatrix:
        """The C view (valid while this object lives)."""
        return _lib.FsMatrix(self.packed.data_ptr(), self.wtype.id, self.rows, self.cols)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., cols] float32 -> x @ W^T [..., rows] float32."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.ndim < 1 or x.shape[-1] != self.cols:
            raise ValueError(f"matmul: expected float32 CPU [..., {self.cols}], got {x.dtype} {tuple(x.shape)} "
                             f"on {x.device}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.cols).contiguous()  # [n, cols]
        y = torch.empty(x2.shape[0], self.rows, dtype=torch.float32)  # [n, rows]
        rc = _lib.require().fs_matmul(self.wtype.id, self.rows, self.cols, self.packed.data_ptr(), x2.data_ptr(),
                                      x2.shape[0], y.data_ptr())
        if rc != 0:
            raise RuntimeError(f"fs_matmul failed ({rc})")
        return y.view(*lead, self.rows)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., cols] float32 -> (x @ W^T).argmax(-1) [...] int64, equal to it bit for bit (the lowest index
        among equal maxima), without the [..., rows] product: each thread keeps the maxima of its slices."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.ndim < 1 or x.shape[-1] != self.cols:
            raise ValueError(f"argmax: expected float32 CPU [..., {self.cols}], got {x.dtype} {tuple(x.shape)} "
                             f"on {x.device}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.cols).contiguous()  # [n, cols]
        ids = torch.empty(x2.shape[0], dtype=torch.int64)  # [n]
        rc = _lib.require().fs_matmul_argmax(self.wtype.id, self.rows, self.cols, self.packed.data_ptr(),
                                             x2.data_ptr(), x2.shape[0], ids.data_ptr())
        if rc != 0:
            raise RuntimeError(f"fs_matmul_argmax failed ({rc})")
        return ids.view(lead)

    def rows_f32(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [m] integer row indices -> those rows dequantized [m, cols] float32 (an embedding lookup)."""
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.ndim != 1:
            raise ValueError(f"rows_f32: expected a 1-d integer tensor, got {ids.dtype} {tuple(ids.shape)}")
        ids64 = ids.to(torch.int64).contiguous()  # [m]
        if ids64.numel() and (int(ids64.min()) < 0 or int(ids64.max()) >= self.rows):
            raise IndexError(f"rows_f32: row ids must lie in [0, {self.rows})")
        out = torch.empty(ids64.numel(), self.cols, dtype=torch.float32)  # [m, cols]
        rc = _lib.require().fs_dequant_rows(self.wtype.id, self.rows, self.cols, self.packed.data_ptr(),
                                            ids64.data_ptr(), ids64.numel(), out.data_ptr())
        if rc != 0:
            raise RuntimeError(f"fs_dequant_rows failed ({rc})")
        return out

    def __repr__(self) -> str:
        return f"QMatrix({self.type_name}, [{self.rows}, {self.cols}], {self.nbytes} bytes)"


class WeightArena:
    """One buffer for many packed matrices, backed by transparent huge pages where the OS allows (Linux THP in
    "madvise" or "always" mode). A stage's weights are small matrices streamed one after another; in separate
    4 KiB-page allocations each costs TLB misses and restarts the hardware prefetcher (SmolLM2's 30 layers at one
    row: 7.8 ms from separate buffers, 3.3 ms from one huge-page arena). Slices are views: the arena lives as
    long as any matrix packed into it."""

    def __init__(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"WeightArena: negative size {nbytes}")
        self._buf = torch.empty(nbytes + ALIGN, dtype=torch.uint8)  # [nbytes + 64], not yet touched
        start = -self._buf.data_ptr() % ALIGN
        self._base = self._buf[start:start + nbytes]
        if nbytes >= 2 * HUGE_PAGE:  # the 2 MiB-aligned interior; no padding, so no memory overhead
            _lib.require().fs_advise_hugepages(self._base.data_ptr(), nbytes)
        self._used = 0

    @classmethod
    def for_matrices(cls, shapes: list[tuple[str, int, int]]) -> WeightArena:
        """An arena that holds matrices of these (type name, rows, cols), each 64-byte aligned."""
        return cls(sum(-(-QMatrix.packed_size(*s) // ALIGN) * ALIGN for s in shapes))

    def take(self, nbytes: int) -> torch.Tensor:
        """The next nbytes of the arena (64-byte aligned) -> a uint8 view [nbytes]."""
        if self._used + nbytes > self._base.numel():
            raise ValueError(f"WeightArena: {nbytes} bytes do not fit ({self._base.numel() - self._used} left)")
        view = self._base[self._used:self._used + nbytes]
        self._used += -(-nbytes // ALIGN) * ALIGN
        return view

    @property
    def nbytes(self) -> int:
        return self._base.numel()


def q8_0_bytes(w: torch.Tensor) -> np.ndarray:
    """w [rows, cols] (float32/float16/bfloat16, cols a multiple of 32) -> its GGUF Q8_0 bytes
    [rows, cols / 32 * 34], equal bit for bit to gguf.quants.quantize(w, Q8_0)."""
    if w.ndim != 2 or w.shape[1] % Q8_0_BLOCK or not w.dtype.is_floating_point:
        raise ValueError(f"q8_0_bytes: expected a float [rows, cols % 32 == 0], got {w.dtype} {tuple(w.shape)}")
    rows, cols = w.shape
    blocks = w.detach().cpu().to(torch.float32).reshape(-1, Q8_0_BLOCK)  # [rows * cols / 32, 32]
    d = blocks.abs().amax(dim=1, keepdim=True) / 127  # [nb, 1]
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inv
    a = scaled.abs()  # ggml's round half away from zero, written as gguf.quants.np_roundf does
    floored = torch.floor(a)
    q = torch.sign(scaled) * (floored + torch.floor(2 * (a - floored)))
    out = np.empty((blocks.shape[0], 34), dtype=np.uint8)
    out[:, :2] = d.to(torch.float16).numpy().view(np.uint8)
    out[:, 2:] = q.to(torch.int8).numpy().view(np.uint8)
    return out.reshape(rows, cols // Q8_0_BLOCK * 34)


def quantize_q8_0(w: torch.Tensor) -> QMatrix:
    """w [rows, cols] float -> a packed Q8_0 QMatrix (for float checkpoints loaded with quantization on)."""
    return QMatrix.from_gguf_bytes("Q8_0", w.shape[0], w.shape[1], q8_0_bytes(w))
