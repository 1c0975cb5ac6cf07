import logging
import subprocess

import pytest
import torch

from flowspec_p2p.env import CACHE_DIR
from flowspec_p2p.model import kernels as fewrow

needs_kernel = pytest.mark.skipif(fewrow.library() is None, reason="no AVX2/FMA CPU or no C compiler here")


@needs_kernel
@pytest.mark.parametrize(("m", "k", "n"), [(1, 576, 960), (2, 7, 16), (5, 33, 17), (6, 64, 48), (7, 1536, 576),
                                           (13, 40, 100), (32, 576, 49)])
def test_the_kernel_agrees_with_torch_for_any_rows_and_ragged_panels(m, k, n):
    """1-32 rows (several passes of 6), k not a multiple of anything, n not a multiple of the panel width (the last
    panel is partial): the product to float32 rounding."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    y = fewrow.matmul(x, fewrow.pack(w))
    assert y.shape == (m, n)
    assert torch.allclose(y, x @ w, atol=1e-4 * k**0.5, rtol=1e-4)


@needs_kernel
def test_leading_dims_and_non_contiguous_inputs_keep_their_shape():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 40, generator=g)
    x = torch.randn(1, 24, 3, generator=g).transpose(1, 2)  # [1, 3, 24], not contiguous
    y = fewrow.matmul(x, fewrow.pack(w))
    assert y.shape == (1, 3, 40)
    assert torch.allclose(y, x @ w, atol=1e-4)


@needs_kernel
def test_wrong_shapes_and_dtypes_are_refused_before_the_kernel_reads_memory():
    p = fewrow.pack(torch.randn(8, 16))
    with pytest.raises(ValueError, match=r"fewrow\.matmul"):
        fewrow.matmul(torch.randn(2, 9), p)  # k mismatch: the kernel would read past x
    with pytest.raises(ValueError, match=r"fewrow\.matmul"):
        fewrow.matmul(torch.randn(2, 8, dtype=torch.float64), p)


def test_pack_lays_columns_out_in_zero_padded_panels_of_16():
    w = torch.arange(3 * 20, dtype=torch.float32).reshape(3, 20)  # [k, n]
    p = fewrow.pack(w)
    assert (p.k, p.n) == (3, 20)
    assert p.panels.shape == (2, 3, 16)  # ceil(20 / 16) panels of [k, 16]
    assert torch.equal(p.panels[0], w[:, :16])
    assert torch.equal(p.panels[1, :, :4], w[:, 16:])
    assert not p.panels[1, :, 4:].any()


@needs_kernel
def test_a_build_is_cached_by_the_source_digest(tmp_path):
    first = fewrow.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert fewrow.build(tmp_path) == first  # found, not rebuilt
    assert first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind
    fewrow.load(first)


def test_without_a_compiler_the_build_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no C compiler"):
        fewrow.build(tmp_path, compiler="no-such-cc-anywhere")


@pytest.mark.skipif(not fewrow.supported(), reason="no AVX2/FMA CPU here")
def test_a_failed_build_falls_back_with_the_compilers_reason(tmp_path, monkeypatch, caplog):
    """A source that does not compile (or any build failure) leaves library() None, logged with the reason, and
    no half-written file behind: shard.py then uses oneDNN."""
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(fewrow, "SOURCE", bad)
    monkeypatch.setenv(CACHE_DIR, str(tmp_path / "cache"))
    with pytest.raises(subprocess.CalledProcessError):
        fewrow.build(tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir())
    fewrow.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="flowspec_p2p.model.kernels"):
            assert fewrow.library() is None
        assert "few-row kernel unavailable" in caplog.text
        assert "error" in caplog.text
    finally:
        fewrow.library.cache_clear()
