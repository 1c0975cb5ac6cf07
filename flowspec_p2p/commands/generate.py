"""``flowspec generate PROMPT``: chat with the model on this device, streaming the reply to stdout."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from . import add_engine_argument

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate a reply on this device",
        description="Apply the model's chat template to PROMPT and stream the reply to stdout; a base model whose "
        "file has no chat template (e.g. Gemma 3 270M) continues PROMPT as plain text (as --raw). "
        "Only the reply goes to stdout; logs and --stats go to stderr.",
    )
    p.add_argument("prompt", help="the user message (with --raw, or a model without a chat template: the text to "
                   "continue)")
    p.add_argument("--model", default=None,
                   help="GGUF file, HF checkpoint folder, or a model's name (`flowspec models list`; default: the "
                   "packaged SmolLM2-135M)")
    p.add_argument("--max-tokens", type=int, default=256, help="maximum new tokens (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); >0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: random)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--raw", action="store_true",
                   help="no chat template: continue PROMPT as plain text, after the BOS token where the model's "
                   "tokenizer adds one (the default for a model without a chat template)")
    p.add_argument("--dtype", default="float32", help="compute dtype: float32 (default), float64, bfloat16")
    p.add_argument("--threads", type=int, default=None, help="compute threads (default: this device's physical cores)")
    add_engine_argument(p)
    p.add_argument("--quantize", choices=["Q8_0"], default=None,
                   help="quantize a float (safetensors) model's matrices to Q8_0 at load (native engine)")
    p.add_argument("--stats", action="store_true",
                   help="print one JSON line of statistics to stderr at the end (with the engine that ran)")
    add_spec_arguments(p)
    p.set_defaults(func=run)


def add_spec_arguments(p: argparse.ArgumentParser, *, mode: bool = True) -> None:
    """--mode, --draft and the tree budget (shared with bench-spec)."""
    if mode:
        p.add_argument(
            "--mode",
            choices=["auto", "ar", "spec"],
            default="auto",
            help="auto (default): speculative steps while they measure faster than plain ones on this device and "
            "this reply, else plain ones (--stats says which ran); ar: one target forward per token; spec: EAGLE-2 "
            "speculative decoding with the draft head (prompt lookup alone for a model with no head). Every "
            "mode gives the same output",
        )
    p.add_argument(
        "--draft", default=None, help="draft head: a bundle (stem, .json or .safetensors) or a public EAGLE-1/2/3 "
        "checkpoint folder (config.json + weights); default: the one installed for --model"
    )
    p.add_argument("--tree-tokens", type=int, default=None, help="tree budget in nodes, root included (default: tuned)")
    p.add_argument("--tree-depth", type=int, default=None, help="deepest drafted token (default: tuned)")
    p.add_argument("--tree-topk", type=int, default=None, help="children per expanded node (default: tuned)")
    p.add_argument("--tree-lookup", type=int, default=None,
                   help="longest prompt-lookup chain merged into each tree (default: tuned; -1: the tree's depth)")


def tree_shape(args: argparse.Namespace, target_fingerprint: str):
    """The tuned tree for this device (`flowspec tune-tree`, else the shipped default) with any flag overrides."""
    from ..speculative.decoder import tuned_tree

    shape = tuned_tree(target_fingerprint)
    overrides = {"total_tokens": args.tree_tokens, "depth": args.tree_depth, "top_k": args.tree_topk,
                 "lookup": args.tree_lookup}
    fields = {**shape.model_dump(), **{k: v for k, v in overrides.items() if v is not None}}
    if fields["lookup"] == -1:
        fields["lookup"] = None
    return shape.model_validate(fields)


def make_decoder(args: argparse.Namespace, lm):
    from ..model.generate import ARDecoder

    if args.mode == "ar":
        return ARDecoder(lm.shard)
    from ..speculative.auto import AutoDecoder
    from ..speculative.decoder import PROBE_TEXT, SpecDecoder, load_spec

    fingerprint = lm.fingerprint()
    # an EAGLE-3 head decodes on the target cut at the layers it taps (speculative/eagle3.py)
    target, drafter, _ = load_spec(lm.shard, lm.source, fingerprint, args.draft, lm.tokenizer.encode(PROBE_TEXT))
    decoder = AutoDecoder if args.mode == "auto" else SpecDecoder
    return decoder(target, drafter, tree_shape(args, fingerprint))


def run(args: argparse.Namespace) -> int:
    # The engine's imports (torch) load only when a command runs, so `flowspec cluster up` and `chat` stay light.
    from ..ledger import Ledger, reply_stats
    from ..model.dtypes import parse_dtype
    from ..model.generate import stream_text
    from ..model.load import load_model, set_threads
    from ..model.sampling import SamplingParams
    from ..model.synth import is_synthetic
    from ..model.tokenizer import is_base

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    set_threads(args.threads)
    lm = load_model(args.model, dtype=parse_dtype(args.dtype), engine=args.engine, quantize=args.quantize)
    if is_synthetic(lm.source):
        log.warning("%s is a synthetic model (random weights, `flowspec model synth`): its text is meaningless",
                    lm.source.path.name)
    tok = lm.tokenizer
    raw = args.raw or is_base(tok)
    if raw and not args.raw:
        log.warning("%s has no chat template (a base model): PROMPT is continued as plain text, as with --raw",
                    lm.source.path.name)
    if raw and args.system:
        log.warning("--system is ignored for a raw prompt")
    if raw:
        prompt = tok.encode_raw(args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        prompt = tok.chat(messages)
    decoder = make_decoder(args, lm)
    ledger = Ledger(mode=decoder.mode)
    chunks = decoder(prompt, params, args.max_tokens, tok.stop_ids, ledger)
    for delta in stream_text(chunks, tok, args.stop):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.stats:
        # the engine that ran, e.g. "native (avx512vnni)" or "torch"
        sys.stderr.write(json.dumps({**reply_stats(ledger), "engine": lm.shard.engine.describe()}) + "\n")
    return 0
