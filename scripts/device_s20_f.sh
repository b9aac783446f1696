#!/usr/bin/env bash
# Session 20: planner predicted vs measured step time on one GPU after the smoke step stopped
# syncing between backward and optimizer (the gradient norm stays on the device until the step's
# one sync, as in the trainer). Same sizes as session 15 (device_s15_c.sh), the smallest twice.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
scripts/predict_on_gpu.sh small --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 8
scripts/predict_on_gpu.sh small2 --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 8
scripts/predict_on_gpu.sh mid --hidden 768 --blocks 6 --max-len 1024 --batch 32 --steps 6
scripts/predict_on_gpu.sh large --hidden 1024 --blocks 8 --max-len 2048 --batch 64 --steps 6
