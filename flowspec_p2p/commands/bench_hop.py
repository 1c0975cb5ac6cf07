"""``flowspec bench-hop`` (per-hop overhead of the data path) and ``flowspec bench-ring`` (ar vs chunk through a
loopback ring of the default model). Both write JSON, a markdown table and a PNG chart to ``--out``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import run_async


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench-hop",
        help="measure the overhead of one pipeline hop (encode + websocket + decode) on loopback",
        description="Time encode + loopback websocket + decode of one Forward segment (default: 16 tokens of "
        "hidden 576 in float16, SmolLM2-135M's shape), over plain websockets (ws: the --insecure mode) and TLS with "
        "a keyed cluster's authenticated session (wss: the default), hops interleaved. Prints a table; writes "
        "hop.json/.md/.png to --out.",
    )
    p.add_argument("--tokens", type=int, action="append", help="segment sizes (repeatable; default 1, 16, 64)")
    p.add_argument("--hidden", type=int, default=576, help="hidden size (default 576)")
    p.add_argument("--dtype", action="append", choices=["float16", "bfloat16", "float32"],
                   help="activation wire dtypes (repeatable; default float16 and bfloat16)")
    p.add_argument("--iters", type=int, default=500, help="timed hops per setting (default 500)")
    p.add_argument("--transport", action="append", choices=["ws", "wss"],
                   help="ws (plain, --insecure) and/or wss (TLS, authenticated) (repeatable; default both)")
    p.add_argument("--out", type=Path, default=Path("bench/hop"), help="output folder (default bench/hop)")
    p.set_defaults(func=run_hop)

    r = sub.add_parser(
        "bench-ring",
        help="tokens/s of the decoding modes through an in-process loopback ring of the default model",
        description="Cut the model into N stages in one process (real loopback websockets), the leader holding "
        "the embedding and LM head, and run every prompt through every mode side by side (greedy). Only the "
        "ratios between modes are meaningful. Writes ring.json/.md/.png to --out.",
    )
    r.add_argument("--stages", type=int, default=3, help="pipeline stages (default 3)")
    r.add_argument("--modes", default="ar,chunk", help="comma-separated modes (default ar,chunk; add flowspec)")
    r.add_argument("--prompts", type=int, default=4, help="number of prompts (default 4)")
    r.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    r.add_argument("--wire", default="float16", choices=["float16", "bfloat16", "float32"],
                   help="activation dtype on the wire (default float16)")
    r.add_argument("--drafter", default="auto", choices=["auto", "head", "oracle"],
                   help="auto: the trained draft head if one is installed (else chunk is skipped); head: trained "
                   "or, failing that, an untrained head; oracle: the target drafts for itself (upper bound)")
    r.add_argument("--hops", default="ws", choices=["ws", "memory"], help="websockets or in-memory channels")
    r.add_argument("--link-mbps", type=float, default=None, help="emulated link bandwidth (default: off)")
    r.add_argument("--link-latency-ms", type=float, default=0.0, help="emulated one-way latency (default 0)")
    r.add_argument("--slowdown", type=float, default=1.0, help="emulated compute slowdown per stage (default 1)")
    r.add_argument("--threads", type=int, default=1, help="torch threads (default 1: stages share the cores)")
    r.add_argument("--no-single", action="store_true", help="skip the single-device reference row")
    r.add_argument("--model", default=None, help="model path or name (default: the packaged SmolLM2-135M)")
    r.add_argument("--out", type=Path, default=Path("bench/ring"), help="output folder (default bench/ring)")
    r.set_defaults(func=run_ring)


def run_hop(args: argparse.Namespace) -> int:
    from ..bench import hop as bench_hop

    transports = tuple(dict.fromkeys(args.transport or bench_hop.TRANSPORTS))

    async def main():
        return [r for d in (args.dtype or ["float16", "bfloat16"]) for t in (args.tokens or [1, 16, 64])
                for r in await bench_hop.bench_hops(t, args.hidden, d, iters=args.iters, transports=transports)]

    results = run_async(main())
    bench_hop.write_hop_report(results, args.out)
    sys.stdout.write((args.out / "hop.md").read_text())
    plain = {(r["tokens"], r["dtype"]): r for r in results if r["transport"] == "ws"}
    for r in results:
        if r["tokens"] == 16:
            sys.stdout.write(f"16-token {r['dtype']} segment over {r['transport']}: median {r['median_ms']:.3f} ms, "
                             f"p90 {r['p90_ms']:.3f} ms (goal < {bench_hop.HOP_GOAL_MS:g} ms: "
                             f"{'met' if r['meets_goal'] else 'MISSED'})\n")
    for r in results:
        base = plain.get((r["tokens"], r["dtype"]))
        if r["transport"] == "wss" and base is not None:
            extra = r["median_ms"] - base["median_ms"]
            sys.stdout.write(f"TLS per hop, {r['tokens']}-token {r['dtype']}: {extra:+.3f} ms median "
                             f"({r['median_ms'] / base['median_ms']:.2f}x ws)\n")
    return 0


def run_ring(args: argparse.Namespace) -> int:
    import torch

    from ..bench import hop as bench_hop
    from ..pipeline.emulation import ComputeEmulation, LinkEmulation

    torch.set_num_threads(args.threads)
    result = run_async(bench_hop.bench_ring(
        stages=args.stages, modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
        prompts=args.prompts, max_tokens=args.max_tokens, wire=args.wire, drafter=args.drafter, hops=args.hops,
        link=LinkEmulation(bandwidth_mbps=args.link_mbps, latency_ms=args.link_latency_ms),
        compute=ComputeEmulation(slowdown=args.slowdown), model_path=args.model, single=not args.no_single))
    bench_hop.write_ring_report(result, args.out)
    sys.stdout.write((args.out / "ring.md").read_text())
    return 0
