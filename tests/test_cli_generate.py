"""``flowspec generate`` end to end, as a user runs it: a subprocess on the packaged model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest


def _flowspec(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    exe = shutil.which("flowspec", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "flowspec_p2p"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the test suite shares its cores
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False)


@pytest.mark.slow
def test_generate_streams_the_reply_to_stdout_and_stats_to_stderr():
    r = _flowspec("generate", "Name a colour.", "--max-tokens", "8", "--stats")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "no reply on stdout"
    assert "{" not in r.stdout  # the stats line went to stderr, not into the reply
    stats = [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]
    assert len(stats) == 1, r.stderr
    s = stats[0]
    assert {"new_tokens", "steps", "tau", "prefill_s", "decode_s"} <= s.keys()
    assert 1 <= s["new_tokens"] <= 8
    assert s["mode"] == "auto"  # the default: it says what ran
    assert s["engine"].split()[0] in ("native", "torch")  # and on which engine
    assert s["auto"]["ar_tokens"] + s["auto"]["spec_tokens"] == s["new_tokens"] - 1  # the first: the prefill's
    assert s["steps"] <= s["new_tokens"]
    r = _flowspec("generate", "Name a colour.", "--max-tokens", "8", "--stats", "--mode", "ar")
    s = json.loads(r.stderr.splitlines()[-1])
    assert (s["mode"], s["tau"], s["steps"]) == ("ar", 1.0, s["new_tokens"])


@pytest.mark.slow
def test_a_bad_model_path_exits_1_with_a_clear_message(tmp_path):
    r = _flowspec("generate", "hi", "--model", str(tmp_path / "missing.gguf"))
    assert r.returncode == 1
    assert r.stdout == ""
    assert "missing.gguf does not exist" in r.stderr
    assert "Traceback" not in r.stderr


def test_the_cli_imports_only_what_generate_needs():
    """A one-device command must not pay for the cluster's stack (aiohttp, zeroconf, cryptography, transformers:
    each several MB of resident memory): the CLI builds every subcommand's parser, so command modules import
    their heavy parts inside ``run``."""
    code = ("import sys\nfrom flowspec_p2p import cli\ntry:\n    cli.main(['generate', '--help'])\n"
            "except SystemExit:\n    pass\n"
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    loaded = set(out.stdout.split())
    assert "flowspec_p2p" in loaded
    assert not loaded & {"aiohttp", "zeroconf", "cryptography", "transformers", "matplotlib", "uvloop"}


def test_the_cli_parser_loads_no_engine():
    """`flowspec cluster up` is a launcher that holds no model, and `chat` a client: building the parser (which
    every command does) must not load torch or numpy (~200 MB resident) on their behalf."""
    code = ("import sys\nfrom flowspec_p2p import cli\ncli.build_parser()\n"
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    loaded = set(out.stdout.split())
    assert "flowspec_p2p" in loaded
    assert not loaded & {"torch", "numpy", "transformers", "gguf"}


def test_tree_flags_override_the_tuned_tree(tmp_path, monkeypatch):
    from flowspec_p2p.cli import build_parser
    from flowspec_p2p.commands.generate import tree_shape
    from flowspec_p2p.speculative.decoder import DEFAULT_TREE

    monkeypatch.setenv("FLOWSPEC_CACHE_DIR", str(tmp_path))  # no tuning file: the shipped default
    parse = build_parser().parse_args
    assert tree_shape(parse(["generate", "hi"]), "fp") == DEFAULT_TREE
    shape = tree_shape(parse(["generate", "hi", "--tree-tokens", "6", "--tree-depth", "3", "--tree-lookup", "5"]), "fp")
    assert (shape.total_tokens, shape.depth, shape.top_k, shape.lookup_depth) == (6, 3, DEFAULT_TREE.top_k, 5)
    assert tree_shape(parse(["generate", "hi", "--tree-depth", "3", "--tree-lookup", "-1"]), "fp").lookup_depth == 3
