"""Argument parsing: one sub-command per module in ``flowspec_p2p.commands``, each a thin argparse layer."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .errors import FlowSpecError

log = logging.getLogger("flowspec_p2p")

# Each module defines register(subparsers) and sets `func` on its parsers.
COMMAND_MODULES = [
    "flowspec_p2p.commands.generate",
    "flowspec_p2p.commands.plan",
    "flowspec_p2p.commands.agent",
    "flowspec_p2p.commands.cluster",
    "flowspec_p2p.commands.chat",
    "flowspec_p2p.commands.draft",
    "flowspec_p2p.commands.bench_hop",
    "flowspec_p2p.commands.bench_spec",
    "flowspec_p2p.commands.tune",
    "flowspec_p2p.commands.bench_core",
    "flowspec_p2p.commands.bench",
    "flowspec_p2p.commands.keygen",
    "flowspec_p2p.commands.bench_engine",
    "flowspec_p2p.commands.fuzz",
    "flowspec_p2p.commands.load",
    "flowspec_p2p.commands.models",
    "flowspec_p2p.commands.service",
    "flowspec_p2p.commands.model",
    "flowspec_p2p.commands.bench_scale",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowspec",
        description="Run a language model across the devices of a home or factory. "
        "Agents find each other over mDNS, split the model's layers between them, and decode with "
        "FlowSpec (continuous pipelined speculative decoding). Output equals plain greedy decoding.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging on stderr (-vv: debug)")
    parser.add_argument("-q", "--quiet", action="store_true", help="only errors on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def setup_logging(verbose: int, quiet: bool) -> None:
    level = logging.ERROR if quiet else (logging.WARNING, logging.INFO, logging.DEBUG)[min(verbose, 2)]
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    if level > logging.DEBUG:  # keep library chatter (transformers, gguf) out of the user's way
        for noisy in ("transformers", "urllib3", "filelock", "asyncio"):
            logging.getLogger(noisy).setLevel(max(level, logging.WARNING))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    setup_logging(args.verbose, args.quiet)
    try:
        return int(args.func(args) or 0)
    except FlowSpecError as e:
        log.error("%s", e)
        return 1
    except KeyboardInterrupt:
        return 130
