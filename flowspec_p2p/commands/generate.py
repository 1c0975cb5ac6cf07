"""``flowspec generate PROMPT``: chat with the model on this device, streaming the reply to stdout."""

from __future__ import annotations

import argparse
import json
import sys

from ..generate import ARDecoder, GenStats, stream_text
from ..model import load_model, parse_dtype
from ..sampling import SamplingParams


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate a reply on this device",
        description="Apply the model's chat template to PROMPT and stream the reply to stdout. "
        "Only the reply goes to stdout; logs and --stats go to stderr.",
    )
    p.add_argument("prompt", help="the user message")
    p.add_argument("--model", default=None, help="GGUF file or HF checkpoint folder (default: packaged SmolLM2-135M)")
    p.add_argument("--max-tokens", type=int, default=256, help="maximum new tokens (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); >0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: random)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--raw", action="store_true", help="no chat template: continue PROMPT as plain text")
    p.add_argument("--dtype", default="float32", help="compute dtype: float32 (default), float64, bfloat16")
    p.add_argument("--stats", action="store_true", help="print one JSON line of statistics to stderr at the end")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    lm = load_model(args.model, dtype=parse_dtype(args.dtype))
    tok = lm.tokenizer
    if args.raw:
        prompt = tok.encode(args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        prompt = tok.chat(messages)
    decoder = ARDecoder(lm.shard)
    stats = GenStats(mode=decoder.mode)
    chunks = decoder(prompt, params, args.max_tokens, tok.stop_ids, stats)
    for delta in stream_text(chunks, tok, args.stop):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.stats:
        print(json.dumps(stats.as_dict()), file=sys.stderr)
    return 0
