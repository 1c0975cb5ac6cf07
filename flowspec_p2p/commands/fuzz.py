"""``flowspec fuzz --minutes N``: hostile input against a local cluster for N minutes, counted per target and outcome
(bench/fuzz.py, bench/fuzz_cluster.py)."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import ConfigError
from . import run_async

TARGETS = ("stage", "control", "api")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fuzz",
        help="fuzz a local cluster's stage, control plane and API with hostile input",
        description="Start a leader and a member agent in this process on loopback (the open mode, the leader "
        "holding no layers) and feed them, batch by batch until the time is up: data-plane frames with hostile "
        "fields over a ring link to the member's stage, hostile control messages to both agents, hostile API "
        "bodies to the leader. Prints the count of inputs per target and outcome, and whether a greedy request "
        "gives the same reply after the fuzzing as before. Needs hypothesis (the dev extra).",
    )
    p.add_argument("--minutes", type=float, default=1.0, help="how long to fuzz (default 1)")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    p.add_argument("--batch", type=int, default=100, help="inputs per target per round (default 100)")
    p.add_argument("--seed", type=int, default=0, help="the first batch's hypothesis seed (default 0)")
    p.add_argument("--model", default=None, help="model path or name (default: the packaged SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=1, help="compute threads per agent (default 1)")
    p.add_argument("--json", action="store_true", help="print the counts as one JSON object instead")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    targets = tuple(t for t in args.targets.split(",") if t)
    if not targets or any(t not in TARGETS for t in targets):
        raise ConfigError(f"--targets takes a comma-separated list of {', '.join(TARGETS)}")
    if args.minutes <= 0 or args.batch < 1:
        raise ConfigError("--minutes must be positive and --batch at least 1")
    try:
        from ..bench import fuzz, fuzz_cluster
    except ImportError as e:
        raise ConfigError(f"flowspec fuzz needs hypothesis ({e}); install the dev extra: "
                          "pip install -e '.[dev]'") from e
    result = run_async(fuzz_cluster.fuzz_local_cluster(minutes=args.minutes, targets=targets, batch=args.batch,
                                                       seed=args.seed, model=args.model, threads=args.threads))
    if args.json:
        out = {**result, "counts": {k: dict(v) for k, v in result["counts"].items()}}
        sys.stdout.write(json.dumps(out) + "\n")
    else:
        sys.stdout.write(fuzz.report(result["counts"]) + "\n")
        sys.stdout.write(f"greedy reply after fuzzing {'unchanged' if result['greedy_ok'] else 'CHANGED'} "
                         f"({result['seconds']} s)\n")
    return 0 if result["greedy_ok"] else 1
