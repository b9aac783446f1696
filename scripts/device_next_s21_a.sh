#!/usr/bin/env bash
# Prepared at the end of session 20 for the next session's first GPU call: the planner's phase rule
# (cost.gpu_done_s) and device-time rates (calibrate._gpu_timed) were written with no GPU time left.
# (1) the CUDA calibration test; (2) predicted vs measured on the three one-GPU sizes of session 20's
# timeline (the smallest twice); (3) the timeline again, to set beside (2).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_planner_calibrate.py -k cuda 2>&1 | tail -1
scripts/predict_on_gpu.sh small --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 8
scripts/predict_on_gpu.sh small2 --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 8
scripts/predict_on_gpu.sh mid --hidden 768 --blocks 6 --max-len 1024 --batch 32 --steps 6
scripts/predict_on_gpu.sh large --hidden 1024 --blocks 8 --max-len 2048 --batch 64 --steps 6
timeout 100 python3 scripts/step_timeline.py --hidden 768 --blocks 6 --max-len 1024 --batch 32 2>&1 | grep -vE "Warning|warn|detach|float.loss" | head -9
