#!/usr/bin/env bash
# Execute every tutorial in place and store its outputs (figures as PNG, tables, static pictures of the
# circuitsvis views), then trim them (scripts/trim_notebooks.py: no live-view bundles, no stderr noise, each
# notebook under 1 MB). Offline, on the installed model wheels. VENV overrides the venv (default .venv);
# arguments name notebooks (default: all of tutorials/*.ipynb).
#   bash scripts/run_tutorials.sh                      # all of them
#   bash scripts/run_tutorials.sh tutorials/07_*.ipynb # one
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [[ $# -eq 0 ]]; then
  set -- tutorials/*.ipynb
fi
for nb in "$@"; do
  s=$(date +%s)
  # from inside tutorials/, as Jupyter would run it; one kernel per notebook
  "$VENV/bin/python" -m nbconvert --to notebook --execute --inplace \
    --ExecutePreprocessor.timeout=1200 --ExecutePreprocessor.kernel_name=python3 "$nb"
  echo "[tutorials] $nb executed in $(($(date +%s) - s)) s" >&2
done
"$VENV/bin/python" scripts/trim_notebooks.py "$@"
