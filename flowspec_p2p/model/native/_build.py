"""Compiling the engine's C sources (csrc/) into one shared library: at install time into the wheel (setup.py's
build_ext calls ``build_into``), and at run time into a cache folder, by a digest of sources and flags, for a source
checkout without a built library (``build``).

Every ``csrc/*.c`` is a translation unit. A file whose name ends in ``_avx2.c``, ``_avx512.c`` or ``_neon.c`` is an
ISA path: compiled only for its architecture, with its ISA's flags (kern_avx512.c a second time with VNNI, its
symbols renamed by FS_VNNI), so the library loads on any CPU of its architecture and picks a path at run time
(api.c). The common flags forbid float contraction and fast-math, which the numerics rely on (fs_internal.h).

Standard library only, and no import of the package: setup.py loads this file by path in the build's isolated
environment (no torch, no numpy). Several processes may build at once: each builds in a private temporary directory
and renames the result into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
LIBRARY = "libfsnative.so"  # the library built into the package (beside this file)
BUILD_INFO = "libfsnative.json"  # beside it: {"digest": sources_digest(...), "arch": ...}
BUILD_TIMEOUT_S = 300

COMMON_FLAGS = ("-O3", "-std=c11", "-fPIC", "-pthread", "-Wall", "-Wextra", "-ffp-contract=off", "-fno-math-errno",
                "-fvisibility=hidden", "-D_POSIX_C_SOURCE=200809L")
AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
AVX512_FLAGS = (*AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
LINK_FLAGS = ("-shared", "-pthread", "-lm")

X86 = ("x86_64", "amd64")
ARM64 = ("aarch64", "arm64")
# an ISA path's file suffix -> (the architectures it is built for, the flag sets it is built with: one unit each)
ISA_PATHS = {
    "_avx2": (X86, (AVX2_FLAGS,)),
    "_avx512": (X86, (AVX512_FLAGS,)),
    "_neon": (ARM64, ((),)),
}
# files built more than once: the VNNI variant of the AVX-512 matmul (FS_VNNI renames its symbols)
EXTRA_VARIANTS = {"kern_avx512.c": ((*AVX512_FLAGS, "-mavx512vnni", "-DFS_VNNI=1"),)}


@dataclass(frozen=True)
class Unit:
    """One translation unit: a source file compiled with extra flags."""

    source: str
    flags: tuple[str, ...] = ()


def sources() -> list[str]:
    """The C sources in csrc/, sorted."""
    return sorted(f.name for f in CSRC.glob("*.c"))


def units_for(arch: str) -> tuple[Unit, ...]:
    """The translation units for a machine architecture (platform.machine() spelling): every common source, then
    the ISA paths built for ``arch``."""
    arch = arch.lower()
    common, isa = [], []
    for name in sources():
        stem = name.removesuffix(".c")
        suffix = next((s for s in ISA_PATHS if stem.endswith(s)), None)
        if suffix is None:
            common.append(Unit(name))
            continue
        arches, flag_sets = ISA_PATHS[suffix]
        if arch in arches:
            isa += [Unit(name, flags) for flags in (*flag_sets, *EXTRA_VARIANTS.get(name, ()))]
    return (*common, *isa)


def find_compiler(name: str = "cc") -> str:
    """The C compiler ``name`` on PATH -> its path. Raises FileNotFoundError."""
    path = shutil.which(name)
    if path is None:
        raise FileNotFoundError(f"no C compiler {name!r} on PATH")
    return path


def sources_digest(units: tuple[Unit, ...]) -> str:
    """A digest of every csrc/ file, the units and the flags: what a built library was built from."""
    h = hashlib.sha256()
    for f in sorted(CSRC.glob("*.[ch]")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update(repr((units, COMMON_FLAGS, LINK_FLAGS)).encode())
    return h.hexdigest()[:16]


def _digest(cc: str, units: tuple[Unit, ...]) -> str:
    """sources_digest plus the machine and the compiler's version: the runtime cache's key."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    h = hashlib.sha256(f"{sources_digest(units)}\0{platform.machine()}\0{version}".encode())
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


def link(cc: str, objects: list[Path], out: Path) -> None:
    subprocess.run([cc, "-o", str(out), *map(str, objects), *LINK_FLAGS], check=True, capture_output=True, text=True,
                   timeout=BUILD_TIMEOUT_S)


def build_into(folder: Path, compiler: str = "cc", arch: str | None = None) -> Path:
    """Builds the library for ``arch`` (default: this machine) into ``folder`` as LIBRARY, with BUILD_INFO beside
    it -> the library's path. What setup.py's build_ext runs. Raises OSError or subprocess.SubprocessError."""
    cc = find_compiler(compiler)
    arch = arch or platform.machine()
    units = units_for(arch)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fsnative-build-") as tmp:
        lib = Path(tmp) / LIBRARY
        link(cc, compile_objects(cc, units, Path(tmp)), lib)
        shutil.copyfile(lib, folder / LIBRARY)
    (folder / BUILD_INFO).write_text(json.dumps({"digest": sources_digest(units), "arch": arch.lower()}) + "\n")
    return folder / LIBRARY


def packaged_library(folder: Path | None = None) -> tuple[Path | None, str]:
    """The library built into the package (``folder``: default this file's), if it was built from the csrc/ beside
    it for this machine -> (its path, "") or (None, why not)."""
    folder = folder or Path(__file__).parent
    lib, info = folder / LIBRARY, folder / BUILD_INFO
    if not lib.is_file():
        return None, f"no {LIBRARY} in {folder} (a source checkout)"
    try:
        built = json.loads(info.read_text())
    except (OSError, ValueError) as e:
        return None, f"{info} is unreadable ({e})"
    if built.get("arch") != platform.machine().lower():
        return None, f"{lib} was built for {built.get('arch')}, not {platform.machine()}"
    if CSRC.is_dir() and built.get("digest") != sources_digest(units_for(platform.machine())):
        return None, f"{lib} was built from other sources than {CSRC} (stale)"
    return lib, ""


def build(cache_dir: Path, compiler: str = "cc") -> Path:
    """Builds the library into cache_dir unless already there -> its path. Raises OSError (no compiler, unwritable
    directory) or subprocess.SubprocessError (the build failed)."""
    directory = Path(cache_dir)
    cc = find_compiler(compiler)
    units = units_for(platform.machine())
    path = directory / f"libfsnative-{_digest(cc, units)}.so"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".build-") as tmp:
        lib = Path(tmp) / "lib.so"
        link(cc, compile_objects(cc, units, Path(tmp)), lib)
        os.replace(lib, path)
    return path
