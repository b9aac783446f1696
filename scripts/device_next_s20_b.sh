#!/usr/bin/env bash
# Prepared at the end of session 19 for the next session's third GPU call: the official rows
# on the work-list kernels (none has run yet), all anchor workloads, and the Triton attention
# tests on the GPU (the list kernel's tests run there too).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
for wa in "dense95 softmax" "dense95 silu" "heavytail softmax" "heavytail silu"; do set -- $wa
  timeout 50 gem bench attention --workload $1 --activation $2 --gpu-time --anchors varlen > "$OUT/bench_$2_$1.txt" 2>&1
  grep -E "gemcore|varlen|Error" "$OUT/bench_$2_$1.txt"
done
timeout 50 gem bench attention --workload cross --gpu-time --anchors varlen > "$OUT/bench_cross.txt" 2>&1
grep -E "gemcore|varlen|Error" "$OUT/bench_cross.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_triton.py -k work_list 2>&1 | tail -1
