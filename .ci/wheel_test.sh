#!/usr/bin/env bash
# The wheel carries the data and runs outside the source tree.
#   bash .ci/wheel_test.sh VENV
# Builds a wheel from the committed tree (git archive HEAD: no egg-info, venvs or stray files), checks its size
# (< 10 MB) and that it holds every file of mechgeom/data/files/, installs it with --no-deps into a temporary
# target, and, from a directory outside the checkout with only that target on PYTHONPATH (VENV provides the
# dependencies and the model wheels), runs load_task, load_corpus, builds the fused kernel and runs
# `mechgeom report --quick`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(cd "${1:-.venv}" && pwd)
PY="$VENV/bin/python"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MPLBACKEND=Agg
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/src" "$tmp/dist" "$tmp/target" "$tmp/run"
git archive HEAD | tar -x -C "$tmp/src"
s=$(date +%s)
"$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$tmp/dist" "$tmp/src"
whl=$(ls "$tmp"/dist/mechgeom-*.whl)
echo "[wheel] built $(basename "$whl") in $(($(date +%s) - s)) s" >&2
# the wheel's size and contents, against the source tree's data folder
"$PY" - "$whl" "$tmp/src/mechgeom/data/files" <<'EOF'
import sys, zipfile
from pathlib import Path

whl, files = Path(sys.argv[1]), Path(sys.argv[2])
size = whl.stat().st_size
print(f"[wheel] {whl.name}: {size / 1e6:.2f} MB", file=sys.stderr)
assert size < 10_000_000, f"the wheel is {size} bytes, over 10 MB"
names = set(zipfile.ZipFile(whl).namelist())
want = {f"mechgeom/data/files/{p.relative_to(files).as_posix()}" for p in files.rglob("*") if p.is_file()}
assert len(want) > 30 and {"mechgeom/data/files/SOURCES.md", "mechgeom/data/files/LICENSES.md"} <= want
missing = sorted(want - names)
assert not missing, f"the wheel lacks {len(missing)} data files: {missing[:5]}"
print(f"[wheel] holds all {len(want)} data files", file=sys.stderr)
EOF
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps --target "$tmp/target" "$whl"
cd "$tmp/run"
export PYTHONPATH="$tmp/target"
s=$(date +%s)
"$PY" - "$tmp/target" <<'EOF'
import sys
from pathlib import Path

import mechgeom
from mechgeom import load_model
from mechgeom.data import TASKS, data_dir, load_corpus, load_task

target = Path(sys.argv[1]).resolve()
where = Path(mechgeom.__file__).resolve()
assert target in where.parents, f"mechgeom was imported from {where}, not from the installed wheel in {target}"
assert target in data_dir().resolve().parents, data_dir()
for task in TASKS:
    items = load_task(task, n=3, seed=0)
    assert len(items) == 3 and all(0 <= it.answer < len(it.choices) for it in items), task
model = load_model("smollm2-135m")
for corpus in ("wikitext2", "gsm8k", "c4"):
    tokens = load_corpus(corpus, model, n_texts=2, seq_len=32, seed=0)
    assert tuple(tokens.shape) == (2, 32), (corpus, tokens.shape)
import torch
from mechgeom._kernels import fused as contribution_fused

# the wheel carries the fused kernel's C source, and it builds from the installed package (this machine has cc)
assert contribution_fused.available(torch.zeros(1)), "the installed wheel's contribution_rows.c did not build"
print(f"[wheel] mechgeom {mechgeom.__version__} from {where.parent}: load_task, load_corpus and the fused kernel work", file=sys.stderr)
EOF
"$PY" -m mechgeom report --quick --no-progress --out "$tmp/run/report"
test -s "$tmp/run/report/report.html"
ls "$tmp/run/report"/*.csv > /dev/null
echo "[wheel] mechgeom report --quick from the wheel took $(($(date +%s) - s)) s (with the loads above)" >&2
