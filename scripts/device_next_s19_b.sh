#!/usr/bin/env bash
# Prepared at the end of session 18 for the next session's second GPU call (after
# device_next_s19_a.sh).
# (1) The persistent kernels against one CTA per item, now with session 17's early exit of empty
#     items back in the per-item mode (compiled only so far): the fair A/B of persistence, and
#     the check of the likely ~5 % heavytail silu backward regression.
# (2) Cross attention through the Gluon forward (GEMCORE_GLUON_CROSS=1) against the Triton
#     forward and varlen_attn, same process.
# (3) The official softmax rows.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 170 python3 scripts/gluon_persistent_check.py --budget-s 150 2>&1 | grep -vE "leaked|nanobind|^ - " > "$OUT/persistent.txt"
cat "$OUT/persistent.txt"
GEMCORE_GLUON_CROSS=1 timeout 80 gem bench attention --workload cross --gpu-time --anchors varlen > "$OUT/bench_cross.txt" 2>&1
grep -E "workload|gemcore|varlen|Error" "$OUT/bench_cross.txt"
for w in dense95 heavytail; do
  timeout 60 gem bench attention --workload $w --activation softmax --gpu-time --anchors varlen > "$OUT/bench_softmax_$w.txt" 2>&1
  grep -E "gemcore|varlen|Error" "$OUT/bench_softmax_$w.txt"
done
