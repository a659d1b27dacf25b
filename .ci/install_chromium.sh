#!/usr/bin/env bash
# Install Debian's headless-capable Chromium for tests/integration/test_browser.py.
# Idempotent and quiet: does nothing when a chromium binary is already on PATH.
# A machine can come up with dpkg interrupted ("you must manually run 'dpkg --configure -a'") or with another apt
# still holding the lock: the first is repaired with `dpkg --configure -a`, the second waited for, and the install
# tried up to three times before the step fails.
set -euo pipefail

if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    echo "chromium: $(chromium --version 2>/dev/null || chromium-browser --version 2>/dev/null)"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

export DEBIAN_FRONTEND=noninteractive
apt_get() { $SUDO apt-get -o DPkg::Lock::Timeout=600 "$@"; }
for attempt in 1 2 3; do
    $SUDO dpkg --configure -a || true
    if apt_get update -qq && apt_get install -y -qq --no-install-recommends chromium >/dev/null; then
        echo "chromium: $(chromium --version)"
        exit 0
    fi
    echo "chromium: install attempt $attempt failed" >&2
    sleep $((attempt * 10))
done
exit 1
