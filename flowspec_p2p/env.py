"""The environment: the only module that reads environment variables, and where the package keeps its files.

    FLOWSPEC_CACHE_DIR       caches: built kernels, tokenizers, trained draft heads, the tree tuning, training runs
                             (default $XDG_CACHE_HOME/flowspec_p2p, else ~/.cache/flowspec_p2p)
    FLOWSPEC_STATE_DIR       an agent's state folder (its id, fetched weights), when the profile and flags set none
    FLOWSPEC_SECRET          the cluster's shared secret (preferred over --secret, which other users see in ``ps``)
    FLOWSPEC_API_KEY         the API key ``flowspec chat`` sends to the leader's API (preferred over --api-key)
    FLOWSPEC_SPEC_BENCH      the folder of the six Spec-Bench ``<set>.jsonl`` files (default: ../shared/data/spec-bench
                             beside the repository checkout)
    FLOWSPEC_PACKED_WEIGHTS  few-row matmul backend: 1 (default: the best available), fewrow, onednn, 0 (none)
    CC                       the C compiler the native kernels are built with (default ``cc``)

Everything else gets these values from here, or as arguments.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

CACHE_DIR = "FLOWSPEC_CACHE_DIR"
STATE_DIR = "FLOWSPEC_STATE_DIR"
SECRET = "FLOWSPEC_SECRET"
SPEC_BENCH = "FLOWSPEC_SPEC_BENCH"
PACKED_WEIGHTS = "FLOWSPEC_PACKED_WEIGHTS"
API_KEY = "FLOWSPEC_API_KEY"


def environ() -> Mapping[str, str]:
    """The process environment (a live view)."""
    return os.environ


def get(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def cache_dir() -> Path:
    """Where caches go: $FLOWSPEC_CACHE_DIR, else $XDG_CACHE_HOME/flowspec_p2p, else ~/.cache/flowspec_p2p."""
    explicit = os.environ.get(CACHE_DIR)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flowspec_p2p"


def spec_bench_dir() -> Path:
    """The Spec-Bench folder: $FLOWSPEC_SPEC_BENCH, else ../shared/data/spec-bench beside the checkout."""
    explicit = os.environ.get(SPEC_BENCH)
    if explicit:
        return Path(explicit).expanduser()
    return Path(__file__).resolve().parents[2] / "shared" / "data" / "spec-bench"


def api_key() -> str | None:
    """FLOWSPEC_API_KEY: the key a client of the leader's API sends (None when unset or empty)."""
    return os.environ.get(API_KEY) or None


def packed_weights() -> str:
    """FLOWSPEC_PACKED_WEIGHTS: which few-row matmul backend to use (see model/shard.py)."""
    return os.environ.get(PACKED_WEIGHTS, "1")


def compiler() -> str:
    """The C compiler for the native kernels: $CC, else ``cc``."""
    return os.environ.get("CC") or "cc"
