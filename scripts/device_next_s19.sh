#!/usr/bin/env bash
# Prepared at the end of session 18 for the next GPU calls: what session 18 wrote but could not
# run. Its timeouts add to ~800 s: run it as two calls (up to the LATE_LSE loop, then the rest).
# (1) The Gluon forward's cross-attention GPU tests (written, off by default: GEMCORE_GLUON_CROSS).
# (2) The persistent kernels against one CTA per item with session 17's early exit of empty items
#     back (that mode is compiled only).
# (3) The dK/dV kernel with LSE/delta converted where used (GEMCORE_GLUON_LATE_LSE=1: 20 B of
#     spills instead of 180 with Triton 3.6): the backward's GPU tests with it, and its speed
#     against the default, each in its own process (the switch is read at import).
# (4) Cross attention through the Gluon forward against the Triton forward and varlen_attn.
# (5) The official softmax rows.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon.py -k "cross or scope or compiles" 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/tests_cross.txt"; grep -E "passed|failed|^E " "$OUT/tests_cross.txt" | head -20
timeout 170 python3 scripts/gluon_persistent_check.py --budget-s 150 2>&1 | grep -vE "leaked|nanobind|^ - " > "$OUT/persistent.txt"
cat "$OUT/persistent.txt"
GEMCORE_GLUON_LATE_LSE=1 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon_bwd.py 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/tests_late_lse.txt"; grep -E "passed|failed|^E " "$OUT/tests_late_lse.txt" | head; tail -1 "$OUT/tests_late_lse.txt"
for late in 0 1; do
  GEMCORE_GLUON_LATE_LSE=$late timeout 80 python3 scripts/gluon_persistent_check.py --activations softmax --dkdv-stages 2 --budget-s 60 2>&1 \
    | grep -vE "leaked|nanobind|^ - " | sed "s/^/late_lse=$late /" | tee -a "$OUT/late_lse.txt"
done
GEMCORE_GLUON_CROSS=1 timeout 80 gem bench attention --workload cross --gpu-time --anchors varlen > "$OUT/bench_cross.txt" 2>&1
grep -E "workload|gemcore|varlen|Error" "$OUT/bench_cross.txt"
for a in softmax; do for w in dense95 heavytail; do
  timeout 60 gem bench attention --workload $w --activation $a --gpu-time --anchors varlen > "$OUT/bench_${a}_$w.txt" 2>&1
  grep -E "gemcore|varlen|Error" "$OUT/bench_${a}_$w.txt"
done; done
