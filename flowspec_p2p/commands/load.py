"""``flowspec load --clients N --seconds S``: load a running cluster's API and report what it held (bench/load.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..env import API_KEY
from ..errors import ConfigError
from . import run_async


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "load",
        help="N clients sending greedy requests to a running cluster for S seconds",
        description="N clients send greedy chat requests back to back to a running cluster's API for S seconds. "
        "Prints the status counts (503s must carry Retry-After), latency percentiles of the 200s, whether every "
        "200 equals the reply of one request sent alone first, and the agents' RSS over time (from /cluster) with "
        "each one's drift from the first to the last quarter. Exit status 1 when a 200 differed, a status other "
        "than 200 or 503 came, or a 503 lacked Retry-After.",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the leader's API (default http://127.0.0.1:8000)")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    p.add_argument("--seconds", type=float, default=30.0, help="how long (default 30)")
    p.add_argument("--max-tokens", type=int, default=16, help="new tokens per request (default 16)")
    p.add_argument("--prompt", default=None, help="the user message (default: a short question)")
    p.add_argument("--prompts", type=int, default=None, metavar="P",
                   help="P different prompts instead (Spec-Bench's first turns, round robin over its sets; client i "
                   "asks prompt i mod P)")
    p.add_argument("--second-turn", action="store_true",
                   help="instead: a chat's second turn after a long first one (a Spec-Bench article), its time to "
                   "first token from the prompt cache against a cold prefill (medians of 3 interleaved rounds)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..bench import load

    if not 1 <= args.clients <= 1024 or args.seconds <= 0 or args.max_tokens < 1:
        raise ConfigError("--clients takes 1 to 1024, --seconds a positive number, --max-tokens at least 1")
    if args.second_turn:
        from ..specbench import load_questions

        article = load_questions(None, ["sum"], 30, 1)[0].text.removeprefix("Summarize: ")
        report = run_async(load.second_turn(args.url.rstrip("/"), article=article, api_key=os.environ.get(API_KEY)))
        sys.stdout.write(json.dumps(report) + "\n")
        return 0 if report["replies_agree"] else 1
    if args.prompts is not None:
        from ..specbench import DATASETS, round_robin

        prompts = [q.text for q in round_robin(None, DATASETS, count=args.prompts)]
    else:
        prompts = [args.prompt or load.PROMPT]
    report = run_async(load.run_load(args.url.rstrip("/"), clients=args.clients, seconds=args.seconds,
                                     max_tokens=args.max_tokens, prompts=prompts, api_key=os.environ.get(API_KEY)))
    sys.stdout.write((json.dumps(report) if args.json else load.render(report)) + "\n")
    bad = set(report["statuses"]) - {"200", "503"}
    return 1 if bad or report["mismatched_200s"] or report["503s_without_retry_after"] else 0
