#!/usr/bin/env bash
# Set up (first run only) and run the whole test suite. Extra arguments go to pytest.
# The suite runs on FLOWSPEC_TEST_WORKERS pytest-xdist workers (default 2; 1 runs it in this process), a test file's
# tests on one worker (--dist loadfile: a module's cluster fixtures are started once): most tests wait on processes
# and sockets, so two workers halve the time on 2 cores (measured: 464 s against 916 s, load average 5).
# Where this machine can install Debian packages (root, apt-get), the tools some tests need and a fresh machine
# lacks are installed first (the aarch64 cross compiler and qemu for the engine's NEON test); elsewhere those
# tests skip and say why.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$ROOT"
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  timeout 600 sh tests/model/native/install_cross.sh >/dev/null 2>&1 \
    || echo "[setup] could not install the aarch64 cross tools: the NEON test will skip" >&2
fi
WORKERS="${FLOWSPEC_TEST_WORKERS:-2}"
if [ "$WORKERS" -gt 1 ]; then set -- -n "$WORKERS" --dist loadfile "$@"; fi
exec python -m pytest -q "$@"
