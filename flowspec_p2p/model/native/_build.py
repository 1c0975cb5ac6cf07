"""Compiling the engine's C sources (csrc/) into one shared library, cached by a digest of sources and flags.

Each ISA path is its own translation unit with its own flags (so the library loads on any CPU of its architecture
and picks a path at run time); the common flags forbid float contraction and fast-math, which the numerics rely on
(fs_internal.h). Several processes may build at once: each builds in a private temporary directory and renames
the result into place.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ... import env

CSRC = Path(__file__).with_name("csrc")
def default_cache_dir() -> Path:
    """Where the library is built: the package's cache folder (env.py), ``native/``."""
    return env.cache_dir() / "native"
BUILD_TIMEOUT_S = 300

COMMON_FLAGS = ("-O3", "-std=c11", "-fPIC", "-pthread", "-Wall", "-Wextra", "-ffp-contract=off", "-fno-math-errno",
                "-fvisibility=hidden", "-D_POSIX_C_SOURCE=200809L")
AVX512_FLAGS = ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
LINK_FLAGS = ("-shared", "-pthread", "-lm")


@dataclass(frozen=True)
class Unit:
    """One translation unit: a source file compiled with extra flags."""

    source: str
    flags: tuple[str, ...] = ()


COMMON_UNITS = (Unit("formats.c"), Unit("api.c"), Unit("pool.c"), Unit("layers.c"), Unit("kern_portable.c"))
X86_UNITS = (Unit("kern_avx2.c", ("-mavx2", "-mfma", "-mf16c")),
             Unit("kern_avx512.c", AVX512_FLAGS),
             Unit("kern_avx512.c", (*AVX512_FLAGS, "-mavx512vnni", "-DFS_VNNI=1")))
ARM64_UNITS = (Unit("kern_neon.c"),)


def units_for(arch: str) -> tuple[Unit, ...]:
    """The translation units for a machine architecture (platform.machine() spelling)."""
    arch = arch.lower()
    if arch in ("x86_64", "amd64"):
        return COMMON_UNITS + X86_UNITS
    if arch in ("aarch64", "arm64"):
        return COMMON_UNITS + ARM64_UNITS
    return COMMON_UNITS


def find_compiler(compiler: str | None = None) -> str:
    """The C compiler to use: the argument, else $CC (env.py), else cc. Raises FileNotFoundError."""
    name = compiler or env.compiler()
    path = shutil.which(name)
    if path is None:
        raise FileNotFoundError(f"no C compiler {name!r} on PATH")
    return path


def _digest(cc: str, units: tuple[Unit, ...]) -> str:
    h = hashlib.sha256()
    for f in sorted(CSRC.glob("*.[ch]")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update(repr((units, COMMON_FLAGS, LINK_FLAGS, platform.machine())).encode())
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    h.update(version.encode())
    return h.hexdigest()[:16]


def compile_objects(cc: str, units: tuple[Unit, ...], out_dir: Path, extra: tuple[str, ...] = ()) -> list[Path]:
    """Compiles every unit into out_dir (in parallel) -> the object files. Raises subprocess.CalledProcessError."""
    jobs = []
    for i, u in enumerate(units):
        obj = out_dir / f"{i}-{Path(u.source).stem}.o"
        cmd = [cc, *COMMON_FLAGS, *extra, *u.flags, "-c", str(CSRC / u.source), "-o", str(obj)]
        jobs.append((cmd, obj, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    objects = []
    for cmd, obj, proc in jobs:
        _, err = proc.communicate(timeout=BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, cmd, stderr=err)
        objects.append(obj)
    return objects


def build(cache_dir: Path | None = None, compiler: str | None = None) -> Path:
    """Builds the library into cache_dir (default: default_cache_dir()) unless already there -> its path.
    Raises OSError (no compiler, unwritable directory) or subprocess.SubprocessError (the build failed)."""
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cc = find_compiler(compiler)
    units = units_for(platform.machine())
    path = directory / f"libfsnative-{_digest(cc, units)}.so"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".build-") as tmp:
        objects = compile_objects(cc, units, Path(tmp))
        lib = Path(tmp) / "lib.so"
        subprocess.run([cc, "-o", str(lib), *map(str, objects), *LINK_FLAGS], check=True, capture_output=True,
                       text=True, timeout=BUILD_TIMEOUT_S)
        os.replace(lib, path)
    return path
