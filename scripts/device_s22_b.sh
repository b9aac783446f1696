#!/usr/bin/env bash
# Session 22, GPU calls 2 and 3: the planner's one-GPU rows after the foreach clip (1295228), the
# per-layer after-backward host phase (optimizer_layer_s) and (call 3) host overheads as issued host time; the calibration and clip tests on CUDA.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
for i in 1 2 3; do scripts/predict_on_gpu.sh small$i --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 8; done
for i in 1 2; do scripts/predict_on_gpu.sh mid$i --hidden 768 --blocks 6 --max-len 1024 --batch 32 --steps 6; done
scripts/predict_on_gpu.sh large --hidden 1024 --blocks 8 --max-len 2048 --batch 64 --steps 6
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_planner_calibrate.py tests/test_planner_apply.py -k "clip or calibrat or cuda or gpu" 2>&1 | grep -E "passed|failed|^FAILED|^E " | head -20
