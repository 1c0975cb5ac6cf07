"""The few-row float32 matmul kernel (csrc/fewrow.c): built with the system C compiler on first use, cached, and
called through ctypes (which releases the GIL for the call).

A matmul of 1-32 rows against a weight matrix is memory-bound on a CPU: the kernel reads each weight once for all
rows, so on this project's CPU 4 or 6 rows cost what one row does (MKL's sgemm costs ~2.4x, oneDNN with packed
weights ~1.6x; the default model's layers, `python -m flowspec_p2p.model.kernels`). That is what makes a tree forward,
or a pipeline segment of several nodes, about as cheap as decoding one token.

Needs an x86-64 CPU with AVX2 and FMA and a C compiler (``$CC``, default ``cc``); anywhere else ``library()`` is
None and shard.py keeps oneDNN. The shared object goes to ``$FLOWSPEC_CACHE_DIR`` (default
``~/.cache/flowspec_p2p``), named by a digest of the source and the flags, and is checked against torch before use.
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

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "fewrow.c"
FLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC")
CACHE_ENV = "FLOWSPEC_CACHE_DIR"
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


def cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flowspec_p2p"


def supported() -> bool:
    """Whether this CPU runs the kernel (x86-64 with AVX2 and FMA, which torch's AVX2 capability implies)."""
    return platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in (
        "AVX2", "AVX512")


def build(directory: Path, compiler: str | None = None) -> Path:
    """Compile the kernel into ``directory`` (once: the name is a digest of the source and flags) -> the .so.
    Raises OSError or subprocess.CalledProcessError."""
    cc = shutil.which(compiler or os.environ.get("CC") or "cc")
    if cc is None:
        raise FileNotFoundError(f"no C compiler ({compiler or os.environ.get('CC') or 'cc'}) on PATH")
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
        return load(build(cache_dir()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or ""
        log.warning("few-row kernel unavailable (%s%s); few-row matmuls use oneDNN (slower for 2-32 rows)",
                    e, f": {detail.strip()[:300]}" if detail else "")
        return None


def _main() -> None:
    """Time the kernel against MKL and oneDNN on one quarter of the default model's layer shapes, one thread; then a
    stage forward through each backend (_stage)."""
    import statistics
    import sys
    import time

    from .shard import FEWROW, ONEDNN

    torch.set_num_threads(1)
    shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 7  # 7 SmolLM2-135M layers: qkv, o, gate|up, down
    ws = [torch.randn(k, n) * 0.05 for k, n in shapes]
    copies = {b.name: [b.pack(w) for w in ws] for b in (ONEDNN, FEWROW)}

    def through(b):  # the backend's matmul over its copies; x: {k: [m, k]}
        return lambda x: [b.matmul(x[w.shape[0]], c) for w, c in zip(ws, copies[b.name], strict=True)]

    ways = {"mkl": lambda x: [x[w.shape[0]] @ w for w in ws], "onednn": through(ONEDNN), "fewrow": through(FEWROW)}
    times: dict[tuple[int, str], list[float]] = {}
    rows = (1, 2, 4, 6, 8, 16, 32)
    for _ in range(15):
        for m in rows:
            xs = {k: torch.randn(m, k) for k in (576, 1536)}
            for name, fn in ways.items():
                t = time.perf_counter()
                fn(xs)
                times.setdefault((m, name), []).append(time.perf_counter() - t)
    one = statistics.median(times[(1, "mkl")])
    for m in rows:
        cells = [f"{n} {statistics.median(times[(m, n)]) / one:.2f}x" for n in ways]
        sys.stdout.write(f"{m:2d} rows: {'  '.join(cells)} (of one row on MKL)\n")
    _stage()


def _stage() -> None:
    """Time a stage's tree forward (layers 8-14 of the default model, attention over a 200-token context included)
    through each backend of shard.py, interleaved, relative to one row on MKL."""
    import statistics
    import sys
    import time

    from ..types import LayerRange
    from .load import load_model
    from .shard import PACKED_ENV, Shard

    source = load_model(tokenizer=False).source
    hidden = source.config.hidden_size
    names = {"0": "mkl", "onednn": "onednn", "fewrow": "fewrow"}
    shards = {env: Shard.from_source(source, LayerRange(start=8, end=15), embed=False, head=False).eval()
              for env in names}  # one per backend: each keeps its own packed copy
    caches = {env: sh.new_cache(512) for env, sh in shards.items()}
    rows = (1, 2, 4, 6, 8, 16)
    times: dict[tuple[int, str], list[float]] = {}

    def forward(env: str, n: int) -> float:
        os.environ[PACKED_ENV] = env
        cache, ctx = caches[env], 200
        mask = torch.ones(1, n, ctx + n, dtype=torch.bool)  # [1, n, ctx + n]: the context, causal among the new
        mask[0, :, ctx:] = torch.ones(n, n, dtype=torch.bool).tril()
        t = time.perf_counter()
        shards[env](torch.randn(1, n, hidden), cache, positions=torch.arange(ctx, ctx + n)[None],
                    mask=mask if n > 1 else None)
        dt = time.perf_counter() - t
        cache.keep([])  # drop the new rows; the context stays
        return dt

    before = os.environ.get(PACKED_ENV)
    with torch.inference_mode():
        for env, sh in shards.items():
            os.environ[PACKED_ENV] = env
            sh(torch.randn(1, 200, hidden), caches[env])  # the context
            caches[env].commit(200)
            for n in rows:
                forward(env, n)  # packs, warms up
        for _ in range(12):
            for n in rows:
                for env in names:
                    times.setdefault((n, env), []).append(forward(env, n))
    if before is None:
        os.environ.pop(PACKED_ENV, None)
    else:
        os.environ[PACKED_ENV] = before
    one = statistics.median(times[(1, "0")])
    sys.stdout.write(f"a stage's forward (7 layers, 200-token context; one row on MKL: {one * 1e3:.1f} ms):\n")
    for n in rows:
        cells = [f"{name} {statistics.median(times[(n, env)]) / one:.2f}x" for env, name in names.items()]
        sys.stdout.write(f"{n:2d} rows: {'  '.join(cells)}\n")


if __name__ == "__main__":
    logging.basicConfig(format="%(message)s")
    if library() is None:
        raise SystemExit("the few-row kernel is not available here (see the warning above)")
    _main()
