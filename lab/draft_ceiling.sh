#!/usr/bin/env bash
# How fast would FlowSpec run on the emulated 4-stage cluster with a better draft? (README, "What limits it")
# An analysis, not a product feature: a hook (lab/draft_ceiling/sitecustomize.py) adds to every FlowSpec tree a
# chain of the target's own next tokens, each right with probability Q. About 5 min per Q here.
#
#   bash lab/draft_ceiling.sh [OUT] [Q ...]     # default: docs/figures/draft-ceiling, Q = 0.7 0.85 1
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/bootstrap.sh"
cd "$ROOT"
OUT="${1:-docs/figures/draft-ceiling}"
shift || true
QS=("$@")
[ ${#QS[@]} -gt 0 ] || QS=(0.7 0.85 1)
ARGS=(--per-dataset 1 --max-tokens 48 --temperature 0 --turns 1 )
mkdir -p "$OUT"
# 1. the target's greedy replies (autoregressive), keyed by prompt length (distinct for these prompts)
[ -f "$OUT/ar/results.json" ] || flowspec bench --modes ar "${ARGS[@]}" --out "$OUT/ar"
python - "$OUT" <<'PY'
import json, sys
recs = [json.loads(line) for line in open(f"{sys.argv[1]}/ar/records.jsonl")]
ref = {r["prompt_tokens"]: r["token_ids"] for r in recs if r["mode"] == "ar" and r["ok"]}
assert len(ref) == len(recs), "two prompts of the same length: the hook could not tell them apart"
json.dump(ref, open(f"{sys.argv[1]}/reference.json", "w"))
PY
# 2. FlowSpec against AR, side by side, with the chain right with probability Q
for q in "${QS[@]}"; do
  [ -f "$OUT/q$q/results.json" ] && continue
  PYTHONPATH="$ROOT/lab/draft_ceiling" FLOWSPEC_CEILING_REF="$(cd "$OUT" && pwd)/reference.json" FLOWSPEC_CEILING_Q="$q" \
    flowspec bench --modes ar,flowspec "${ARGS[@]}" --out "$OUT/q$q"
done
for q in "${QS[@]}"; do echo "Q=$q"; grep -E "^\| (ar|flowspec) " "$OUT/q$q/results.md" | head -2; done
