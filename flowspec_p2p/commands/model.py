"""``flowspec model synth``: write a synthetic GGUF model (model/synth.py) -- a real architecture's shapes, block types
and metadata with pseudo-random weights, for trying the cluster at sizes that cannot be downloaded."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    from ..model.synth import FILE_TYPES, SHAPES

    p = sub.add_parser("model", help="make model files (synthetic models for tests and benchmarks)",
                       description="Model files. (`flowspec models` lists, pulls and removes real ones.)")
    msub = p.add_subparsers(dest="model_command", metavar="SUBCOMMAND", required=True)
    s = msub.add_parser(
        "synth", help="write a synthetic GGUF model: real shapes and block types, random weights",
        description="Write a GGUF file with a real architecture's tensor names, shapes, block types and metadata, "
        "the default model's tokenizer, and deterministic pseudo-random weights (the same arguments give the same "
        "bytes). Its metadata says it is synthetic: what it generates is meaningless, but its size, memory and "
        "speed behave like the real model's. It streams to disk, a chunk at a time, and llama.cpp loads it. "
        f"Shapes by name: {', '.join(SHAPES)}.",
        epilog="examples:\n  flowspec model synth --shape llama-3.1-8b --type Q4_K_M --out /data/llama8b-synth.gguf"
        "\n  flowspec model synth --arch qwen2 --layers 4 --hidden 256 --type Q8_0 --out tiny.gguf",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--shape", default=None, metavar="NAME", help=f"a known shape: {', '.join(SHAPES)}")
    s.add_argument("--arch", choices=["llama", "qwen2", "mistral"], default=None,
                   help="architecture (default: the shape's, else llama)")
    s.add_argument("--layers", type=int, default=None, help="decoder layers (replaces the shape's)")
    s.add_argument("--hidden", type=int, default=None, help="hidden size (multiples of 256 suit the K-quants)")
    s.add_argument("--intermediate", type=int, default=None, help="MLP size (default: the shape's, else ~8/3 hidden)")
    s.add_argument("--heads", type=int, default=None, help="attention heads (default: the shape's, else hidden/64)")
    s.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: the shape's, else heads/4)")
    s.add_argument("--head-dim", type=int, default=None, help="per-head size (default: hidden / heads)")
    s.add_argument("--context", type=int, default=None, help="context length written in the metadata")
    s.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None,
                   help="the LM head is the token embedding (default: the shape's, else untied)")
    s.add_argument("--type", default="Q4_K_M", choices=list(FILE_TYPES),
                   help="block types: a llama.cpp file type (default Q4_K_M: Q4_K with Q6_K for the LM head and "
                   "half the layers' attn_v and ffn_down)")
    s.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    s.add_argument("--out", type=Path, required=True, help="the GGUF file to write")
    s.set_defaults(func=run_synth)


def run_synth(args: argparse.Namespace) -> int:
    from ..model.synth import resolve_shape, write

    shape, label = resolve_shape(args.shape, args.arch, layers=args.layers, hidden=args.hidden,
                                 intermediate=args.intermediate, heads=args.heads, kv_heads=args.kv_heads,
                                 head_dim=args.head_dim, context=args.context, tied=args.tied)
    total = write(args.out, shape, args.type, seed=args.seed, label=label, progress=not args.quiet)
    sys.stdout.write(f"{args.out}: synthetic {label}, {args.type}, {total / 1e9:.2f} GB\n")
    return 0
