#!/usr/bin/env bash
# Session 23, GPU call 1: the review clip (263364e) and the calibrated optimizer rate (5692c0b) on the
# GPU: the clip and GC-schedule tests, then the one-GPU planner rows (small three times, mid, large).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_planner_apply.py -k "clip" 2>&1 | tail -3
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_gc_schedule.py 2>&1 | tail -3
for i in 1 2 3; do scripts/predict_on_gpu.sh small$i --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 8 2>&1 | grep -E "==|step_s_predicted|host issued|calibration"; done
scripts/predict_on_gpu.sh mid --hidden 768 --blocks 6 --max-len 1024 --batch 32 --steps 6 2>&1 | grep -E "==|step_s_predicted|host issued|calibration"
scripts/predict_on_gpu.sh large --hidden 1024 --blocks 8 --max-len 2048 --batch 64 --steps 6 2>&1 | grep -E "==|step_s_predicted|host issued|calibration"
