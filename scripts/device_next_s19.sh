#!/usr/bin/env bash
# Prepared at the end of session 18 for the next GPU call: what session 18 wrote but could not
# run. (1) The Gluon GPU tests, cross attention's included (written, off by default). (2) The
# persistent kernels against one CTA per item with session 17's early exit of empty items
# (compiled only). (3) Cross attention through the Gluon forward against the Triton forward and
# varlen_attn. (4) The official self-attention rows.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon.py -k "cross or scope or compiles" 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/tests_cross.txt"; grep -E "passed|failed|^E " "$OUT/tests_cross.txt" | head -20
timeout 170 python3 scripts/gluon_persistent_check.py --budget-s 150 2>&1 | grep -vE "leaked|nanobind|^ - " > "$OUT/persistent.txt"
cat "$OUT/persistent.txt"
GEMCORE_GLUON_CROSS=1 timeout 80 gem bench attention --workload cross --gpu-time --anchors varlen > "$OUT/bench_cross.txt" 2>&1
grep -E "workload|gemcore|varlen|Error" "$OUT/bench_cross.txt"
for a in softmax; do for w in dense95 heavytail; do
  timeout 60 gem bench attention --workload $w --activation $a --gpu-time --anchors varlen > "$OUT/bench_${a}_$w.txt" 2>&1
  grep -E "gemcore|varlen|Error" "$OUT/bench_${a}_$w.txt"
done; done
