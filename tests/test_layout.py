"""The package layout: the import-linter contract holds (layers, pure parts, the engine seam, no cycles), it catches
a layer violation, an engine class reached past the seam and a cycle planted in a copy of the package, and the size
rules hold."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "flowspec_p2p"
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def lint_available():
    if not LINT.exists():
        pytest.fail(f"{LINT} is missing: import-linter is a test dependency (pip install -e .[test])")


def test_the_layer_contract_holds(lint_available):
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "5 kept, 0 broken" in out.stdout


def test_the_contract_catches_a_layer_violation_and_a_cycle(lint_available, tmp_path):
    copy = tmp_path / "flowspec_p2p"
    shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("assets", "csrc", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with (copy / "model" / "arch.py").open("a") as f:  # the model core reaching up into the API
        f.write("\n\ndef _planted():\n    from ..api import app  # noqa\n")
    with (copy / "model" / "kv_cache.py").open("a") as f:  # torch_shard imports kv_cache: a cycle inside model/
        f.write("\n\ndef _planted():\n    from . import torch_shard  # noqa\n")
    with (copy / "speculative" / "verify.py").open("a") as f:  # an engine class reached past the seam
        f.write("\n\ndef _planted():\n    from ..model.native_shard import NativeShard  # noqa\n")
    with (copy / "cluster" / "device.py").open("a") as f:  # the control plane's data pulling in the engine
        f.write("\n\ndef _planted():\n    from ..model import load  # noqa\n")
    out = _lint(tmp_path, pythonpath=tmp_path)
    assert out.returncode != 0
    assert "flowspec_p2p.model is not allowed to import flowspec_p2p.api" in out.stdout
    assert "flowspec_p2p.model.arch -> flowspec_p2p.api" in out.stdout
    assert "No cycles are allowed in flowspec_p2p.model" in out.stdout
    assert "flowspec_p2p.cluster.device is not allowed to import torch" in out.stdout
    assert "flowspec_p2p.speculative.verify -> flowspec_p2p.model.native_shard" in out.stdout


def test_at_most_twelve_top_level_modules_and_none_over_500_lines():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 12, top
    long = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def test_every_subpackage_says_what_it_owns_and_may_import():
    for init in PKG.glob("*/__init__.py"):
        doc = init.read_text().strip()
        assert doc.startswith('"""'), f"{init.relative_to(ROOT)} needs a docstring"
        assert "May import" in doc, f"{init.relative_to(ROOT)}: say what it may import"
