"""The binding around the kernels: the build cache and the no-compiler fallback, fs_final and fs_rmsnorm, two
Python threads calling at once (serialized by the C side), the weight arena, thread and ISA control."""

from __future__ import annotations

import ctypes
import logging
import threading

import numpy as np
import pytest
import torch

from flowspec_p2p import env
from flowspec_p2p.model import native
from flowspec_p2p.model.native import QMatrix, WeightArena, _build, _lib

from .reference import random_gguf


def test_library_is_none_with_one_warning_when_no_compiler(lib, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with caplog.at_level(logging.WARNING, logger="flowspec_p2p.model.native._lib"):
        assert _lib._load_or_none(tmp_path, packaged=False) is None
    assert len(caplog.records) == 1
    assert "no-such-compiler-here" in caplog.records[0].getMessage()


def test_build_is_cached_by_digest(lib):
    """The session's library() already built into the cache: building again finds it, compiles nothing."""
    folder = _lib.CACHE_DIR or _lib.default_cache_dir()
    first = _build.build(folder, env.compiler())
    mtime = first.stat().st_mtime_ns
    assert _build.build(folder, env.compiler()) == first
    assert first.stat().st_mtime_ns == mtime
    assert first.name.startswith("libfsnative-")
    assert not list(first.parent.glob(".build-*/lib.so"))


def test_rmsnorm_and_final_match_torch(lib):
    rng = np.random.default_rng(0)
    raw = random_gguf("Q8_0", 70, 64, rng)
    head = QMatrix.from_gguf_bytes("Q8_0", 70, 64, raw)
    x = torch.randn(5, 64)
    w = torch.rand(64) + 0.5
    h = torch.empty(5, 64)
    assert lib.fs_rmsnorm(x.data_ptr(), w.data_ptr(), 5, 64, ctypes.c_float(1e-5), h.data_ptr()) == 0
    ref = x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert torch.allclose(h.double(), ref, rtol=1e-6, atol=1e-6)
    logits = torch.empty(5, 70)
    s = head.struct()
    assert lib.fs_final(x.data_ptr(), w.data_ptr(), 5, ctypes.c_float(1e-5), ctypes.byref(s), logits.data_ptr()) == 0
    assert torch.equal(logits, head.matmul(h))


def test_two_python_threads_calling_at_once_get_serial_results(lib):
    rng = np.random.default_rng(1)
    mats = [QMatrix.from_gguf_bytes(t, 300, 256, random_gguf(t, 300, 256, rng)) for t in ("Q4_1", "Q6_K")]
    xs = [torch.randn(7, 256) for _ in mats]
    want = [m.matmul(x) for m, x in zip(mats, xs, strict=True)]
    native.set_threads(2)
    errors = []

    def hammer(i: int) -> None:
        for _ in range(200):
            if not torch.equal(mats[i].matmul(xs[i]), want[i]):
                errors.append(i)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_matrices_in_an_arena_equal_standalone_ones(lib):
    rng = np.random.default_rng(2)
    shapes = [("Q4_1", 576, 576), ("Q8_0", 4000, 576), ("F16", 17, 64)]
    raws = [random_gguf(t, r, c, rng) for t, r, c in shapes]
    arena = WeightArena.for_matrices(shapes)
    packed = [QMatrix.from_gguf_bytes(*s, raw, arena=arena) for s, raw in zip(shapes, raws, strict=True)]
    for (t, r, c), raw, m in zip(shapes, raws, packed, strict=True):
        x = torch.randn(3, c)
        assert torch.equal(m.matmul(x), QMatrix.from_gguf_bytes(t, r, c, raw).matmul(x))
        assert m.packed.data_ptr() % 64 == 0
    with pytest.raises(ValueError, match="do not fit"):
        arena.take(1)


def test_thread_and_isa_controls(lib):
    assert native.set_threads(2) == 2
    assert native.threads() == 2
    assert native.set_threads(1) == 1
    with pytest.raises(ValueError, match="must be >= 1"):
        native.set_threads(0)
    assert native.isa() in native.available_isas()
    assert "portable" in native.available_isas()
    with pytest.raises(ValueError, match="not available"):
        native.set_isa("sve2")


def test_a_forked_child_computes_on_its_own_thread(lib):
    import os

    rng = np.random.default_rng(3)
    m = QMatrix.from_gguf_bytes("Q4_1", 200, 64, random_gguf("Q4_1", 200, 64, rng))
    x = torch.randn(9, 64)
    want = m.matmul(x)
    native.set_threads(2)
    m.matmul(x)  # the workers exist
    pid = os.fork()
    if pid == 0:  # the child: no workers, same results
        os._exit(0 if torch.equal(m.matmul(x), want) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
