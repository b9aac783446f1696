#!/usr/bin/env bash
# Session 22, GPU call 4: is the small (host-bound) row's process-to-process spread the CPU the
# process lands on? Alternate unpinned runs with runs pinned to two cores (taskset), same args.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
lscpu | grep -E "^(Model name|CPU\(s\)|Thread|NUMA node)" ; nvidia-smi topo -m 2>/dev/null | head -3
ARGS="--hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 8"
for i in 1 2 3; do
  scripts/predict_on_gpu.sh free$i $ARGS 2>&1 | grep -E "==|step_s_predicted"
  taskset -c 2,3 scripts/predict_on_gpu.sh pinned$i $ARGS 2>&1 | grep -E "==|step_s_predicted"
done
