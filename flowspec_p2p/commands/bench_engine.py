"""``flowspec bench-engine``: our engine on this device against llama.cpp's llama-bench on the same GGUF."""

from __future__ import annotations

import argparse
import logging
import shlex
from pathlib import Path

from ..bench import ENGINE_PARTS as PARTS
from ..errors import ConfigError
from ..specbench import load_questions
from . import add_engine_argument
from .generate import add_spec_arguments, tree_shape

log = logging.getLogger(__name__)

DEFAULT_ROWS = "1,2,4,6,8,12,16,24,32"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench-engine",
        help="our AR and spec decode, n-row forward costs and peak RSS vs llama.cpp's llama-bench",
        description="On this device, side by side and interleaved (medians over --repeats): greedy decode tokens/s "
        "of our AR and spec decoders (in process, prefill excluded) and llama-bench's tg on the same GGUF and "
        "thread counts; the cost of an n-row forward relative to one row (ours: every layer with a draft-tree mask "
        "after the prompt, without and with the LM head; llama.cpp: pp-n at the same depth); the peak RSS of "
        "`flowspec generate` (ar, spec), llama-bench, llama-cli and the runtime baseline. Without a llama-bench "
        "binary (--llama-bench or PATH) it measures ours alone. Writes results.json and results.md to --out "
        "(see flowspec_p2p/bench/engine.py).",
    )
    p.add_argument("parts", nargs="*", metavar="PART", help=f"what to measure: {', '.join(PARTS)} (default: all)")
    p.add_argument("--model", type=Path, default=None,
                   help="GGUF file or a model's name (`flowspec models list`; default: packaged SmolLM2-135M Q4_1)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    p.add_argument("--llama-bench", default=None, metavar="PATH",
                   help="llama.cpp's llama-bench binary (default: llama-bench on PATH, else ours alone); "
                   "llama-cli beside it, if there, gives a decode's peak RSS the way a user runs it")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats (default 5)")
    p.add_argument("--tokens", type=int, default=128, help="decoded tokens per run (default 128)")
    p.add_argument("--prompt", default=None, help="the user message (default: the Spec-Bench --question)")
    p.add_argument("--question", default="mt_bench:30", metavar="SET:LINE",
                   help="Spec-Bench question whose first turn is the prompt (default mt_bench:30)")
    p.add_argument("--data", type=Path, default=None,
                   help="Spec-Bench folder of <set>.jsonl files (default: the sets shipped in the "
                   "package, or $FLOWSPEC_SPEC_BENCH)")
    add_engine_argument(p)
    p.add_argument("--rows", default=DEFAULT_ROWS, help=f"n-row forward sizes (default {DEFAULT_ROWS})")
    p.add_argument("--out", type=Path, default=Path("bench/engine"), help="output folder (default bench/engine)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_spec_arguments(p, mode=False)
    p.set_defaults(func=run)


def _ints(flag: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{flag}: a comma-separated list of integers, not {text!r}") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{flag}: positive integers, not {text!r}")
    return tuple(dict.fromkeys(values))


def _prompt(args: argparse.Namespace) -> tuple[str, str]:
    """-> (the user message, where it came from)"""
    if args.prompt is not None:
        return args.prompt, "--prompt"
    name, _, line = args.question.partition(":")
    if not line.isdigit():
        raise ConfigError(f"--question: SET:LINE (0-based line), not {args.question!r}")
    found = load_questions(args.data, [name], int(line), 1)
    if not found:
        raise ConfigError(f"--question {args.question}: no such line")
    return found[0].text, f"Spec-Bench {args.question} (first turn)"


def _command(args: argparse.Namespace, parts: list[str]) -> str:
    words = ["flowspec", "bench-engine", *([] if parts == list(PARTS) else parts)]
    for flag in ("model", "threads", "llama_bench", "repeats", "tokens", "prompt", "question", "rows", "out", "draft",
                 "tree_tokens", "tree_depth", "tree_topk", "tree_lookup"):
        if (v := getattr(args, flag)) is not None:
            words += [f"--{flag.replace('_', '-')}", str(v)]
    return shlex.join(words)


def run(args: argparse.Namespace) -> int:
    from ..bench import llamacpp  # the CLI imports only what its command needs
    from ..bench.engine import EngineBenchConfig, Ours, measure, setup_record
    from ..bench.engine_report import summarize, write_outputs
    from ..model.load import load_model, set_threads
    from ..model.registry import resolve_model
    from ..speculative.decoder import load_drafter

    parts = list(dict.fromkeys(args.parts or PARTS))
    if unknown := [p for p in parts if p not in PARTS]:
        raise ConfigError(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    if args.repeats < 1 or args.tokens < 1:
        raise ConfigError("--repeats and --tokens must be at least 1")
    threads, rows = _ints("--threads", args.threads), _ints("--rows", args.rows)
    exe = llamacpp.find_llama_bench(args.llama_bench)
    if exe is None:
        log.warning("bench-engine: no llama-bench (--llama-bench PATH or on PATH): measuring ours alone")
    model = resolve_model(args.model)  # a path, or a model's name
    if not model.is_file():
        raise ConfigError(f"--model {model}: not a file (bench-engine runs a GGUF file)")
    prompt, label = _prompt(args)
    set_threads(threads[0])
    lm = load_model(model, engine=args.engine)
    fingerprint = lm.fingerprint()
    try:
        drafter, _ = load_drafter(lm.shard, fingerprint, args.draft)
    except ConfigError as e:
        if args.draft is not None:
            raise
        log.warning("bench-engine: %s; spec decoding is left out", e)
        drafter = None
    ours = Ours.build(lm, prompt, drafter, tree_shape(args, fingerprint))
    cfg = EngineBenchConfig(model=model, threads=threads, repeats=args.repeats, tokens=args.tokens, prompt=prompt,
                            prompt_label=label, rows=rows, parts=tuple(parts), llama_bench=exe, draft=args.draft,
                            progress=not args.no_progress)
    log.info("bench-engine: %s, %d prompt tokens, threads %s, %d repeats", model.name, len(ours.prompt_ids),
             threads, args.repeats)
    res = summarize(setup_record(cfg, ours, _command(args, parts)), measure(cfg, ours))
    j, m = write_outputs(args.out, res)
    log.warning("bench-engine: wrote %s and %s", j, m)
    return 0
