"""``flowspec`` / ``python -m flowspec_p2p``: the command-line entry point. uvloop is chosen here and only here."""

from __future__ import annotations

import sys


def run_async(coro):
    """Run an async command on uvloop (falling back to asyncio where uvloop is unavailable)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        import asyncio

        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    from .cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
