"""``flowspec tune-tree``: measure this device and pick the speculative tree size `generate --mode spec` uses."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

# Calibration prompts used when --data is not given (written for this purpose; no Spec-Bench prompt).
CALIBRATION_PROMPTS = (
    "Explain how a refrigerator keeps food cold, in simple terms.",
    "Write a short poem about autumn leaves.",
    "A shop sells pencils at 3 for $1. How much do 27 pencils cost? Show your steps.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What are three tips for sleeping better?",
    "Summarize the plot of a typical detective story in a few sentences.",
    "Give me a packing list for a weekend camping trip.",
    "What is the difference between weather and climate?",
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune-tree",
        help="measure target forward cost vs. tree size here and pick the speculative tree budget",
        description="Times one target forward against the number of tree nodes, the draft head's cost per tree "
        "shape, and (teacher-forced, T=0) the acceptance of every candidate shape on calibration prompts; picks "
        "the shape with the highest estimated tokens/s and saves it where `flowspec generate --mode spec` reads "
        "it (~/.cache/flowspec_p2p/tree_tuning.json).",
    )
    p.add_argument("--model", default=None, help="GGUF file, HF folder or model name (default: packaged SmolLM2-135M)")
    p.add_argument("--draft", default=None, help="draft head (default: the one shipped for --model)")
    p.add_argument(
        "--data",
        type=Path,
        default=None,
        help="Spec-Bench folder: calibrate on lines [0, --per-dataset) of each set (default: 8 built-in prompts)",
    )
    p.add_argument("--per-dataset", type=int, default=2, help="calibration prompts per set with --data (default 2)")
    p.add_argument("--max-tokens", type=int, default=96, help="reply length per calibration prompt (default 96)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--curve-only", action="store_true", help="only the forward-cost curve (no draft head needed)")
    p.add_argument("--no-save", action="store_true", help="do not write the tuning file the CLI reads")
    p.add_argument("--out", type=Path, default=None, help="also write tune_tree.json/.md to this folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..bench.single_device import write_outputs
    from ..bench.tune import TUNE_START, tune, tune_markdown
    from ..model.load import load_model
    from ..specbench import DATASETS, load_questions
    from ..speculative.decoder import load_drafter, tuning_path

    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    fingerprint = lm.fingerprint()
    drafter = None
    if not args.curve_only:
        drafter, _ = load_drafter(lm.shard, fingerprint, args.draft)
    if args.data is not None:
        texts = [p.text for p in load_questions(args.data, DATASETS, TUNE_START, args.per_dataset)]
    else:
        texts = list(CALIBRATION_PROMPTS)
    prompts = [lm.tokenizer.chat([{"role": "user", "content": t}]) for t in texts]
    result = tune(lm.shard, drafter, prompts, args.max_tokens, progress=not args.no_progress)
    result["target_fingerprint"] = fingerprint
    md = tune_markdown(result)
    if args.out is not None:
        write_outputs(args.out, "tune_tree", result, md)
    if "best" in result and not args.no_save:
        path = tuning_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        log.warning("saved the tuned tree %s to %s", result["best"], path)
    import sys

    sys.stdout.write(md)
    return 0
