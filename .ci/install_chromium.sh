#!/usr/bin/env bash
# Install Debian's headless-capable Chromium for tests/integration/test_browser.py.
# Idempotent and quiet: does nothing when a chromium binary is already on PATH.
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
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
echo "chromium: $(chromium --version)"
