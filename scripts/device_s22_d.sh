#!/usr/bin/env bash
# Session 22, GPU call 5: the small (host-bound) row with Python's automatic garbage collection off
# during the steps and the calibration (train.gc_every, default 50) against it on (--gc-every 0),
# alternating in one machine.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
python3 -V
ARGS="--hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 8"
for i in 1 2 3; do
  scripts/predict_on_gpu.sh gcoff$i $ARGS 2>&1 | grep -E "==|step_s_predicted|host issued"
  scripts/predict_on_gpu.sh gcauto$i $ARGS --gc-every 0 2>&1 | grep -E "==|step_s_predicted|host issued"
done
