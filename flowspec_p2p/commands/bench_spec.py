"""``flowspec bench-spec``: single-device speculative decoding vs autoregressive on Spec-Bench prompts."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from . import add_engine_argument
from .generate import add_spec_arguments, tree_shape

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench-spec",
        help="τ, tokens/s and greedy equality of --mode spec vs ar on Spec-Bench",
        description="For each Spec-Bench set, lines [--start, --start + --per-dataset) (first turn, chat template; "
        "raw for a base model): τ at each temperature, spec vs AR decode tokens/s side by side (T=0, same prompt "
        "back to back), the "
        "draft's cost per step relative to one target forward, and token-for-token equality of greedy spec vs AR "
        "(divergences listed with the reference's top-2 logit gap). Writes bench_spec.json and bench_spec.md.",
    )
    p.add_argument("--data", type=Path, default=None,
                   help="Spec-Bench folder of <set>.jsonl files (default: the sets shipped in the "
                   "package, or $FLOWSPEC_SPEC_BENCH)")
    p.add_argument("--datasets", default="mt_bench,alpaca,gsm8k,humaneval,qa,sum", help="comma-separated sets")
    p.add_argument("--start", type=int, default=30, help="first (0-based) line of each set (default 30)")
    p.add_argument("--per-dataset", type=int, default=20, help="prompts per set (default 20: lines 30-49)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per reply (default 128)")
    p.add_argument("--temperatures", default="0,1", help="comma-separated temperatures (default 0,1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the first prompt (default 0)")
    p.add_argument("--model", default=None, help="GGUF file, HF folder or model name (default: packaged SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    add_engine_argument(p)
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output folder (default ./bench-out)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_spec_arguments(p, mode=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..bench.single_device import bench, markdown, write_outputs
    from ..model.load import load_model
    from ..specbench import load_questions
    from ..speculative.decoder import load_spec

    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, engine=args.engine)
    fingerprint = lm.fingerprint()
    target, drafter, meta = load_spec(lm.shard, lm.source, fingerprint, args.draft)  # an EAGLE-3 head cuts the target
    shape = tree_shape(args, fingerprint)
    prompts = load_questions(args.data, args.datasets.split(","), args.start, args.per_dataset)
    temps = [float(t) for t in args.temperatures.split(",")]
    log.info("bench-spec: %d prompts, tree %s, temperatures %s", len(prompts), shape, temps)
    result = bench(
        target,
        drafter,
        shape,
        lm.tokenizer,
        prompts,
        temps,
        args.max_tokens,
        args.seed,
        progress=not args.no_progress,
    )
    result["config"]["draft"] = {
        **{k: meta.get(k) for k in ("target_fingerprint", "draft_vocab_size", "heldout_top1", "format", "source")},
        "steps": meta.get("training", {}).get("steps"),  # export writes these under "training" and "data"
        "data_tokens": meta.get("data", {}).get("answer_tokens"),
    }
    write_outputs(args.out, "bench_spec", result, markdown(result))
    log.warning("wrote %s", args.out / "bench_spec.md")
    return 0
