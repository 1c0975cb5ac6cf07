"""The build hook: the native engine (flowspec_p2p/model/native/csrc) compiled into the wheel.

Everything else about the package is in pyproject.toml. The engine is a plain shared library loaded with ctypes, not a
CPython extension, so one wheel per platform serves every Python 3 (tag py3-none-<platform>) and every CPU of its
architecture (each ISA path is its own translation unit; api.c picks one at run time). The translation units and
their flags come from flowspec_p2p/model/native/_build.py, the same table the runtime build of a source checkout
uses, so both builds give the same library. An editable install (``pip install -e .``) builds nothing here: the
checkout's sources change, and the runtime build (cached by their digest) follows them.

    CC=<compiler>   the C compiler (default ``cc``), as at run time
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

HERE = Path(__file__).resolve().parent
NATIVE = Path("flowspec_p2p", "model", "native")
ENGINE = "flowspec_p2p.model.native.libfsnative"


def _build_module():
    """native/_build.py, loaded by path (importing the package would need its dependencies)."""
    spec = importlib.util.spec_from_file_location("_flowspec_native_build", HERE / NATIVE / "_build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class BuildEngine(build_ext):
    """Builds ENGINE with native/_build.py's units and flags instead of setuptools' one-flag-set compile."""

    def get_ext_filename(self, fullname: str) -> str:
        # asked with the full name (setuptools) and with its last part (distutils' get_ext_fullpath)
        if fullname == ENGINE:
            return str(NATIVE / _build_module().LIBRARY)
        if fullname == ENGINE.rpartition(".")[2]:
            return _build_module().LIBRARY
        return super().get_ext_filename(fullname)

    def get_outputs(self) -> list[str]:
        build = _build_module()
        outputs = super().get_outputs()
        return [*outputs, *(str(Path(o).with_name(build.BUILD_INFO)) for o in outputs if o.endswith(build.LIBRARY))]

    def build_extension(self, ext: Extension) -> None:
        if ext.name != ENGINE:
            super().build_extension(ext)
            return
        if getattr(self, "editable_mode", False):
            self.announce("editable install: the native engine is compiled at first use (into the cache)", logging.INFO)
            return
        build = _build_module()
        out = Path(self.get_ext_fullpath(ext.name)).parent
        self.announce(f"compiling the native engine ({len(build.units_for(build.platform.machine()))} translation "
                      f"units) into {out}", logging.INFO)
        build.build_into(out, os.environ.get("CC") or "cc")


class PlatformWheel(bdist_wheel):
    """py3-none-<platform>: the library is loaded with ctypes and does not depend on the Python version."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self) -> tuple[str, str, str]:
        _, _, plat = super().get_tag()
        return "py3", "none", plat


setup(
    # optional: an editable install builds nothing (see above), and setuptools then has nothing to copy into the tree;
    # a failed compile still fails the build (BuildEngine raises what setuptools does not catch)
    ext_modules=[Extension(ENGINE, sources=sorted(str(p.relative_to(HERE)) for p in (HERE / NATIVE).glob("csrc/*.c")),
                           optional=True)],
    cmdclass={"build_ext": BuildEngine, "bdist_wheel": PlatformWheel},
)
