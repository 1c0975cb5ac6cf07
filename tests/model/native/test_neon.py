"""The NEON path: the engine's C sources plus tests/neon_driver.c cross-compiled for aarch64 and run under qemu
user-mode emulation. Checks, for every type: dequantization equals gguf bit for bit, the matmul matches the
float64 reference, is batch invariant (row by row and 2 threads give the same bits), and equals the host
library's bits; and a layer stack with a tree mask equals the host's bits. Skipped (with the reason) where the
cross tools are missing: tests/install_cross.sh installs them."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from flowspec_p2p.model import native
from flowspec_p2p.model.native import _build

from .layer_reference import NAMES, TinyModel, rope_tables
from .reference import ALL_TYPES, block_cols, gguf_dequant, matmul_refs, random_gguf
from .test_layers import QUANT_TYPES, _tree_mask

CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"
DRIVER = Path(__file__).with_name("neon_driver.c")

pytestmark = pytest.mark.skipif(
    shutil.which(CROSS_CC) is None or shutil.which(QEMU) is None,
    reason=f"needs {CROSS_CC} and {QEMU} (run tests/install_cross.sh)")


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    """The cross-compiled driver (built once per test session)."""
    out = tmp_path_factory.mktemp("neon")
    objects = _build.compile_objects(CROSS_CC, _build.units_for("aarch64"), out)
    exe = out / "neon_driver"
    subprocess.run([CROSS_CC, *_build.COMMON_FLAGS, f"-I{_build.CSRC}", str(DRIVER), *map(str, objects), "-o",
                    str(exe), "-pthread", "-lm"], check=True, capture_output=True, text=True, timeout=300)
    return exe


def _run(driver: Path, tmp: Path, payload: bytes) -> bytes:
    (tmp / "in.bin").write_bytes(payload)
    proc = subprocess.run([QEMU, "-L", SYSROOT, str(driver), str(tmp / "in.bin"), str(tmp / "out.bin")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return (tmp / "out.bin").read_bytes()


def _i32(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def _f32(a) -> bytes:
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).tobytes()


def test_neon_matmul_every_type(lib, driver, tmp_path):
    rng = np.random.default_rng(7)
    cases, payload = [], b""
    for type_name in ALL_TYPES:
        rows, cols, n = 21, 2 * block_cols(type_name), 6
        raw = random_gguf(type_name, rows, cols, rng)
        x = (rng.standard_normal((n, cols)) * 3).astype(np.float32)
        cases.append((type_name, rows, cols, n, raw, x))
        payload += _i32(1, native.TYPES[type_name].id, rows, cols, n) + _i32(native.TYPES[type_name].id)
        payload += raw.tobytes() + x.tobytes()
    out = np.frombuffer(_run(driver, tmp_path, payload), dtype=np.float32)
    at = 0
    for type_name, rows, cols, n, raw, x in cases:
        deq, at = out[at:at + rows * cols].reshape(rows, cols), at + rows * cols
        ys = []
        for _ in range(3):
            ys.append(out[at:at + n * rows].reshape(n, rows))
            at += n * rows
        assert np.array_equal(deq.view(np.uint32), gguf_dequant(type_name, raw, rows, cols).view(np.uint32))
        ref_q, tol_q, _, _ = matmul_refs(type_name, raw, rows, cols, x)
        assert np.all(np.abs(ys[0] - ref_q) <= tol_q), type_name
        assert np.array_equal(ys[0], ys[1]), type_name  # row by row
        assert np.array_equal(ys[0], ys[2]), type_name  # 2 threads
        host = native.QMatrix.from_gguf_bytes(type_name, rows, cols, raw).matmul(torch.from_numpy(x)).numpy()
        assert np.array_equal(ys[0].view(np.uint32), host.view(np.uint32)), type_name
    assert at == out.size


def test_neon_layer_stack_tree_equals_host_bits(lib, driver, tmp_path):
    m = TinyModel(types=QUANT_TYPES, bias=True, seed=3)
    prefix, parents, cap = 4, [-1, 0, 0, 1, 2, -1], 16
    n = len(parents)
    stack = m.stack()
    k_cache, v_cache = stack.new_cache(cap)
    torch.manual_seed(0)
    k_cache.normal_()
    v_cache.normal_()
    x = torch.randn(n, m.hidden)
    pos = torch.arange(prefix, prefix + n, dtype=torch.int32)
    cos, sin = rope_tables(cap, m.head_dim)
    mask = _tree_mask(prefix, parents)
    payload = _i32(2, m.hidden, m.q_heads, m.kv_heads, m.head_dim, m.intermediate, m.n_layers, n, prefix, cap, cap,
                   1, 1, 1) + struct.pack("<f", m.eps)
    for layer, raws in zip(m.layers, m.raw, strict=True):
        for name in NAMES:
            payload += _i32(native.TYPES[m.types[name]].id) + raws[name].tobytes()
        payload += b"".join(_f32(layer[k]) for k in ("attn_norm", "mlp_norm", "q_bias", "k_bias", "v_bias"))
    payload += b"".join(_f32(t) for t in (x, ))
    payload += pos.numpy().astype(np.int32).tobytes()
    payload += b"".join(_f32(t) for t in (cos, sin, k_cache, v_cache)) + mask.numpy().astype(np.uint8).tobytes()
    out = np.frombuffer(_run(driver, tmp_path, payload), dtype=np.float32)
    y = x.clone()
    stack.forward(y, pos, cos, sin, k_cache, v_cache, start=prefix, mask=mask)
    want = np.concatenate([y.numpy().ravel(), k_cache.numpy().ravel(), v_cache.numpy().ravel()])
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
