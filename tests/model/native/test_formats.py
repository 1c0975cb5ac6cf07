"""Packing and dequantization: fs_dequant_rows of a packed matrix equals gguf.quants.dequantize bit for bit, for
every type, on awkward shapes; packed sizes stay within a few percent of the GGUF size."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from flowspec_p2p.model.native import TYPES, QMatrix, q8_0_bytes, quantize_q8_0

from .reference import ALL_TYPES, block_cols, gguf_dequant, random_gguf

SHAPES = [(1, 1), (16, 2), (17, 1), (40, 3)]  # (rows, cols in blocks)


@pytest.mark.parametrize("type_name", ALL_TYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_dequant_rows_equals_gguf_bit_for_bit(lib, type_name, shape):
    rows, cols = shape[0], shape[1] * block_cols(type_name)
    rng = np.random.default_rng(zlib.crc32(f"{type_name}{shape}".encode()))
    raw = random_gguf(type_name, rows, cols, rng)
    m = QMatrix.from_gguf_bytes(type_name, rows, cols, raw)
    ids = torch.from_numpy(rng.permutation(rows))
    got = m.rows_f32(ids).numpy()
    want = gguf_dequant(type_name, raw, rows, cols)[ids.numpy()]
    assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist()


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_dequant_of_quantized_floats_equals_gguf(lib, type_name):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((33, 96)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType[type_name])
    got = QMatrix.from_gguf_bytes(type_name, 33, 96, raw).rows_f32(torch.arange(33)).numpy()
    assert np.array_equal(got.view(np.uint32), gguf_dequant(type_name, raw, 33, 96).view(np.uint32))


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_packed_size_is_within_three_percent_of_gguf(lib, type_name):
    rows, cols = 576, 1536
    packed = lib.fs_packed_size(TYPES[type_name].id, rows, cols)
    assert TYPES[type_name].gguf_nbytes(rows, cols) <= packed <= 1.03 * TYPES[type_name].gguf_nbytes(rows, cols)


def test_q8_0_quantizer_matches_gguf_bit_for_bit(lib):
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((20, 128)) * rng.uniform(0.01, 3, (20, 1))).astype(np.float32)
    w[3, :32] = 0  # an all-zero block
    w[4, 5] = 127.5 * np.abs(w[4, :32]).max() / 127  # a tie at .5 after scaling
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        t = torch.from_numpy(w).to(dtype)
        want = quantize(t.to(torch.float32).numpy(), GGMLQuantizationType.Q8_0)
        assert np.array_equal(q8_0_bytes(t), want)
    assert quantize_q8_0(torch.from_numpy(w)).type_name == "Q8_0"


def test_bad_sizes_are_rejected_before_the_c_call(lib):
    with pytest.raises(ValueError, match="expected 160 bytes"):
        QMatrix.from_gguf_bytes("Q4_1", 4, 64, np.zeros(10, np.uint8))
    with pytest.raises(ValueError, match="not a multiple of the block size"):
        QMatrix.from_gguf_bytes("Q4_K", 4, 64, np.zeros(4 * 144, np.uint8))  # 64 columns: not a K block
    with pytest.raises(ValueError, match="not supported"):
        QMatrix.from_gguf_bytes("IQ2_XXS", 4, 256, np.zeros(4 * 66, np.uint8))
    m = QMatrix.from_gguf_bytes("Q8_0", 4, 32, np.zeros(4 * 34, np.uint8))
    with pytest.raises(ValueError, match="expected float32"):
        m.matmul(torch.zeros(2, 31))
    with pytest.raises(ValueError, match="expected float32"):
        m.matmul(torch.zeros(2, 32, dtype=torch.float64))
    with pytest.raises(IndexError):
        m.rows_f32(torch.tensor([4]))
