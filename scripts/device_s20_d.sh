#!/usr/bin/env bash
# Session 20, after the three-field list became the only one (commit 401f273): the official rows
# (all anchor workloads, each with varlen_attn in the same process), the list kernel's tests on
# the GPU, then every Gluon forward GPU test on this code.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
for wa in "dense95 softmax" "dense95 silu" "heavytail softmax" "heavytail silu"; do set -- $wa
  timeout 60 gem bench attention --workload $1 --activation $2 --gpu-time --anchors varlen > "$OUT/bench_$2_$1.txt" 2>&1
  grep -E "gemcore|varlen|Error" "$OUT/bench_$2_$1.txt"
done
timeout 60 gem bench attention --workload cross --gpu-time --anchors varlen > "$OUT/bench_cross.txt" 2>&1
grep -E "gemcore|varlen|Error" "$OUT/bench_cross.txt"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_triton.py -k work_list 2>&1 | tail -1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon.py 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/tests_fwd.txt"; grep -E "passed|failed|^E " "$OUT/tests_fwd.txt" | head
