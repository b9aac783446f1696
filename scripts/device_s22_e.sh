#!/usr/bin/env bash
# Session 22, GPU call 6: with garbage collection on gem train's schedule (2cc25af), the three
# one-GPU rows again (small three times).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
for i in 1 2 3; do scripts/predict_on_gpu.sh small$i --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 8 2>&1 | grep -E "==|step_s_predicted|host issued"; done
scripts/predict_on_gpu.sh mid --hidden 768 --blocks 6 --max-len 1024 --batch 32 --steps 6 2>&1 | grep -E "==|step_s_predicted|host issued"
scripts/predict_on_gpu.sh large --hidden 1024 --blocks 8 --max-len 2048 --batch 64 --steps 6 2>&1 | grep -E "==|step_s_predicted|host issued"
