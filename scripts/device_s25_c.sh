#!/usr/bin/env bash
# Session 25, GPU call 3, on the final code: every test file holding GPU tests (8 pytest-xdist
# workers on the one GPU, xdist from the carried wheels in .whl/), then the planner's mid one-GPU
# row (--repeats 3) with the compute split the estimate now reports.
set -u
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
python3 -c "import xdist" 2>/dev/null || python3 -m pip install -q --no-index --find-links .whl pytest-xdist > /tmp/pipx.log 2>&1 || tail -3 /tmp/pipx.log
files="$(grep -l "cuda.is_available\|needs a CUDA\|gpu" tests/test_*.py) tests/test_planner_smoke.py"
timeout -s INT 360 python3 -m pytest -q -p no:cacheprovider -n 8 -rs $files > "$OUT/gpu_tests.txt" 2>&1
echo "GPU tests rc=$?"; grep -E "passed|failed|^FAILED|^ERROR|^SKIPPED" "$OUT/gpu_tests.txt" | tail -15
export PREDICT_TIMEOUT=150
scripts/predict_on_gpu.sh mid_r --hidden 768 --blocks 6 --max-len 1024 --batch 32 --steps 6 --repeats 3 2>&1 | grep -E "==|repeats"
python3 -c "
import json; d = json.loads(open('$OUT/predict_mid_r.json').read().strip().splitlines()[-1])
print('compute parts, ms:', {k: round(v * 1e3, 2) for k, v in d['last_step_predicted_compute_parts_s'].items()})"
