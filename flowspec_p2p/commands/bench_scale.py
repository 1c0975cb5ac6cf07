"""``flowspec bench-scale``: a multi-GB synthetic model served by agents of this host that each hold only their share,
against one process and llama.cpp's RPC pipeline (flowspec_p2p/bench/scale.py)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

PARTS = ("reference", "fetch", "cluster", "decode", "resume", "noplan")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench-scale", help="a model bigger than any one agent's offer, served across agents of this host",
        description="Write (once) a synthetic GGUF of a real model's shape (`flowspec model synth`), then in one run: "
        "the one-process reference (`flowspec generate --mode ar`), the weight fetch alone (a keyed weight server "
        "and --agents - 1 member processes fetching their layers at once, --runs times: MB/s, CPU seconds per GB on "
        "each side; `bench-scale fetch` runs just that), a cluster of --agents agents each offering "
        "--memory-mb (time to serving, fetch MB/s, each stage's RSS against the planner's count and the target "
        "bound), greedy decode interleaved with llama.cpp's RPC pipeline on the same file (with --llama-bin), a "
        "member killed half-way through its fetch and restarted (what it fetches again), and every agent offering "
        "--small-mb (the leader's 'no plan: short by N MB'). Writes results.json and results.md to --out. Needs "
        "several GB of memory and disk: keep the model outside the repository.")
    p.add_argument("parts", nargs="*", metavar="PART", help=f"what to run: {', '.join(PARTS)} (default: all)")
    p.add_argument("--model", type=Path, required=True,
                   help="the synthetic GGUF to use, written first if missing (e.g. /data/llama8b-q4km.gguf)")
    p.add_argument("--shape", default="llama-3.1-8b", help="its shape when written (default llama-3.1-8b)")
    p.add_argument("--type", default="Q4_K_M", help="its block types when written (default Q4_K_M)")
    p.add_argument("--agents", type=int, default=3, help="agents (default 3)")
    p.add_argument("--memory-mb", type=float, default=2560.0, help="each agent's offer (default 2560)")
    p.add_argument("--small-mb", type=float, default=1000.0,
                   help="each agent's offer in the no-plan part (default 1000)")
    p.add_argument("--context", type=int, default=2048, help="KV tokens per request (default 2048)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default 64)")
    p.add_argument("--runs", type=int, default=3, help="interleaved decode runs, and fetch runs (default 3)")
    p.add_argument("--llama-bin", type=Path, default=None,
                   help="folder with llama.cpp's ggml-rpc-server and llama-server (default: ours alone)")
    p.add_argument("--out", type=Path, default=Path("docs/figures/scale"),
                   help="output folder (default docs/figures/scale)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..bench.scale import ScaleOptions
    from ..bench.scale import run as run_scale
    from ..errors import ConfigError

    parts = tuple(args.parts) or PARTS
    bad = [x for x in parts if x not in PARTS]
    if bad:
        raise ConfigError(f"unknown part(s) {', '.join(bad)}; choose from {', '.join(PARTS)}")
    o = ScaleOptions(model=args.model, shape=args.shape, file_type=args.type, agents=args.agents,
                     memory_mb=args.memory_mb, small_mb=args.small_mb, context=args.context,
                     max_tokens=args.max_tokens, runs=args.runs, llama_bin=args.llama_bin, out=args.out, parts=parts)
    command = "flowspec " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    from ..bench.scale_report import markdown

    sys.stdout.write(markdown(run_scale(o, command)))
    return 0
