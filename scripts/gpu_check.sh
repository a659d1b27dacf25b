#!/usr/bin/env bash
# The GPU check of issue 36, in a few minutes on a machine with one CUDA GPU, offline, from a clean checkout
# with the venv of scripts/setup.sh (a CUDA build of torch: setup.sh pins the local CPU wheel of this project's
# machine; on a GPU machine install torch's CUDA build of the same version into the venv first):
#   (a) the unit tests with the tiny models on the GPU (MECHGEOM_TEST_DEVICE, tests/conftest.py), -x -q;
#   (b) every analysis on SmolLM2-135M in bfloat16 on the GPU (scripts/gpu_smoke.py: rows sum to 1 within
#       1e-4, no head marked modified, timings);
#   (c) the contribution benchmark on the GPU: the 8B-shaped layers of benchmarks/bench_8b.py (1x1024, 2048,
#       4096 in float32 and bfloat16; forward, streamed family, last query, top_k=16), written to
#       results/contribution/llama3-8b-shaped/cuda-*.json and printed as a table.
# It stops at once, with the devices there are, when DEVICE is not usable.
#
#   scripts/gpu_check.sh                  # DEVICE=cuda
#   DEVICE=cpu scripts/gpu_check.sh       # a dry run at tiny sizes: the device tests only, SmolLM2 in float32,
#                                         # the 8B-shaped script at d_model 64 into a temporary folder
# Environment: VENV (default .venv), DEVICE (default cuda), UNIT_TIMEOUT / SMOKE_TIMEOUT / BENCH_TIMEOUT
# (seconds; defaults 600 / 300 (dry run: 900) / 600), UNIT_TESTS (default tests/unit; the dry run: tests/unit/test_devices_unit.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${VENV:-.venv}/bin/python
DEVICE=${DEVICE:-cuda}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MPLBACKEND=Agg PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[[ -x "$PY" ]] || { echo "gpu_check: no venv at ${VENV:-.venv}: run scripts/setup.sh (or set VENV)" >&2; exit 2; }

# Fail fast: the device must be usable (mechgeom's own one-line check names the devices there are).
"$PY" -c "
import sys, torch
from mechgeom.models import check_device
try:
    check_device(sys.argv[1])
except ValueError as exc:
    sys.exit(f'gpu_check: {exc}')
print(f'gpu_check: torch {torch.__version__} on', torch.cuda.get_device_name(sys.argv[1])
      if sys.argv[1].startswith('cuda') else sys.argv[1], flush=True)
" "$DEVICE"

if [[ "$DEVICE" == cpu ]]; then
    UNIT_TESTS=${UNIT_TESTS:-tests/unit/test_devices_unit.py}
    SMOKE_TIMEOUT=${SMOKE_TIMEOUT:-900}  # SmolLM2 on 2 CPU cores: token_selection alone takes minutes
    SMOKE=(--dtype float32)
    BENCH=(--tiny --lengths 64,128 --repeats 1 --out-dir "$(mktemp -d)")
else
    UNIT_TESTS=${UNIT_TESTS:-tests/unit}
    SMOKE=(--dtype bfloat16)
    BENCH=(--lengths 1024,2048,4096 --dtypes float32,bfloat16 --repeats 3)
fi

step() { echo; echo "== gpu_check ($DEVICE): $*"; }
t0=$SECONDS
step "(a) unit tests with the tiny models on $DEVICE: $UNIT_TESTS"
# shellcheck disable=SC2086  # UNIT_TESTS may name several paths
MECHGEOM_TEST_DEVICE=$DEVICE timeout "${UNIT_TIMEOUT:-600}" "$PY" -m pytest $UNIT_TESTS -x -q -p no:cacheprovider \
    -m "not integration"
step "(b) every analysis on SmolLM2-135M (${SMOKE[*]}) on $DEVICE"
timeout "${SMOKE_TIMEOUT:-300}" "$PY" scripts/gpu_smoke.py --device "$DEVICE" "${SMOKE[@]}"
step "(c) contribution benchmark, 8B-shaped layers, on $DEVICE (${BENCH[*]})"
out=results/contribution/llama3-8b-shaped
for ((i = 0; i < ${#BENCH[@]}; i++)); do [[ "${BENCH[i]}" == --out-dir ]] && out=${BENCH[i + 1]}; done
timeout "${BENCH_TIMEOUT:-600}" "$PY" benchmarks/bench_8b.py --device "$DEVICE" "${BENCH[@]}"
"$PY" benchmarks/bench_8b.py --table --out-dir "$out"
echo; echo "gpu_check ($DEVICE): all passed in $((SECONDS - t0)) s"
