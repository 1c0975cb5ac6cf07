#!/usr/bin/env bash
# The whole product against llama.cpp's RPC pipeline on one host. A measurement, not part of the product; llama.cpp
# is never a dependency (build its llama-server and ggml-rpc-server yourself and pass their folder).
#
#   bash scripts/rpc_compare.sh [--clients N] LLAMA_BIN [RUNS] [OUT]   # RUNS default 5, OUT default docs/figures/rpc
#                                                                     # (docs/figures/rpc-clients with --clients)
#
# The same greedy chat (T=0, the same prompt, max_tokens 128; flowspec_p2p/bench/rpc_compare.py) goes, interleaved, to
#   (a) scripts/run.sh's cluster: `flowspec cluster up -n 3` (3 agents on loopback), decoding ar, flowspec and auto (the default), and
#   (b) two `ggml-rpc-server -t 1` on loopback ports + `llama-server -t 1 --rpc 127.0.0.1:P1,127.0.0.1:P2`, same GGUF
#       (the default model), -c 2048 (our agents' default context);
# both sides up at once, everything bound to 127.0.0.1. Decode tokens/s are each server's own figure (our
# stats.decode_tokens_per_s, llama-server's timings.predicted_per_second), medians over RUNS; RSS is each side's
# total over its processes after the runs. Writes OUT/results.json and OUT/results.md.
# --clients N: many users instead: N clients at once (different prompts) against one, on our cluster (ar and the
# default auto) and on llama-server started with -np N (N parallel slots, -c 2048 x N) over the same RPC servers;
# aggregate tokens/s, each side's scaling and ours against llama.cpp's, within each run. Writes OUT/clients.json/.md.
# FLOWSPEC_PYTHON=path/to/python uses that interpreter (with this package importable) instead of the .venv.
set -euo pipefail
CLIENTS=1
if [ "${1:-}" = "--clients" ]; then CLIENTS="${2:?--clients N}"; shift 2; fi
LLAMA_BIN="$(cd "${1:?usage: rpc_compare.sh [--clients N] LLAMA_BIN [RUNS] [OUT]}" && pwd)"
RUNS="${2:-5}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "$CLIENTS" -gt 1 ]; then DEFAULT_OUT="$ROOT/docs/figures/rpc-clients"; else DEFAULT_OUT="$ROOT/docs/figures/rpc"; fi
OUT="${3:-$DEFAULT_OUT}"
if [ -n "${FLOWSPEC_PYTHON:-}" ]; then PY="$FLOWSPEC_PYTHON"; else source "$ROOT/scripts/bootstrap.sh"; PY=python; fi
cd "$ROOT"
for exe in ggml-rpc-server llama-server; do
  [ -x "$LLAMA_BIN/$exe" ] || { echo "rpc_compare: $LLAMA_BIN/$exe is missing" >&2; exit 2; }
done
MODEL="$("$PY" -c 'from flowspec_p2p.model.weights import default_model_path; print(default_model_path())')"
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
RPC1="$(free_port)"; RPC2="$(free_port)"; SERVER="$(free_port)"; API="$(free_port)"
LOGS="$(mktemp -d -t rpc-compare-XXXX)"
PIDS=()
stop_all() {  # the cluster and llama-server first, then the rpc servers they hold connections to
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
    kill -TERM "${PIDS[i]}" 2>/dev/null || true
    wait "${PIDS[i]}" 2>/dev/null || true
  done
}
trap stop_all EXIT
echo "rpc_compare: logs in $LOGS" >&2

"$LLAMA_BIN/ggml-rpc-server" -H 127.0.0.1 -p "$RPC1" -t 1 >"$LOGS/rpc1.log" 2>&1 & PIDS+=($!); P_RPC1=$!
"$LLAMA_BIN/ggml-rpc-server" -H 127.0.0.1 -p "$RPC2" -t 1 >"$LOGS/rpc2.log" 2>&1 & PIDS+=($!); P_RPC2=$!
sleep 1  # the rpc servers listen before llama-server connects
"$LLAMA_BIN/llama-server" -m "$MODEL" --host 127.0.0.1 --port "$SERVER" -t 1 --rpc "127.0.0.1:$RPC1,127.0.0.1:$RPC2" \
  -c $((2048 * CLIENTS)) -np "$CLIENTS" --no-webui >"$LOGS/llama-server.log" 2>&1 & PIDS+=($!); P_SERVER=$!
"$PY" -m flowspec_p2p cluster up -n 3 --api-port "$API" >"$LOGS/cluster.log" 2>&1 & PIDS+=($!); P_CLUSTER=$!

SETUP="$("$PY" -c 'import json, os, sys; print(json.dumps({"llama_bin": sys.argv[1], "llama_version": sys.argv[2],
  "model": sys.argv[3], "threads_per_agent": max(1, os.cpu_count() // 3), "llama_threads_per_process": 1}))' \
  "$LLAMA_BIN" "$("$LLAMA_BIN/llama-server" --version 2>&1 | head -1)" "$MODEL")"
"$PY" -m flowspec_p2p.bench.rpc_compare --ours "http://127.0.0.1:$API" --ours-pid "$P_CLUSTER" \
  --llama "http://127.0.0.1:$SERVER" --llama-pids "$P_RPC1,$P_RPC2,$P_SERVER" --runs "$RUNS" --out "$OUT" \
  --command "bash scripts/rpc_compare.sh $([ "$CLIENTS" -gt 1 ] && echo "--clients $CLIENTS ")$LLAMA_BIN $RUNS" \
  --setup "$SETUP" --clients "$CLIENTS"
