"""``flowspec draft ...``: train the EAGLE-style draft head for a target, from prompts to a shipped bundle.

    flowspec draft train     everything below in order (each step resumes where it stopped)
    flowspec draft data      self-distillation: the target answers the prompt pool; its features are stored
    flowspec draft fit       train the head on the stored features (checkpoints, held-out split)
    flowspec draft eval      held-out top-1 per unrolled depth and chain acceptance
    flowspec draft export    write the bundle (weights + JSON metadata) where `find_draft` looks
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from ..env import cache_dir

log = logging.getLogger(__name__)

EPILOG = """\
steps (all resumable; state lives in the run folder, default ~/.cache/flowspec_p2p/train/<run>):
  data    the target (SmolLM2 by default) answers ShareGPT + synthetic prompts (no Spec-Bench prompt) with
          batched KV-cached generation; features of every position go to float16 shards under <run>/features
  fit     trains fc + one decoder block with the EAGLE loss (feature SmoothL1 + soft cross-entropy against
          the target's distribution over the draft vocabulary), unrolled over its own predictions (EAGLE-3
          training-time test); checkpoints in <run>/ckpt
  eval    held-out top-1 per unrolled depth, chain acceptance per depth
  export  DraftBundle (float16 weights + metadata) -> ~/.cache/flowspec_p2p/drafts or --out

example (a long background job, 1 thread):
  nohup flowspec draft train --run main --prompts 20000 > /dev/null 2>&1 &
"""


AUTO_COVERAGE = 0.95  # --draft-vocab auto: the share of answer tokens the draft vocabulary covers


def _vocab_arg(text: str) -> int | str:
    return "auto" if text == "auto" else int(text)


def _run_dir(args: argparse.Namespace) -> Path:
    return Path(args.run_dir) if args.run_dir else cache_dir() / "train" / args.run


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "draft",
        help="train and export the EAGLE-style draft head",
        description=__doc__.split("\n\n", 1)[1],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    steps = p.add_subparsers(dest="step", metavar="STEP")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--run", default="default", help="run name (folder under ~/.cache/flowspec_p2p/train)")
    common.add_argument("--run-dir", default=None, help="explicit run folder (overrides --run)")
    common.add_argument("--model", default=None, help="target GGUF file, HF folder or name (default: SmolLM2)")
    common.add_argument("--threads", type=int, default=1, help="torch threads (default 1: shared machines)")
    common.add_argument("--no-progress", action="store_true", help="no progress bars")

    data = argparse.ArgumentParser(add_help=False)
    data.add_argument("--prompts", type=int, default=20000, help="pool prompts to answer (default 20000)")
    data.add_argument("--skip-prompts", type=int, default=0,
                      help="start this far into the pool (default 0), e.g. for a second process on another core "
                      "in another run folder; fit reads its store with --also-features")
    data.add_argument("--heldout-only", action="store_true",
                      help="answer only the pool's held-out prompts (key hash; never trained on): a held-out set "
                      "for `draft eval`, sooner than the pool's order reaches one")
    data.add_argument("--max-minutes", type=float, default=None,
                      help="stop after this long, keeping what is finished (default: no limit)")
    data.add_argument("--max-new-tokens", type=int, default=256, help="answer length cap (default 256)")
    data.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer prompts (default 512)")
    data.add_argument("--batch", type=int, default=24, help="generation batch rows (default 24)")
    data.add_argument("--sampled-fraction", type=float, default=0.2,
                      help="share of answers sampled at T=1 instead of greedy (default 0.2)")
    data.add_argument("--source", choices=["generate", "sharegpt"], default="generate",
                      help="generate: the target writes the answers (<run>/features, default); sharegpt: "
                      "teacher-force ShareGPT's recorded answers through the target (<run>/fixed; ~3.5x more "
                      "tokens per CPU second, slightly off-distribution)")

    fit = argparse.ArgumentParser(add_help=False)
    fit.add_argument("--steps", type=int, default=2000, help="optimiser steps in total (default 2000)")
    fit.add_argument("--tokens-per-step", type=int, default=4096, help="answer targets per step (default 4096)")
    fit.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    fit.add_argument("--warmup", type=int, default=None, help="linear warmup steps (default: steps / 20, <= 100)")
    fit.add_argument("--unroll", type=int, default=3, help="training-time-test steps (default 3)")
    fit.add_argument("--draft-vocab", type=_vocab_arg, default=16384,
                     help="draft vocabulary: most frequent answer tokens (default 16384, train: auto; 0 = full; "
                     f"auto = sized by measurement: the fewest covering {100 * AUTO_COVERAGE:.0f}%% of the training "
                     "answers' tokens, table in <run>/draft_vocab.json)")
    fit.add_argument("--feature-weight", type=float, default=0.1, help="SmoothL1 feature loss weight (default 0.1)")
    fit.add_argument("--noise", type=float, default=0.05, help="input feature noise, x feature RMS (default 0.05)")
    fit.add_argument("--fit-minutes", type=float, default=None,
                     help="training time budget, summed over resumed sessions: the cosine schedule runs on the "
                     "larger of steps and time spent, and training stops at either end (default: steps only)")
    fit.add_argument("--bf16", action="store_true",
                     help="bfloat16 matmuls in training (float32 weights, optimiser and softmax): faster on CPUs "
                     "with AMX or AVX512-BF16 (+24%% targets per CPU second measured here), slower elsewhere")
    fit.add_argument("--heldout-per-mille", type=int, default=50,
                     help="conversations held out for evaluation, per mille, by key hash (default 50)")
    fit.add_argument("--no-fixed", action="store_true", help="ignore the teacher-forced store (<run>/fixed)")
    fit.add_argument("--init-from", type=Path, default=None,
                     help="warm start a new fit from this checkpoint's head weights (e.g. another run's "
                          "ckpt/last.pt after adding data); optimiser, schedule and draft vocabulary start afresh")
    fit.add_argument("--also-features", type=Path, action="append", default=[], metavar="DIR",
                     help="also train on this feature store (another run's features/ folder, e.g. one written by "
                          "a second `draft data --skip-prompts` process); repeatable")

    ev = argparse.ArgumentParser(add_help=False)
    ev.add_argument("--head", type=Path, default=None, metavar="BUNDLE",
                    help="evaluate this exported head (stem, .json or .safetensors; e.g. the shipped one in "
                    "flowspec_p2p/speculative/assets) on the run's held-out conversations instead of the run's "
                    "checkpoint")

    budget = argparse.ArgumentParser(add_help=False)
    budget.add_argument("--no-warm-start", action="store_true",
                        help="train from scratch even when a head for a model of the same architecture is "
                        "installed (default: start from it, e.g. the shipped head for a requantized SmolLM2)")
    budget.add_argument("--minutes", type=float, default=60.0,
                        help="time budget of data + fit (default 60; split 30%% self-distillation, 35%% teacher "
                        "forcing, 30%% training, then held-out evaluation and export)")

    out = argparse.ArgumentParser(add_help=False)
    out.add_argument("--out", default=None, help="export folder (default ~/.cache/flowspec_p2p/drafts; the "
                     "package's shipped head lives in flowspec_p2p/assets)")
    out.add_argument("--name", default=None,
                     help="bundle file stem (default: <model file stem>-eagle with --model, else eagle-head)")
    out.add_argument("--no-eval", action="store_true", help="export without (re)evaluating")

    for name, parents, helptext in [
        ("train", [common, data, fit, out, budget], "a head for --model in --minutes: data, fit, eval, export "
                                                    "(resumable; a rerun continues each phase)"),
        ("data", [common, data], "self-distil: generate answers and store the target's features"),
        ("fit", [common, fit], "train the head on the stored features (resumes from <run>/ckpt/last.pt)"),
        ("eval", [common, fit, ev], "held-out top-1 per unrolled depth and chain acceptance of the latest checkpoint"),
        ("export", [common, fit, out], "evaluate and write the bundle (float16 weights + metadata)"),
    ]:
        sp = steps.add_parser(name, parents=parents, help=helptext, description=helptext)
        sp.set_defaults(func=globals()[f"run_{name}"])
        if name == "train":
            # the budget ends the fit, not a step count
            sp.set_defaults(draft_vocab="auto", steps=10**6, warmup=20, tokens_per_step=2048)
    p.set_defaults(func=lambda a: (p.print_help(sys.stderr), 2)[1])


def _data_config(args: argparse.Namespace):
    from ..train.data import DataConfig

    return DataConfig(run_dir=_run_dir(args), model=args.model, prompts=args.prompts, skip_prompts=args.skip_prompts,
                      max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                      batch=args.batch, sampled_fraction=args.sampled_fraction, threads=args.threads,
                      source=args.source, heldout_only=args.heldout_only,
                      max_seconds=None if args.max_minutes is None else 60 * args.max_minutes)


def run_data(args: argparse.Namespace) -> int:
    from ..train.data import generate_data

    store = generate_data(_data_config(args), progress=not args.no_progress)
    sys.stdout.write(json.dumps({"conversations": store.conversations, "tokens": store.tokens}) + "\n")
    return 0


def _fit_config(args: argparse.Namespace):
    from ..train.fit import FitConfig

    auto = args.draft_vocab == "auto"
    return FitConfig(run_dir=_run_dir(args), model=args.model, steps=args.steps, tokens_per_step=args.tokens_per_step,
                     lr=args.lr, unroll=args.unroll, draft_vocab=0 if auto else args.draft_vocab,
                     vocab_coverage=AUTO_COVERAGE if auto else None, feature_weight=args.feature_weight,
                     noise=args.noise, threads=args.threads, heldout_per_mille=args.heldout_per_mille,
                     use_fixed=not args.no_fixed, init_from=args.init_from, also_features=args.also_features,
                     bf16=args.bf16, bf16_block=args.bf16,
                     max_seconds=None if args.fit_minutes is None else 60 * args.fit_minutes,
                     warmup=args.warmup if args.warmup is not None else min(100, args.steps // 20))


def run_fit(args: argparse.Namespace) -> int:
    from ..train.fit import fit

    fit(_fit_config(args), progress=not args.no_progress)
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from ..train.export import run_eval as evaluate

    result = evaluate(_fit_config(args), progress=not args.no_progress, bundle=args.head)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from ..train.export import export, run_eval

    cfg = _fit_config(args)
    evaluation = None if args.no_eval else run_eval(cfg, progress=not args.no_progress)
    stem = export(cfg, Path(args.out) if args.out else None, _name(args), evaluation)
    sys.stdout.write(f"{stem}\n")
    return 0


def _name(args: argparse.Namespace) -> str:
    return args.name or (f"{Path(args.model).stem}-eagle" if args.model else "eagle-head")


def run_train(args: argparse.Namespace) -> int:
    from ..train.budget import keep_better, train
    from ..train.export import export, run_eval

    cfg = train(_data_config(args), _fit_config(args), args.minutes, progress=not args.no_progress,
                warm_start=not args.no_warm_start)
    evaluation = None if args.no_eval else run_eval(cfg, progress=not args.no_progress)
    stem = export(cfg, Path(args.out) if args.out else None, _name(args), evaluation)
    if cfg.init_from is not None and cfg.init_from.suffix != ".pt" and not args.no_eval:
        keep_better(cfg, stem, progress=not args.no_progress)  # never ship a warm start worse than its donor
    sys.stdout.write(f"{stem}\n")
    return 0
