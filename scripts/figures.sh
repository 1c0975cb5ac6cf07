#!/usr/bin/env bash
# Reproduce the measured figures quoted in README.md (about 2.5 hours on a 2-core CPU; the cluster benchmarks
# resume where they stopped). Edge devices and links are EMULATED on this one host (see README: Emulating edge
# devices); only ratios measured side by side in one run mean anything. Spec-Bench: $FLOWSPEC_SPEC_BENCH or the
# copy in the package (flowspec_p2p/bench/data/spec-bench).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$ROOT"
DATA="${FLOWSPEC_SPEC_BENCH:-$ROOT/flowspec_p2p/bench/data/spec-bench}"
OUT=docs/figures

# every decoding mode side by side on a 4-stage emulated edge cluster (100 Mbit/s, 2 ms, 5x slower
# devices), one prompt per Spec-Bench set (MT-bench: both turns), T=0 and T=1
flowspec bench --per-dataset 1 --max-tokens 64 --temperature 0,1 --data "$DATA" --out "$OUT/bench" --resume
# a wider T=0 run (3 prompts per set) of the modes the targets name
flowspec bench --per-dataset 3 --max-tokens 64 --temperature 0 --modes ar,chunk,flowspec --data "$DATA" \
  --out "$OUT/bench-k3" --resume
# greedy FlowSpec through the 4-stage pipeline vs pipelined autoregressive, token for token (float32)
flowspec bench --slowdown 1 --modes ar,flowspec --temperature 0 --per-dataset 4 --max-tokens 128 --turns 1 \
  --data "$DATA" --out "$OUT/bench-equality" --resume
# tau per dataset at T=0/T=1, single-device speculative vs autoregressive, greedy equality
flowspec bench-spec --data "$DATA" --per-dataset 2 --max-tokens 128 --threads 1 --out "$OUT/spec-bench"
# tau on all of lines 30-49 (120 prompts), two processes of three sets each
flowspec bench-spec --data "$DATA" --datasets mt_bench,humaneval,gsm8k --per-dataset 20 --max-tokens 128 --threads 1 \
  --out "$OUT/spec-bench-full/a" &
flowspec bench-spec --data "$DATA" --datasets alpaca,sum,qa --per-dataset 20 --max-tokens 128 --threads 1 \
  --out "$OUT/spec-bench-full/b" &
wait
# greedy equality of the shipped head over 24 prompts x 128 tokens
flowspec bench-spec --data "$DATA" --per-dataset 4 --max-tokens 128 --temperatures 0 --threads 1 \
  --out "$OUT/spec-bench-equality"
# the same with a 16-node EAGLE-2 tree (higher tau, slower on this CPU)
flowspec bench-spec --data "$DATA" --per-dataset 2 --max-tokens 128 --threads 1 --tree-tokens 16 --tree-depth 5 \
  --tree-topk 4 --out "$OUT/spec-bench-tree16"
# target forward cost against tree size, and the tree shape that maximises tokens/s here
flowspec tune-tree --data "$DATA" --threads 1 --no-save --out "$OUT/spec-tune-fewrow"  # spec-tune: before the kernel
# re-planning after a leave, a kill and a join; a request in flight when its stage is killed
mkdir -p "$OUT/recovery"
flowspec cluster recovery --out "$OUT/recovery/recovery.json" | tee "$OUT/recovery/recovery.txt"
# where a decoded token's time goes, torch engine vs native engine (py-spy)
python lab/profile_decode.py --tokens 256 --threads 1 --out "$OUT/profile"
