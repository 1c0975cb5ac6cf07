"""The few-row float32 matmul kernel (csrc/fewrow.c): built with the system C compiler on first use, cached, and
called through ctypes (which releases the GIL for the call).

A matmul of 1-32 rows against a weight matrix is memory-bound on a CPU: the kernel reads each weight once for all
rows, so a few rows cost about what one row does (``python -m flowspec_p2p.bench.kernels`` measures it against MKL
and oneDNN). That is what makes a tree forward, or a pipeline segment of several nodes, about as cheap as decoding
one token.

Needs an x86-64 CPU with AVX2 and FMA and a C compiler (``$CC``, default ``cc``); anywhere else ``library()`` is
None and shard.py keeps oneDNN. The shared object goes to the cache folder (``env.cache_dir()``), named by a
digest of the source and the flags, and is checked against torch before use.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import env

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "fewrow.c"
FLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC")
WIDTH = 16  # the kernel's panel width (NR in fewrow.c)


@dataclass(frozen=True)
class Packed:
    """A weight [k, n] in the kernel's layout: panels [ceil(n / 16), k, 16], zero-padded."""

    panels: torch.Tensor
    k: int
    n: int


def pack(w_t: torch.Tensor) -> Packed:
    """w_t: [k, n] float32 (the [in, out] layout shard.py stores) -> its panels (a copy)."""
    k, n = w_t.shape
    pad = -n % WIDTH
    w = F.pad(w_t.detach(), (0, pad)) if pad else w_t.detach()  # [k, n + pad]
    panels = w.reshape(k, (n + pad) // WIDTH, WIDTH).permute(1, 0, 2).contiguous()  # [P, k, 16]
    return Packed(panels, k, n)


def matmul(x: torch.Tensor, w: Packed) -> torch.Tensor:
    """x: [..., k] float32 @ w -> [..., n]. Needs ``library()``."""
    lib = library()
    assert lib is not None, "fewrow kernel not available"
    return _matmul(lib, x, w)


def _matmul(lib: ctypes.CDLL, x: torch.Tensor, w: Packed) -> torch.Tensor:
    """matmul through a given build of the kernel. It trusts its pointers and sizes: they are checked here."""
    if x.dtype != torch.float32 or w.panels.dtype != torch.float32 or x.shape[-1] != w.k or x.device.type != "cpu":
        raise ValueError(f"fewrow.matmul: {x.dtype} {tuple(x.shape)} on {x.device} @ a packed "
                         f"{w.panels.dtype} [{w.k}, {w.n}]")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k).contiguous()  # [m, k]
    m = x2.shape[0]
    y = torch.empty(m, w.n, dtype=torch.float32)  # [m, n]
    lib.fewrow_matmul(x2.data_ptr(), m, w.k, w.panels.data_ptr(), w.n, y.data_ptr())
    return y.view(*lead, w.n)


def supported() -> bool:
    """Whether this CPU runs the kernel (x86-64 with AVX2 and FMA, which torch's AVX2 capability implies)."""
    return platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in (
        "AVX2", "AVX512")


def build(directory: Path, compiler: str | None = None) -> Path:
    """Compile the kernel into ``directory`` (once: the name is a digest of the source and flags) -> the .so.
    Raises OSError or subprocess.CalledProcessError."""
    cc = shutil.which(compiler or env.compiler())
    if cc is None:
        raise FileNotFoundError(f"no C compiler ({compiler or env.compiler()}) on PATH")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    path = directory / f"fewrow-{digest}.so"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)  # agents starting at once each build, then rename
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE)], check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load(path: Path) -> ctypes.CDLL:
    """Load a built kernel and check it against torch on awkward shapes. Raises OSError or RuntimeError."""
    lib = ctypes.CDLL(str(path))
    lib.fewrow_matmul.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p,
                                  ctypes.c_size_t, ctypes.c_void_p]
    lib.fewrow_matmul.restype = None
    if lib.fewrow_panel_width() != WIDTH:
        raise RuntimeError(f"{path}: panel width {lib.fewrow_panel_width()}, expected {WIDTH}")
    g = torch.Generator().manual_seed(0)
    for m, k, n in ((1, 37, 40), (7, 64, 16), (13, 5, 33)):
        x, w = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        if not torch.allclose(_matmul(lib, x, pack(w)), x @ w, atol=1e-4, rtol=1e-4):
            raise RuntimeError(f"{path}: wrong result for {m}x{k} @ {k}x{n}")
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built, checked kernel, or None where it cannot run here (logged once, with the reason)."""
    if not supported():
        log.info("few-row kernel: this CPU has no AVX2/FMA; few-row matmuls use oneDNN")
        return None
    try:
        return load(build(env.cache_dir()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or ""
        log.warning("few-row kernel unavailable (%s%s); few-row matmuls use oneDNN (slower for 2-32 rows)",
                    e, f": {detail.strip()[:300]}" if detail else "")
        return None
