#!/usr/bin/env bash
# Session 21: the calibration's host overheads now measured on a one-head model of the run's head
# dim at the run's mean length (the run's attention path): predicted vs measured on the three
# one-GPU sizes (the smallest twice); the CUDA calibrate tests; the model trains with jfa / gdpa on
# the GPU.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_planner_calibrate.py -k "cuda or tiny" tests/test_jagged_attention.py -k "cuda or tiny" 2>&1 | tail -1
scripts/predict_on_gpu.sh small --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 8
scripts/predict_on_gpu.sh small2 --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 8
scripts/predict_on_gpu.sh mid --hidden 768 --blocks 6 --max-len 1024 --batch 32 --steps 6
scripts/predict_on_gpu.sh large --hidden 1024 --blocks 8 --max-len 2048 --batch 64 --steps 6
