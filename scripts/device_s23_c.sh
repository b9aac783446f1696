#!/usr/bin/env bash
# Session 23, GPU call 3: the calibration's host figures, sequential against interleaved tiny
# models (scripts/host_overhead_spread.py), then the small planner row three times with the
# interleaved calibration, and twice with 30 measured steps instead of 8.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 150 python3 scripts/host_overhead_spread.py --head-dim 128 --events 256 --repeats 6
for i in 1 2 3; do scripts/predict_on_gpu.sh small$i --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 8 2>&1 | grep -E "==|step_s_predicted|host issued|calibration"; done
for i in 1 2; do scripts/predict_on_gpu.sh small30_$i --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 30 2>&1 | grep -E "==|step_s_predicted|host issued|calibration"; done
