"""Sub-commands of the ``flowspec`` CLI, one module each (see ``flowspec_p2p.cli``), and ``run_async``, the one place
an event loop is chosen (uvloop). May import every part of the package except the CLI entry (cli.py, __main__.py)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Coroutine
from typing import Any

ENGINE_CHOICES = ("auto", "native", "torch")  # model/load.get_engine's


def add_engine_argument(p: argparse.ArgumentParser, what: str = "the model engine") -> None:
    """``--engine auto|native|torch`` (None when not given: $FLOWSPEC_ENGINE, else auto)."""
    p.add_argument("--engine", choices=ENGINE_CHOICES, default=None,
                   help=f"{what}: auto (the default, or $FLOWSPEC_ENGINE): the native quantized engine where it runs "
                   "the model in float32, else the torch reference; native or torch insist")


def run_async(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run an async command on uvloop (falling back to asyncio where uvloop is unavailable)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        return asyncio.run(coro)
    return uvloop.run(coro)
