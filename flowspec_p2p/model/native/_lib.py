"""Loading the engine with ctypes: the mirrors of csrc/fs.h's structs and signatures, a self-test on load, and
`library()`: the library built into the package at install time (_build.packaged_library), else, in a source checkout
without one (logged), the sources compiled at run time into the cache (_build.build); None (logging one warning with
the reason) where the engine can't be had, so callers fall back to torch.

ctypes releases the GIL for each call; the C side serializes compute calls with its own mutex.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import threading
from ctypes import POINTER, c_char_p, c_float, c_int, c_int32, c_int64, c_void_p
from pathlib import Path

import numpy as np

from ... import env
from . import _build

log = logging.getLogger(__name__)

CACHE_DIR: Path | None = None  # where library() builds at run time; None: default_cache_dir(). Set before first use.


def default_cache_dir() -> Path:
    """Where the library is built at run time: $FLOWSPEC_NATIVE_DIR, else the package's cache folder's ``native/``
    (env.py)."""
    return env.native_dir()


class FsMatrix(ctypes.Structure):
    _fields_ = [("data", c_void_p), ("type", c_int32), ("rows", c_int32), ("cols", c_int32)]


class FsLayer(ctypes.Structure):
    _fields_ = [("attn_norm", c_void_p), *[(n, FsMatrix) for n in ("q", "k", "v", "o", "gate", "up", "down")],
                ("q_bias", c_void_p), ("k_bias", c_void_p), ("v_bias", c_void_p), ("mlp_norm", c_void_p)]


class FsConfig(ctypes.Structure):
    _fields_ = [("hidden", c_int32), ("q_heads", c_int32), ("kv_heads", c_int32), ("head_dim", c_int32),
                ("intermediate", c_int32), ("eps", c_float)]


class FsGroup(ctypes.Structure):
    _fields_ = [("k_cache", c_void_p), ("v_cache", c_void_p), ("mask", c_void_p), ("row0", c_int64),
                ("n", c_int64), ("capacity", c_int64), ("start", c_int64)]


_SIGNATURES = {
    "fs_init": (c_int, [c_int]),
    "fs_threads": (c_int, []),
    "fs_isa": (c_char_p, []),
    "fs_isa_available": (c_int, [c_char_p]),
    "fs_set_isa": (c_int, [c_char_p]),
    "fs_packed_size": (c_int64, [c_int, c_int64, c_int64]),
    "fs_pack": (c_int, [c_int, c_int64, c_int64, c_void_p, c_void_p]),
    "fs_dequant_rows": (c_int, [c_int, c_int64, c_int64, c_void_p, c_void_p, c_int64, c_void_p]),
    "fs_matmul": (c_int, [c_int, c_int64, c_int64, c_void_p, c_void_p, c_int64, c_void_p]),
    "fs_matmul_argmax": (c_int, [c_int, c_int64, c_int64, c_void_p, c_void_p, c_int64, c_void_p]),
    "fs_rmsnorm": (c_int, [c_void_p, c_void_p, c_int64, c_int64, c_float, c_void_p]),
    "fs_final": (c_int, [c_void_p, c_void_p, c_int64, c_float, POINTER(FsMatrix), c_void_p]),
    "fs_quantize_act": (c_int, [c_void_p, c_int64, c_int64, c_void_p, c_void_p]),
    "fs_layers_forward": (c_int, [POINTER(FsConfig), POINTER(FsLayer), c_int, c_void_p, c_int64, c_void_p, c_void_p,
                                  c_void_p, c_int64, c_void_p, c_void_p, c_int64, c_int64, c_void_p,
                                  POINTER(c_int)]),
    "fs_layers_forward_groups": (c_int, [POINTER(FsConfig), POINTER(FsLayer), c_int, c_void_p, c_int64, c_void_p,
                                         c_void_p, c_void_p, c_int64, POINTER(FsGroup), c_int, POINTER(c_int)]),
    "fs_struct_size": (c_int64, [c_char_p]),
    "fs_advise_hugepages": (c_int, [c_void_p, c_int64]),
}


def load(path: Path) -> ctypes.CDLL:
    """Loads a built library, declares its signatures and runs the self-test. Raises OSError or RuntimeError."""
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    for struct in (FsMatrix, FsLayer, FsConfig, FsGroup):
        if lib.fs_struct_size(struct.__name__.replace("Fs", "fs_").lower().encode()) != ctypes.sizeof(struct):
            raise RuntimeError(f"{path}: struct {struct.__name__} differs from the C side")
    _self_test(lib, path)
    return lib


def _self_test(lib: ctypes.CDLL, path: Path) -> None:
    """A Q8_0 matmul of 3 rows against 20 x 64 random weights, against numpy (float64), on the chosen ISA."""
    rng = np.random.default_rng(0)
    rows, cols, n = 20, 64, 3
    d = (rng.uniform(0.5, 1.5, (rows, cols // 32, 1)) / 127).astype(np.float16)
    q = rng.integers(-127, 128, (rows, cols // 32, 32), dtype=np.int8)
    raw = np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=-1).reshape(rows, -1)
    packed = np.zeros(lib.fs_packed_size(8, rows, cols), np.uint8)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    y = np.zeros((n, rows), np.float32)
    if lib.fs_pack(8, rows, cols, raw.ctypes.data, packed.ctypes.data) != 0 or lib.fs_matmul(
            8, rows, cols, packed.ctypes.data, x.ctypes.data, n, y.ctypes.data) != 0:
        raise RuntimeError(f"{path}: self-test call failed")
    w = (d.astype(np.float64) * q).reshape(rows, cols)
    ref = x.astype(np.float64) @ w.T
    if not np.allclose(y, ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max()):
        raise RuntimeError(f"{path}: self-test gave wrong results on ISA {lib.fs_isa().decode()}")


_lock = threading.Lock()
_state: dict[str, ctypes.CDLL | None] = {}


def library(cache_dir: Path | None = None) -> ctypes.CDLL | None:
    """The loaded, self-tested engine, or None where it can't be had here (one warning says why).
    cache_dir overrides CACHE_DIR for the first call; later calls return the same library."""
    with _lock:
        if "lib" not in _state:
            _state["lib"] = _load_or_none(cache_dir if cache_dir is not None else CACHE_DIR)
        return _state["lib"]


def _load_or_none(cache_dir: Path | None, packaged: bool = True) -> ctypes.CDLL | None:
    """The packaged library (``packaged``), else one built at run time into cache_dir, else None (warned)."""
    if packaged:
        path, why = _build.packaged_library()
        if path is not None:
            try:
                return load(path)
            except (OSError, RuntimeError) as e:
                log.warning("the native engine built into the package does not load (%s); compiling its sources", e)
        else:
            log.info("%s: compiling the native engine's sources at run time (cached)", why)
    try:
        return load(_build.build(cache_dir if cache_dir is not None else default_cache_dir(), env.compiler()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        detail = (getattr(e, "stderr", None) or "").strip()
        log.warning("native engine unavailable (%s%s); falling back to torch", e,
                    f": {detail[:500]}" if detail else "")
        return None


def require() -> ctypes.CDLL:
    """library(), or RuntimeError when it is unavailable."""
    lib = library()
    if lib is None:
        raise RuntimeError("the native engine is unavailable here (see the warning logged by native.library())")
    return lib
