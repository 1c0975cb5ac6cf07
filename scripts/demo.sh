#!/usr/bin/env bash
# Set up (first run only) and run the main job on the default model. Extra arguments go to `flowspec generate`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$ROOT"
if [ "$#" -eq 0 ]; then set -- "Explain in three sentences why the sky is blue." --stats; fi
exec flowspec generate "$@"
