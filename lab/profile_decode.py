"""Where a decoded token's time goes, per engine: py-spy samples (with native frames) of greedy decoding on the
default GGUF, summarised by what the sampled thread was running at the leaf.

    python lab/profile_decode.py [--tokens 256] [--threads 1] [--out docs/figures/profile]

For each engine (torch, native) a fresh process loads the model, decodes one warm-up reply, then ``--tokens``
greedy tokens under ``py-spy record --native``; only samples inside the timed decode loop count. Leaves are
bucketed: the native engine's kernels, torch's C++ (aten ops, dispatch), the Python interpreter (our code and
the glue around each op), the C library (memcpy, malloc, futex), other. Writes profile.md, profile.json and
the raw py-spy stacks per engine (stacks/, not committed). Needs py-spy (pip install py-spy) and ptrace rights
(root, or kernel.yama.ptrace_scope=0).
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import subprocess
import sys
from pathlib import Path

PROMPT = "Write a short story about a robot who learns to paint."
MARK = "decode_loop"  # the function whose samples count


def decode_loop(decoder, ids, params, tokens, stop_ids):
    from flowspec_p2p.model.generate import generate_ids

    return generate_ids(decoder, ids, params, tokens, stop_ids)


def child(engine: str, tokens: int, threads: int) -> None:
    """Load, warm up, decode: the process py-spy samples."""
    from flowspec_p2p.model.generate import ARDecoder
    from flowspec_p2p.model.load import load_model, set_threads
    from flowspec_p2p.model.sampling import SamplingParams

    set_threads(threads)
    lm = load_model(None, engine=engine)
    ids = lm.tokenizer.chat([{"role": "user", "content": PROMPT}])
    decoder, greedy = ARDecoder(lm.shard), SamplingParams(temperature=0.0)
    decode_loop(decoder, ids, greedy, 16, set())
    out, stats = decode_loop(decoder, ids, greedy, tokens, set())  # no stop: exactly ``tokens`` tokens
    sys.stdout.write(json.dumps({"engine": engine, "new_tokens": len(out), "decode_s": stats.decode_s}) + "\n")


BUCKETS = [
    ("native engine kernels", ("libfsnative",)),
    ("torch C++ (aten ops, dispatch)", ("libtorch_cpu", "libc10", "libgomp", "libtorch.so")),
    ("torch's Python bindings", ("libtorch_python",)),
    ("C library (memcpy, malloc, futex)", ("libc.so", "ld-linux", "libstdc++", "libm.so")),
    ("Python interpreter (our code, op glue)", ("libpython", ".py:", "<frozen")),
]


def bucket(leaf: str) -> str:
    for name, keys in BUCKETS:
        if any(k in leaf for k in keys):
            return name
    return "other"


def summarise(raw: Path) -> dict:
    """py-spy's raw stacks -> samples in the decode loop by leaf bucket, and its top leaves and our functions."""
    buckets: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    ours: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        at = next((i for i, f in enumerate(frames) if f.startswith(MARK + " ")), None)
        if at is None:
            continue
        n = int(count)
        total += n
        leaf = frames[-1]
        buckets[bucket(leaf)] += n
        leaves[leaf.split(" (")[0][:60] + " (" + leaf.rpartition("(")[2]] += n
        inner = [f for f in frames[at + 1 :] if "(flowspec_p2p/" in f]
        if inner:
            ours[inner[-1].split(":")[0] + ")"] += n
    return {"samples": total, "buckets": dict(buckets.most_common()), "top_leaves": leaves.most_common(8),
            "innermost_of_ours": ours.most_common(8)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    ap.add_argument("--out", type=Path, default=Path("docs/figures/profile"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.tokens, args.threads)
        return 0
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    args.out.mkdir(parents=True, exist_ok=True)
    report = ["# Where a decoded token's time goes", "",
              f"`python lab/profile_decode.py --tokens {args.tokens} --threads {args.threads}`: greedy decode of "
              f"{args.tokens} tokens on the default GGUF, py-spy --native at {args.rate} Hz, samples inside the "
              "decode loop only, bucketed by the leaf frame.", ""]
    results = {}
    for engine in ("torch", "native"):
        raw = args.out / "stacks" / f"{engine}.txt"  # git-ignored: a few MB each
        raw.parent.mkdir(exist_ok=True)
        cmd = [spy, "record", "--native", "-r", str(args.rate), "--format", "raw", "-o", str(raw), "--",
               sys.executable, __file__, "--child", engine, "--tokens", str(args.tokens),
               "--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        run = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("{")))
        s = summarise(raw)
        results[engine] = {**run, **s}
        ms = 1000 * run["decode_s"] / run["new_tokens"]
        report += [f"## {engine} engine: {ms:.1f} ms/token under the profiler ({s['samples']} samples)", "",
                   "| leaf | share |", "|---|---|"]
        report += [f"| {k} | {100 * v / s['samples']:.0f}% |" for k, v in s["buckets"].items()]
        report += ["", "Top leaves: " + "; ".join(f"`{k}` {100 * v / s['samples']:.0f}%" for k, v in s["top_leaves"]),
                   "", "Innermost frame of ours: " + "; ".join(f"`{k}` {100 * v / s['samples']:.0f}%"
                                                              for k, v in s["innermost_of_ours"]), ""]
    (args.out / "profile.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "profile.md").write_text("\n".join(report) + "\n")
    sys.stdout.write("\n".join(report) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
