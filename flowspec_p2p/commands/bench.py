"""``flowspec bench``: ar, chunk, (pipedec,) flowspec side by side on an emulated edge cluster of agent processes
(the paper's evaluation); writes results.json, results.md and PNG charts to --out."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from . import add_engine_argument

log = logging.getLogger(__name__)


def _floats(values: list[str] | None, default: tuple[float, ...]) -> tuple[float, ...]:
    if not values:
        return default
    return tuple(float(x) for v in values for x in v.split(",") if x.strip())


def _names(value: str | None) -> tuple[str, ...] | None:
    return tuple(x.strip() for x in value.split(",") if x.strip()) if value else None


def register(sub: argparse._SubParsersAction) -> None:
    from ..specbench import EVAL_START, PAPER_ORDER

    p = sub.add_parser(
        "bench",
        help="every decoding mode side by side on an emulated edge cluster (tokens/s, tau, utilization)",
        description="Start an emulated edge cluster on this host (N stage agents + 1 leader as processes on "
        "loopback; the leader holds the draft head, embedding and LM head and no layers; links of --link-mbps and "
        "--link-latency-ms; every device --slowdown times slower) and run the Spec-Bench prompts (lines 30.. of "
        "each set; MT-bench's two turns as one conversation per mode) through every mode the leader offers (ar, "
        "chunk, pipedec, flowspec), interleaved per prompt, at each temperature (seed fixed per prompt). Writes "
        "records.jsonl (one line per finished request; --resume continues it), results.json, results.md and PNG "
        "charts (per-stage timelines, speedups) to --out. Only the ratios between modes mean anything: the "
        "devices are emulated.",
    )
    p.add_argument("--stages", type=int, default=4, help="stage agents holding layers (default 4; +1 leader)")
    p.add_argument("--link-mbps", type=float, default=100.0, help="emulated link bandwidth, Mbit/s (default 100)")
    p.add_argument("--link-latency-ms", type=float, default=2.0, help="emulated one-way link latency (default 2)")
    p.add_argument("--slowdown", type=float, default=None,
                   help="emulated compute slowdown of every device, stages and leader (default: ceil(2 x (stages "
                   "+ 1) / host cores), so the devices do not contend for this host's cores)")
    p.add_argument("--per-dataset", type=int, default=20, help="prompts per Spec-Bench set (default 20: lines 30-49)")
    p.add_argument("--turns", type=int, default=2,
                   help="user turns per conversation where a question has several (MT-bench: 2, as in the paper; "
                   "1: first turns only)")
    p.add_argument("--temperature", action="append", default=None, metavar="T[,T...]",
                   help="sampling temperature (repeatable or comma-separated; default 0 and 1)")
    p.add_argument("--max-tokens", type=int, default=256, help="max new tokens per reply (default 256)")
    p.add_argument("--out", type=Path, default=Path("bench/flowspec"), help="output folder (default bench/flowspec)")
    p.add_argument("--modes", default=None, help="comma-separated modes (default: every mode the leader offers)")
    p.add_argument("--datasets", default=None,
                   help=f"comma-separated Spec-Bench sets (default {','.join(PAPER_ORDER)})")
    p.add_argument("--start", type=int, default=EVAL_START, help=f"first 0-based line of each set ({EVAL_START})")
    p.add_argument("--data", type=Path, default=None,
                   help="Spec-Bench folder of <set>.jsonl files (default: the sets shipped in the "
                   "package, or $FLOWSPEC_SPEC_BENCH)")
    p.add_argument("--wire-dtype", choices=["float16", "bfloat16", "float32"], default="float32",
                   help="activations between stages (default float32: exact, lossless)")
    add_engine_argument(p)
    p.add_argument("--threads", type=int, default=1, help="torch threads per emulated device (default 1)")
    p.add_argument("--context", type=int, default=2048, help="KV tokens per request on every stage (default 2048)")
    p.add_argument("--model", type=Path, default=None, help="the model, a path or a name (default: SmolLM2-135M)")
    p.add_argument("--draft", type=Path, default=None,
                   help="the leader's draft head bundle (default: the one installed for the model)")
    p.add_argument("--flowspec-config", default=None, metavar="JSON",
                   help="FlowSpec settings that differ from the defaults, as JSON of FlowSpecConfig fields, e.g. "
                   "'{\"segment_cap\": 1}' (A/B one setting against ar in its own run; recorded in the setup)")
    p.add_argument("--insecure", action="store_true",
                   help="link the agents over plain http/ws (the open mode) instead of TLS with a cluster key, e.g. "
                   "to measure what TLS costs (recorded in the setup)")
    p.add_argument("--clients", default=None, metavar="C[,C...]",
                   help="many users at once instead: for each mode (default ar, flowspec, auto) and client count, C "
                   "clients send greedy requests of different prompts together (3 rounds); writes clients.json/.md "
                   "with the aggregate tokens/s, its ratio to the fewest clients, TTFT and ITL percentiles, and "
                   "whether every reply equals its prompt's reply alone")
    p.add_argument("--resume", action="store_true", help="continue the records in --out (skip finished requests)")
    p.add_argument("--report-only", action="store_true", help="rebuild the reports from --out's records; run nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _config(args: argparse.Namespace):
    """The bench's configuration from the flags (a ConfigError naming what is wrong)."""
    from pydantic import ValidationError

    from ..bench import edge as bench
    from ..config import json_object
    from ..errors import ConfigError

    fields = {"stages": args.stages, "link_mbps": args.link_mbps, "link_latency_ms": args.link_latency_ms,
              "slowdown": args.slowdown, "per_dataset": args.per_dataset, "start": args.start, "turns": args.turns,
              "temperatures": _floats(args.temperature, (0.0, 1.0)), "max_tokens": args.max_tokens,
              "modes": _names(args.modes), "wire_dtype": args.wire_dtype, "threads": args.threads,
              "context": args.context, "model": args.model, "draft": args.draft, "out": args.out,
              "resume": args.resume, "progress": not args.no_progress,
              "flowspec": json_object(args.flowspec_config, "--flowspec-config"), "insecure": args.insecure,
              "engine": args.engine}
    if args.datasets:
        fields["datasets"] = _names(args.datasets)
    if args.data:
        fields["data"] = args.data
    try:
        return bench.BenchConfig(**fields)
    except ValidationError as e:
        raise ConfigError(f"invalid bench options: {e}") from None


def run(args: argparse.Namespace) -> int:
    from ..bench import edge as bench

    if args.clients:
        from ..bench.clients import CLIENTS_MD, run_clients

        run_clients(_config(args), [int(c) for c in args.clients.split(",") if c.strip()])
        sys.stdout.write((args.out / CLIENTS_MD).read_text())
        return 0
    if args.report_only:
        bench.report_only(args.out)
    else:
        bench.run(_config(args))
    sys.stdout.write((args.out / "results.md").read_text())
    return 0
