#!/usr/bin/env bash
# Prepared at the end of session 21 for the next session's first GPU call. (1) The calibration's
# phase shares without the warm-up call (per-phase medians on CUDA; written after the GPU time ran
# out): predicted vs measured on the three one-GPU sizes, the smallest three times (its host speed
# varied 10.8-19.8 ms between processes in session 21). (2) The CPU-process test files not yet run
# on a GPU machine with this session's fixes (mpirun ranks now join with gloo when run.device is cpu).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
for i in 1 2 3; do scripts/predict_on_gpu.sh small$i --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 8; done
scripts/predict_on_gpu.sh mid --hidden 768 --blocks 6 --max-len 1024 --batch 32 --steps 6
scripts/predict_on_gpu.sh large --hidden 1024 --blocks 8 --max-len 2048 --batch 64 --steps 6
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_planner_apply.py tests/test_mx.py tests/test_mx_fsdp.py \
  tests/test_plugins.py tests/test_config.py 2>&1 | grep -E "passed|failed|^FAILED|^E " | head -20
