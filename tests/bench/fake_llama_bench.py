"""A stand-in for llama.cpp's llama-bench: parses the flags bench-engine passes and prints ``-o json`` output in the
real binary's shape (0.5.0-dev, commit 0c1e570; trimmed to the fields that vary). Its timings follow a formula, so
tests can check the arithmetic: a tg token takes TG_S; an n-token pp batch takes PP_S * (1 + PP_GROWTH * (n - 1)).
Every call appends its argv to $FAKE_LLAMA_LOG (when set)."""

from __future__ import annotations

import argparse
import json
import os
import sys

TG_S = 0.02
PP_S = 0.02
PP_GROWTH = 0.25


def test(args: argparse.Namespace, n_prompt: int, n_gen: int) -> dict:
    n = n_prompt or n_gen
    seconds = PP_S * (1 + PP_GROWTH * (n - 1)) if n_prompt else TG_S * n_gen
    ts = n / seconds
    return {"build_commit": "0c1e570", "build_number": 1, "cpu_info": "Fake CPU", "gpu_info": "", "backends": "CPU",
            "model_filename": args.m, "model_type": "llama 256M Q4_1", "model_size": 96576768,
            "model_n_params": 134515008, "n_batch": 2048, "n_ubatch": 512, "n_threads": args.t, "type_k": "f16",
            "type_v": "f16", "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": args.d,
            "test_time": "2026-12-01T20:22:57Z", "avg_ns": int(seconds * 1e9), "stddev_ns": 0, "avg_ts": ts,
            "stddev_ts": 0.0, "samples_ns": [int(seconds * 1e9)] * args.r, "samples_ts": [ts] * args.r}


def main() -> int:
    if "--version" in sys.argv:
        sys.stderr.write("version: 0.0.0-fake (build 1, commit 0c1e570)\n")
        return 0
    p = argparse.ArgumentParser()
    for flag, kind in (("-m", str), ("-t", int), ("-p", str), ("-n", int), ("-d", int), ("-r", int), ("-o", str)):
        p.add_argument(flag, type=kind, required=True)
    args = p.parse_args()
    if log := os.environ.get("FAKE_LLAMA_LOG"):
        with open(log, "a") as f:
            f.write(json.dumps(sys.argv[1:]) + "\n")
    assert args.o == "json"
    sys.stderr.write("load_backend: loaded CPU backend\n")  # the real one logs to stderr
    tests = [test(args, int(n), 0) for n in args.p.split(",") if int(n) > 0]
    tests += [test(args, 0, args.n)] if args.n > 0 else []
    sys.stdout.write(json.dumps(tests, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
