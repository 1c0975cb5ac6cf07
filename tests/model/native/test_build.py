"""Building the engine: every csrc/*.c is a unit (ISA paths only on their architecture, with their flags), the
library built into the package is used when it was built from the sources beside it for this machine (else the
runtime build, logged). setup.py builds through the same table; the wheel itself is built and tried by .ci/run."""

from __future__ import annotations

import json
import logging
import platform
import shutil
from pathlib import Path

import pytest

from flowspec_p2p import env
from flowspec_p2p.model.native import _build, _lib


@pytest.fixture
def csrc(tmp_path, monkeypatch) -> Path:
    """A copy of csrc/ that _build reads instead of the real one."""
    folder = tmp_path / "csrc"
    shutil.copytree(_build.CSRC, folder)
    monkeypatch.setattr(_build, "CSRC", folder)
    return folder


def test_every_source_is_a_unit_and_isa_paths_build_only_for_their_architecture(csrc):
    (csrc / "qwen3.c").write_text("int fs_qwen3;\n")  # a new common source is picked up as it is
    (csrc / "qwen3_neon.c").write_text("int fs_qwen3_neon;\n")  # a new ISA path: only on aarch64, with its flags
    x86, arm = _build.units_for("x86_64"), _build.units_for("aarch64")
    common = {u.source for u in x86 if not u.flags}
    assert common == {u.source for u in arm} - {"kern_neon.c", "qwen3_neon.c"}
    assert {"api.c", "layers.c", "kern_portable.c", "qwen3.c"} <= common
    assert not any(u.source.endswith("_neon.c") for u in x86)
    assert [u.source for u in x86 if u.flags] == ["kern_avx2.c", "kern_avx512.c", "kern_avx512.c"]
    assert "-mavx512vnni" in x86[-1].flags
    assert "-mavx512vnni" not in x86[-2].flags
    assert {u.source for u in arm if u.source.endswith("_neon.c")} == {"kern_neon.c", "qwen3_neon.c"}
    assert {u.source for u in _build.units_for("riscv64")} == common  # elsewhere: the portable path alone


def test_the_sources_digest_follows_every_file(csrc):
    units = _build.units_for("x86_64")
    before = _build.sources_digest(units)
    (csrc / "fs_internal.h").write_text((csrc / "fs_internal.h").read_text() + "\n")
    assert _build.sources_digest(units) != before


def test_a_packaged_library_is_used_only_when_built_from_these_sources_here(csrc, tmp_path):
    folder = tmp_path / "pkg"
    folder.mkdir()
    assert _build.packaged_library(folder)[1].endswith("(a source checkout)")
    (folder / _build.LIBRARY).write_bytes(b"")
    digest = _build.sources_digest(_build.units_for(platform.machine()))
    info = folder / _build.BUILD_INFO
    info.write_text(json.dumps({"digest": digest, "arch": "sparc"}))
    assert "built for sparc" in _build.packaged_library(folder)[1]
    info.write_text(json.dumps({"digest": digest, "arch": platform.machine().lower()}))
    assert _build.packaged_library(folder) == (folder / _build.LIBRARY, "")
    (csrc / "api.c").write_text((csrc / "api.c").read_text() + "/* edited */\n")
    assert "(stale)" in _build.packaged_library(folder)[1]


def test_the_packaged_library_is_loaded_before_any_build(lib, monkeypatch, caplog):
    built = _build.build(_lib.CACHE_DIR or _lib.default_cache_dir(), env.compiler())  # the session's, cached
    monkeypatch.setattr(_build, "packaged_library", lambda: (built, ""))
    monkeypatch.setattr(_build, "build", lambda *a: pytest.fail("built although a packaged library was there"))
    assert _lib._load_or_none(None) is not None
    monkeypatch.setattr(_build, "packaged_library", lambda: (None, "no libfsnative.so here (a source checkout)"))
    monkeypatch.setattr(_build, "build", lambda *a: built)
    with caplog.at_level(logging.INFO, logger=_lib.log.name):
        assert _lib._load_or_none(None) is not None
    assert "compiling the native engine's sources at run time" in caplog.text
