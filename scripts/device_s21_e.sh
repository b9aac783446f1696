#!/usr/bin/env bash
# Session 21: (1) the calibration's tiny-step host overheads on three tiny-model shapes (is the
# Gluon attention's host work what the one-event, width-8 calibration model misses?); (2) the small
# model's step with its host time per op; (3) the dense95 softmax row three more times, each in its
# own process (run-to-run spread of the forward figure that sits at the 420 goal).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 150 python3 scripts/host_overhead_probe.py --heads 4 --head-dim 128 --events 300 2>&1 | grep -vE "Warning|warn"
timeout 90 python3 scripts/step_timeline.py --hidden 512 --blocks 4 --max-len 512 --batch 16 --cpu-ops 30 2>&1 \
  | grep -vE "Warning|warn|detach|float.loss" > "$OUT/timeline_small.txt"; cut -c1-120 "$OUT/timeline_small.txt"
for i in 1 2 3; do
  timeout 60 gem bench attention --workload dense95 --activation softmax --gpu-time --anchors varlen 2>&1 | grep -E "gluon-hopper bwd|varlen_attn "
done
