"""Paths as a benchmark records them: relative to the repository, so a result says nothing of the machine it ran on.

A recorded result (results.json, its .md, run.json) names files: the model, the draft head, llama.cpp's binaries, the
output folder, and the command lines of the processes it measured. Each absolute path becomes

    under the repository       relative to it                       docs/figures/engine, .venv/lib/.../x.gguf
    under the temp folder      $TMPDIR/...                          $TMPDIR/flowspec-cluster-1a2b/agent0
    under the home folder      ~/...                                ~/.cache/flowspec_p2p/drafts/x-eagle
    anywhere else              relative to the repository           ../llama.cpp/build/bin/llama-bench

Relative paths are kept as they are. Standard library only (rpc_compare's client imports it).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

# an absolute path inside a command line: a word that starts with "/" (at the start, or after a space, "=" or a quote)
_ABSOLUTE_WORD = re.compile(r"""(?:^|(?<=[\s='"]))/[^\s'"]+""")


def repo_root() -> Path:
    """The repository this package runs from (the folder with pyproject.toml above the package), else the
    working folder (an installed copy: results are written relative to where the benchmark runs)."""
    here = Path(__file__).resolve().parents[2]
    return here if (here / "pyproject.toml").is_file() else Path.cwd().resolve()


def _under(p: str, base: str) -> str | None:
    """``p`` relative to ``base`` ("" for ``base`` itself), or None when ``p`` is not inside it."""
    if p == base:
        return ""
    prefix = base.rstrip("/") + "/"
    return p[len(prefix):] if p.startswith(prefix) else None


def portable_path(path: str | os.PathLike, *, root: str | os.PathLike | None = None,
                  home: str | os.PathLike | None = None, tmp: str | os.PathLike | None = None) -> str:
    """``path`` as a result records it (see the module docstring). ``root``, ``home`` and ``tmp`` default to the
    repository, the user's home and the temp folder."""
    s = os.fspath(path)
    if not s.startswith("/"):
        return s
    root_s = os.path.normpath(os.fspath(root if root is not None else repo_root()))
    bases = [("", root_s),
             ("$TMPDIR", os.path.normpath(os.fspath(tmp if tmp is not None else tempfile.gettempdir()))),
             ("~", os.path.normpath(os.fspath(home if home is not None else Path.home())))]
    plain = os.path.normpath(s)
    for p in (plain, os.path.realpath(s)):  # as given first; then resolved (a symlinked checkout or temp folder)
        for prefix, base in bases:
            if base != "/" and (rel := _under(p, base)) is not None:
                return "/".join(x for x in (prefix, rel) if x) or "."
    return os.path.relpath(plain, root_s)


def portable_command(command: str, **where) -> str:
    """A command line with each absolute path in it made portable (``where``: portable_path's root, home, tmp).
    Only words whose first folder exists here are paths (``/v1/chat/completions`` in a URL-less argument stays)."""
    def one(m: re.Match) -> str:
        word = m.group(0)
        top = word.split("/")[1]
        return portable_path(word, **where) if top and os.path.isdir("/" + top) else word
    return _ABSOLUTE_WORD.sub(one, command)
