#!/usr/bin/env bash
# Session 19, second GPU call. LSE/delta converted where used is now dK/dV's only path (call a:
# 35 of the backward's GPU tests passed with it, then its timeout hit; softmax backward 8.62 ->
# 7.74 ms on dense95). (1) the backward tests call a did not reach; (2) the silu persistent A/B
# (the fair per-item baseline, and the suspected heavytail silu backward regression); (3) cross
# attention through the Gluon forward; (4) the official softmax rows.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon_bwd.py -k "hypothesis or triton_backend or targets_fused" 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/tests_bwd_rest.txt"; grep -E "passed|failed|^E " "$OUT/tests_bwd_rest.txt" | head
timeout 120 python3 scripts/gluon_persistent_check.py --activations silu --dkdv-stages 2 --budget-s 95 2>&1 | grep -vE "leaked|nanobind|^ - " > "$OUT/persistent_silu.txt"
cat "$OUT/persistent_silu.txt"
GEMCORE_GLUON_CROSS=1 timeout 80 gem bench attention --workload cross --gpu-time --anchors varlen > "$OUT/bench_cross.txt" 2>&1
grep -E "workload|gemcore|varlen|Error" "$OUT/bench_cross.txt"
for w in dense95 heavytail; do
  timeout 60 gem bench attention --workload $w --activation softmax --gpu-time --anchors varlen > "$OUT/bench_softmax_$w.txt" 2>&1
  grep -E "gemcore|varlen|Error" "$OUT/bench_softmax_$w.txt"
done
