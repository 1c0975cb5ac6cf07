"""``flowspec bench-core``: the model core against transformers (speed, greedy agreement, memory, load time)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from . import add_engine_argument

log = logging.getLogger(__name__)

PARTS = ("speed", "bound", "agreement", "memory", "load")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench-core",
        help="decode/prefill speed and greedy agreement vs transformers, memory by range, load time",
        description="Measure the single-device model core side by side with transformers on the same checkpoint "
        "(see flowspec_p2p/bench/core.py). Writes bench_core.json and bench_core.md to --out.",
    )
    p.add_argument("parts", nargs="*", metavar="PART", help=f"what to measure: {', '.join(PARTS)} (default: all)")
    p.add_argument("--data", type=Path, default=None,
                   help="(speed, agreement) Spec-Bench folder of <set>.jsonl files (default: the sets shipped in "
                   "the package, or $FLOWSPEC_SPEC_BENCH)")
    p.add_argument("--datasets", default="mt_bench", help="comma-separated sets; prompts are taken round-robin "
                   "from lines --start.. of each (default mt_bench)")
    p.add_argument("--start", type=int, default=30, help="first (0-based) line (default 30)")
    p.add_argument("--prompts", type=int, default=20, help="agreement prompts (default 20: lines 30-49)")
    p.add_argument("--max-tokens", type=int, default=128, help="agreement: new tokens per reply (default 128)")
    p.add_argument("--speed-prompts", type=int, default=4, help="speed: prompts (default 4)")
    p.add_argument("--speed-tokens", type=int, default=64, help="speed: new tokens per call (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="speed and load: repeats per prompt (default 3)")
    p.add_argument("--model", default=None, help="GGUF file, HF folder or model name (default: packaged SmolLM2-135M)")
    add_engine_argument(p)
    p.add_argument("--threads", type=int, default=None, help="torch threads, both sides (default: torch's choice)")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output folder (default ./bench-out)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..bench.core import (
        agreement,
        bound,
        environment,
        load_times,
        load_transformers,
        memory,
        speed,
        write_outputs,
    )
    from ..errors import ConfigError
    from ..model.load import load_model
    from ..specbench import round_robin

    parts = list(dict.fromkeys(args.parts or PARTS))
    if unknown := [p for p in parts if p not in PARTS]:
        raise ConfigError(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    progress = not args.no_progress
    result: dict = {"environment": environment(), "parts": parts}
    needs_prompts = {"speed", "agreement"} & set(parts)
    lm = load_model(args.model, engine=args.engine) if {"speed", "bound", "agreement", "memory"} & set(parts) else None
    hf = load_transformers(lm) if needs_prompts else None
    datasets = args.datasets.split(",")
    if "speed" in parts:
        prompts = round_robin(args.data, datasets, args.start, args.speed_prompts)
        log.info("speed: %d prompts x %d tokens x %d repeats", len(prompts), args.speed_tokens, args.repeats)
        result["speed"] = speed(lm, hf, prompts, args.speed_tokens, args.repeats, progress)
    if "bound" in parts:
        result["bound"] = bound(lm)
    if "agreement" in parts:
        prompts = round_robin(args.data, datasets, args.start, args.prompts)
        result["agreement"] = agreement(lm, hf, prompts, args.max_tokens, progress)
        result["agreement"]["prompt_set"] = [f"{p.dataset}:{p.line}" for p in prompts]
    if "memory" in parts:
        result["memory"] = memory(args.model, lm.source.config.num_layers)
    if "load" in parts:
        result["load"] = load_times(args.model, max(2, args.repeats), progress)
    j, m = write_outputs(result, args.out)
    log.warning("bench-core: wrote %s and %s", j, m)
    return 0
