#!/usr/bin/env bash
# Session 18, first call: the persistent Gluon forward and backward. Persistent against one CTA
# per item (GPU time, bit-identical check), then the Gluon GPU tests, then gem bench attention.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 200 python3 scripts/gluon_persistent_check.py --budget-s 170 2>&1 | grep -vE "leaked|nanobind|^ - " > "$OUT/persistent.txt"
echo "persistent rc=$?"; cat "$OUT/persistent.txt"
timeout 170 python3 -m pytest -q -p no:cacheprovider -x tests/test_jagged_attention_gluon.py tests/test_jagged_attention_gluon_bwd.py 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/tests.txt"; grep -E "passed|failed|Error|^E " "$OUT/tests.txt" | head -20
for a in softmax silu; do
  timeout 100 gem bench attention --workload dense95 --activation $a --gpu-time --anchors varlen > "$OUT/bench_${a}_dense95.txt" 2>&1
  echo "== $a dense95 rc=$?"; grep -E "gemcore|varlen|Error" "$OUT/bench_${a}_dense95.txt"
done
