#!/usr/bin/env bash
# Session 23, GPU call 5: with the interleaved calibration (8bf4a41) and its user count (default 1),
# the calibration's GPU test, then the one-GPU planner rows: mid, large, and small four times
# (20 measured steps each).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_planner_calibrate.py 2>&1 | tail -2
scripts/predict_on_gpu.sh mid --hidden 768 --blocks 6 --max-len 1024 --batch 32 --steps 6 2>&1 | grep -E "==|step_s_predicted|host issued|calibration"
scripts/predict_on_gpu.sh large --hidden 1024 --blocks 8 --max-len 2048 --batch 64 --steps 6 2>&1 | grep -E "==|step_s_predicted|host issued|calibration"
for i in 1 2 3 4; do scripts/predict_on_gpu.sh small$i --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 20 2>&1 | grep -E "==|step_s_predicted|host issued"; done
