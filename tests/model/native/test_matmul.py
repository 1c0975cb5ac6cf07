"""fs_matmul for every type x every ISA path here: accuracy against float64 references (tight on the quantized
activations, looser on the raw ones), bitwise batch invariance (row r of an n-row call equals the 1-row call, for
n in 1..33, with 1 and 2 threads), and the same bits on every ISA path."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from flowspec_p2p.model import native
from flowspec_p2p.model.native import QMatrix

from .reference import ALL_TYPES, block_cols, matmul_refs, random_gguf

SHAPES = [(16, 1), (37, 2), (5, 1), (70, 3)]  # (rows, cols in blocks): rows not a multiple of 16, one block


def _case(type_name, rows, nblk, seed=0):
    cols = nblk * block_cols(type_name)
    rng = np.random.default_rng(zlib.crc32(f"{type_name}{rows}{nblk}{seed}".encode()))
    raw = random_gguf(type_name, rows, cols, rng)
    x = (rng.standard_normal((33, cols)) * rng.uniform(0.1, 10, (33, 1))).astype(np.float32)
    x[1, :32] = 0  # an all-zero activation block
    return QMatrix.from_gguf_bytes(type_name, rows, cols, raw), raw, x


@pytest.mark.parametrize("type_name", ALL_TYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matmul_matches_float64_references(isa, type_name, shape):
    m, raw, x = _case(type_name, *shape)
    y = m.matmul(torch.from_numpy(x)).numpy().astype(np.float64)
    ref_q, tol_q, ref_raw, tol_raw = matmul_refs(type_name, raw, m.rows, m.cols, x)
    assert np.all(np.abs(y - ref_q) <= tol_q), np.max(np.abs(y - ref_q) / tol_q)
    assert np.all(np.abs(y - ref_raw) <= tol_raw), np.max(np.abs(y - ref_raw) / tol_raw)


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_matmul_is_batch_invariant_bitwise(isa, type_name):
    m, _, x = _case(type_name, 37, 2, seed=1)
    xt = torch.from_numpy(x)
    alone = torch.cat([m.matmul(xt[r:r + 1]) for r in range(33)])  # [33, rows]
    for threads in (1, 2):
        native.set_threads(threads)
        for n in range(1, 34):
            assert torch.equal(m.matmul(xt[:n]), alone[:n]), (threads, n)
        assert torch.equal(m.matmul(xt[7:30]), alone[7:30])


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_many_rows_are_batch_invariant_across_chunks_and_threads(isa, type_name):
    m, _, x = _case(type_name, 70, 1, seed=2)
    rng = np.random.default_rng(3)
    xs = torch.from_numpy(np.concatenate([x] * 6))  # [198, cols]: several 64-row chunks
    rows = torch.from_numpy(np.sort(rng.choice(198, 12, replace=False)))
    alone = torch.cat([m.matmul(xs[int(r):int(r) + 1]) for r in rows])
    for threads in (1, 2):
        native.set_threads(threads)
        assert torch.equal(m.matmul(xs)[rows], alone)


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_every_isa_path_gives_the_same_bits(lib, type_name):
    m, _, x = _case(type_name, 37, 2, seed=4)
    results = {}
    for name in native.available_isas():
        native.set_isa(name)
        results[name] = m.matmul(torch.from_numpy(x))
    native.set_isa(None)
    first = next(iter(results.values()))
    assert all(torch.equal(first, y) for y in results.values()), list(results)


def test_default_model_shapes(lib):
    """A Q4_1 576 x 1536 matmul and a Q8_0 [49152 / 64, 576] head slice against the reference."""
    for type_name, rows, cols in (("Q4_1", 1536, 576), ("Q4_1", 576, 1536), ("Q8_0", 768, 576)):
        rng = np.random.default_rng(rows)
        raw = random_gguf(type_name, rows, cols, rng)
        x = rng.standard_normal((4, cols)).astype(np.float32)
        y = QMatrix.from_gguf_bytes(type_name, rows, cols, raw).matmul(torch.from_numpy(x)).numpy()
        ref_q, tol_q, _, _ = matmul_refs(type_name, raw, rows, cols, x)
        assert np.all(np.abs(y - ref_q) <= tol_q)


def test_activation_quantization_matches_the_numpy_definition(lib):
    from .reference import quantize_act
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((9, 96)) * rng.uniform(0.001, 100, (9, 1))).astype(np.float32)
    x[2, 32:64] = 0
    x[3, :32] = 1.5  # ties after scaling
    v = np.zeros((9, 96), np.int16)
    d = np.zeros((9, 3), np.float32)
    assert lib.fs_quantize_act(x.ctypes.data, 9, 96, v.ctypes.data, d.ctypes.data) == 0
    v_ref, d_ref = quantize_act(x)
    assert np.array_equal(v, v_ref)
    assert np.array_equal(d.view(np.uint32), d_ref.view(np.uint32))
