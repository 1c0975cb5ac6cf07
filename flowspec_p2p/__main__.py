"""``flowspec`` / ``python -m flowspec_p2p``: the command-line entry point (the commands run on uvloop:
``commands.run_async``)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
