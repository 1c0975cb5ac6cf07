#!/bin/sh
# Installs what the NEON test needs: an aarch64 cross compiler and qemu's user-mode emulator (Debian/Ubuntu).
# Idempotent: does nothing when both are already on PATH.
set -eu
if command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 && command -v qemu-aarch64 >/dev/null 2>&1; then
    echo "cross tools present: $(command -v aarch64-linux-gnu-gcc) $(command -v qemu-aarch64)"
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
QEMU=qemu-user
if ! apt-cache policy qemu-user 2>/dev/null | grep -q 'Candidate: [0-9]'; then QEMU=qemu-user-static; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq gcc-aarch64-linux-gnu libc6-dev-arm64-cross "$QEMU"
command -v aarch64-linux-gnu-gcc && command -v qemu-aarch64
