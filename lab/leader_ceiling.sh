#!/usr/bin/env bash
# How much faster would FlowSpec run on the emulated 4-stage cluster if the leader's LM head were cheap (as with the
# LM head and the greedy argmax on the last stage), or its drafting? An analysis, not a product feature: a hook
# (lab/leader_ceiling/sitecustomize.py) charges the emulated leader nothing extra for that part, so it runs at
# this host's speed instead of --slowdown times slower. About 4 min per run here.
#
#   bash lab/leader_ceiling.sh [OUT]        # default docs/figures/leader-ceiling
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/bootstrap.sh"
cd "$ROOT"
OUT="${1:-docs/figures/leader-ceiling}"
ARGS=(--per-dataset 1 --max-tokens 48 --temperature 0 --turns 1 --modes ar,flowspec )
mkdir -p "$OUT"
[ -f "$OUT/plain/results.json" ] || flowspec bench "${ARGS[@]}" --out "$OUT/plain"
[ -f "$OUT/cheap-head/results.json" ] || PYTHONPATH="$ROOT/lab/leader_ceiling" FLOWSPEC_HEAD_DISCOUNT=1 \
  flowspec bench "${ARGS[@]}" --out "$OUT/cheap-head"
[ -f "$OUT/cheap-draft/results.json" ] || PYTHONPATH="$ROOT/lab/leader_ceiling" FLOWSPEC_DRAFT_DISCOUNT=1 \
  flowspec bench "${ARGS[@]}" --out "$OUT/cheap-draft"
