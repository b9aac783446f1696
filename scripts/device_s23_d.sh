#!/usr/bin/env bash
# Session 23, GPU call 4: the tiny models' host time per phase by shape (heads, users, history
# length: scripts/host_overhead_shape.py) beside the small planner row's own per-phase host time.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 200 python3 scripts/host_overhead_shape.py --heads 4 --head-dim 128 --events 256 512 --users 16
for i in 1 2; do scripts/predict_on_gpu.sh small$i --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 20 2>&1 | grep -E "==|step_s_predicted|host issued|calibration"; done
