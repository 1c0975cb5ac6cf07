"""fs_matmul_argmax (QMatrix.argmax): the argmax of each row of x @ W^T without the product, equal to
torch.argmax of fs_matmul's output for every type x every ISA path here, on 1-3 threads, across 64-row chunks and
1024-row groups, with ties (the lowest index wins), infinities and NaN (the first NaN wins, as in torch), and on
a Gemma-sized vocabulary of 262,144 rows."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from flowspec_p2p.model import native
from flowspec_p2p.model.native import QMatrix

from .reference import ALL_TYPES, block_cols, random_gguf


def _matrix(type_name: str, rows: int, nblk: int, seed: int = 0, repeat: int = 1) -> tuple[QMatrix, np.ndarray]:
    """A random matrix of ``rows`` rows whose distinct rows repeat ``repeat`` times each (equal outputs: ties)."""
    cols = nblk * block_cols(type_name)
    rng = np.random.default_rng(zlib.crc32(f"{type_name}{rows}{nblk}{seed}".encode()))
    raw = random_gguf(type_name, -(-rows // repeat), cols, rng)
    raw = np.repeat(raw, repeat, axis=0)[:rows]  # [rows, row bytes]
    x = (rng.standard_normal((70, cols)) * rng.uniform(0.1, 10, (70, 1))).astype(np.float32)  # [70, cols]
    return QMatrix.from_gguf_bytes(type_name, rows, cols, raw), x


def _same(m: QMatrix, x: torch.Tensor) -> None:
    want = m.matmul(x).argmax(-1)
    for threads in (1, 2, 3):
        native.set_threads(threads)
        assert torch.equal(m.argmax(x), want), threads


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_argmax_equals_the_products_argmax_on_every_type_and_isa(isa, type_name):
    """3000 rows (three 1024-row groups, the last partial, the last panel partial), 70 activation rows (two
    64-row chunks), every third row repeated (ties across and within groups)."""
    m, x = _matrix(type_name, 3000, 1, repeat=3)
    xt = torch.from_numpy(x)
    _same(m, xt)
    _same(m, xt[:1])
    _same(m, xt[5:9])


def test_ties_go_to_the_lowest_index_across_groups_and_threads(lib):
    """One row of weights everywhere: every output of a row is equal, so the argmax is 0; two equal best rows far
    apart (different groups): the first."""
    cols = 32
    d = np.float16(0.01)
    row = np.concatenate([np.frombuffer(d.tobytes(), np.uint8), np.arange(32, dtype=np.int8).view(np.uint8)])
    raw = np.tile(row, (5000, 1))  # [5000, 34]
    m = QMatrix.from_gguf_bytes("Q8_0", 5000, cols, raw)
    x = torch.ones(3, cols)
    _same(m, x)
    assert m.argmax(x).tolist() == [0, 0, 0]
    best = row.copy()
    best[2:] = np.full(32, 100, np.int8).view(np.uint8)
    raw[[1500, 4100]] = best
    m = QMatrix.from_gguf_bytes("Q8_0", 5000, cols, raw)
    _same(m, x)
    assert m.argmax(x).tolist() == [1500] * 3


def test_infinities_and_nan_as_torch_orders_them(lib):
    """F32 weights with inf/-inf/NaN: +inf beats every number (the first +inf wins), a NaN beats everything (the
    first NaN wins), a row of -inf gives 0."""
    rows, cols = 2100, 32
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    w[:, 1:] = 0
    cases = {"inf": ([700, 1800], [float("inf")] * 2), "nan": ([1900, 900, 2000], [float("nan"), 1e30, float("nan")]),
             "nan-vs-inf": ([100, 1200], [float("inf"), float("nan")])}
    x = torch.zeros(2, cols)
    x[:, 0] = torch.tensor([1.0, -1.0])
    for where, values in cases.values():
        wc = w.clone()
        wc[where, 0] = torch.tensor(values)
        m = QMatrix.from_gguf_bytes("F32", rows, cols, wc.numpy())
        _same(m, x)
    m = QMatrix.from_gguf_bytes("F32", rows, cols, torch.full((rows, cols), float("-inf")).numpy())
    _same(m, torch.ones(1, cols))
    assert m.argmax(torch.ones(1, cols)).tolist() == [0]


def test_a_gemma_sized_vocabulary(lib):
    """262,144 Q8_0 rows (Gemma 3's LM head's count; 64 columns here), 1 and 4 activation rows: the same ids."""
    rng = np.random.default_rng(0)
    rows, cols = 262144, 64
    raw = random_gguf("Q8_0", rows, cols, rng)
    m = QMatrix.from_gguf_bytes("Q8_0", rows, cols, raw)
    x = torch.from_numpy(rng.standard_normal((4, cols)).astype(np.float32))
    _same(m, x)
    _same(m, x[:1])


def test_argmax_checks_its_input(lib):
    m, _ = _matrix("Q8_0", 20, 1)
    with pytest.raises(ValueError, match="argmax: expected float32"):
        m.argmax(torch.zeros(2, 33))
    with pytest.raises(ValueError, match="argmax: expected float32"):
        m.argmax(torch.zeros(2, 32, dtype=torch.float64))
    assert m.argmax(torch.zeros(0, 32)).shape == (0,)
    assert m.argmax(torch.zeros(3, 2, 32)).shape == (3, 2)
