#!/usr/bin/env bash
# Set up (first run only), then start a local cluster of 3 agents on the default model and serve the leader's
# OpenAI-compatible API on http://127.0.0.1:8000 until Ctrl-C. Extra arguments go to `flowspec cluster up`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$ROOT"
if [ "$#" -eq 0 ]; then set -- -n 3; fi
exec flowspec cluster up "$@"
