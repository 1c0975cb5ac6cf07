"""The environment: the only module that reads environment variables, and where the package keeps its files.

    FLOWSPEC_CACHE_DIR       caches: built kernels, tokenizers, trained draft heads, the tree tuning, training runs
                             (default $XDG_CACHE_HOME/flowspec_p2p, else ~/.cache/flowspec_p2p)
    FLOWSPEC_MODELS_DIR      where `flowspec models pull` keeps models and their registry (default <cache>/models)
    FLOWSPEC_NATIVE_DIR      where a source checkout's native engine is compiled to (default <cache>/native)
    FLOWSPEC_STATE_DIR       an agent's state folder (its id, fetched weights), when the profile and flags set none
    FLOWSPEC_CLUSTER_KEY     the cluster key (fsk1-...; preferred over flags, which other users see in ``ps``)
    FLOWSPEC_SECRET          a passphrase the cluster key is derived from (the older way; preferred over --secret)
    FLOWSPEC_LEADER_IDENTITY (a member) the identity fingerprint of the leader it may join (its leader prints it next
                             to the key; cluster/member.py)
    FLOWSPEC_API_KEY         the leader API's key (preferred over --api-key; ``flowspec chat`` sends it)
    FLOWSPEC_SPEC_BENCH      the folder of the six Spec-Bench ``<set>.jsonl`` files (default: the copy shipped in the
                             package, bench/data/spec-bench, with its NOTICE.md)
    FLOWSPEC_ENGINE          the model engine when no --engine is given: auto (default: native where it runs, else
                             torch), native, torch
    HF_ENDPOINT              the Hugging Face hub `flowspec models pull hf:...` downloads from (default
                             https://huggingface.co; a mirror's address works)
    HF_TOKEN                 a Hugging Face access token, sent to the hub (never to the CDN it redirects to) for gated
                             or private repositories
    CC                       the C compiler the native kernels are built with (default ``cc``)
    XDG_CONFIG_HOME          where `flowspec service install --user` writes an agent's profile (default ~/.config)
    XDG_STATE_HOME           where a user service keeps an agent's state (default ~/.local/state)
    SUDO_USER                whom `sudo flowspec service install` runs a system service as

Everything else gets these values from here, or as arguments.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

CACHE_DIR = "FLOWSPEC_CACHE_DIR"
STATE_DIR = "FLOWSPEC_STATE_DIR"
MODELS_DIR = "FLOWSPEC_MODELS_DIR"
NATIVE_DIR = "FLOWSPEC_NATIVE_DIR"
SECRET = "FLOWSPEC_SECRET"
CLUSTER_KEY = "FLOWSPEC_CLUSTER_KEY"
LEADER_IDENTITY = "FLOWSPEC_LEADER_IDENTITY"
API_KEY = "FLOWSPEC_API_KEY"
SPEC_BENCH = "FLOWSPEC_SPEC_BENCH"
DEFAULT_STATE_DIR = Path("~/.cache/flowspec_p2p/agent")  # an agent's state folder when nothing says otherwise
KEY_FILE = "cluster.key"  # the cluster key's file in an agent's state folder (cluster/keys.py)
DEFAULT_API_PORT = 8000  # the leader's API
ENGINE = "FLOWSPEC_ENGINE"
ENGINES = ("auto", "native", "torch")
HF_ENDPOINT = "HF_ENDPOINT"
HF_TOKEN = "HF_TOKEN"
DEFAULT_HF_ENDPOINT = "https://huggingface.co"


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


def models_dir() -> Path:
    """Where pulled models and their registry live: $FLOWSPEC_MODELS_DIR, else cache_dir() / models."""
    explicit = os.environ.get(MODELS_DIR)
    return Path(explicit).expanduser() if explicit else cache_dir() / "models"


def native_dir() -> Path:
    """Where the native engine is compiled at run time: $FLOWSPEC_NATIVE_DIR, else cache_dir() / native."""
    explicit = os.environ.get(NATIVE_DIR)
    return Path(explicit).expanduser() if explicit else cache_dir() / "native"


def spec_bench_dir() -> Path:
    """The Spec-Bench folder: $FLOWSPEC_SPEC_BENCH, else the copy shipped in the package (bench/data/spec-bench)."""
    explicit = os.environ.get(SPEC_BENCH)
    if explicit:
        return Path(explicit).expanduser()
    return Path(__file__).resolve().parent / "bench" / "data" / "spec-bench"


def api_key() -> str | None:
    """FLOWSPEC_API_KEY: the key a client of the leader's API sends (None when unset or empty)."""
    return os.environ.get(API_KEY) or None


def hf_endpoint() -> str:
    """$HF_ENDPOINT (the hub's address, no trailing slash), else https://huggingface.co."""
    return (os.environ.get(HF_ENDPOINT) or DEFAULT_HF_ENDPOINT).rstrip("/")


def hf_token() -> str | None:
    """$HF_TOKEN, None when unset or empty."""
    return os.environ.get(HF_TOKEN) or None


def engine() -> str:
    """FLOWSPEC_ENGINE: auto, native or torch (anything else is auto)."""
    value = os.environ.get(ENGINE, "auto")
    return value if value in ENGINES else "auto"


def compiler() -> str:
    """The C compiler for the native kernels: $CC, else ``cc``."""
    return os.environ.get("CC") or "cc"


def config_home() -> Path:
    """$XDG_CONFIG_HOME, else ~/.config."""
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")


def state_home() -> Path:
    """$XDG_STATE_HOME, else ~/.local/state."""
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")


def sudo_user() -> str | None:
    """$SUDO_USER: who ran this command through sudo (None when unset, empty or root)."""
    user = os.environ.get("SUDO_USER")
    return user if user and user != "root" else None


def physical_cores() -> int:
    """This device's physical cores that this process may run on: psutil's physical count (where installed),
    capped by the CPU affinity (a container given 2 CPUs of a 32-core host gets 2)."""
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        import psutil
    except ImportError:  # psutil is optional here: the usable CPUs are the next best guess
        return max(1, allowed)
    return max(1, min(psutil.cpu_count(logical=False) or allowed, allowed))
