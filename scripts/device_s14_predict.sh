#!/usr/bin/env bash
# Session 14: planner predicted vs measured step time on one GPU (gemcore.planner.smoke --device cuda
# --predict: trains GemModel in bf16 with Triton attention, then calibrates in the same process).
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
scripts/predict_on_gpu.sh small --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 8
scripts/predict_on_gpu.sh large --hidden 1024 --blocks 8 --max-len 2048 --batch 64 --steps 6
