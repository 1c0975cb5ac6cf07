"""Sub-commands of the ``flowspec`` CLI, one module each (see ``flowspec_p2p.cli``), and ``run_async``, the one place
an event loop is chosen (uvloop). May import every part of the package except the CLI entry (cli.py, __main__.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def run_async(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run an async command on uvloop (falling back to asyncio where uvloop is unavailable)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        return asyncio.run(coro)
    return uvloop.run(coro)
