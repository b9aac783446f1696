#!/usr/bin/env bash
# Session 18, second call: backward variants (in-flight dQ / dK-dV wgmmas, LSE/delta prefetch),
# the persistent forward's tiles, the Gluon backward's GPU tests on the current module.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 170 python3 scripts/gluon_bwd_variants.py --budget-s 150 2>&1 | grep -vE "leaked|nanobind|^ - " > "$OUT/variants.txt"
echo "variants rc=$?"; cat "$OUT/variants.txt"
timeout 150 python3 scripts/gluon_fwd_sweep.py --workloads dense95 heavytail --activations softmax silu --budget-s 120 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/fwd_sweep.txt"; echo "sweep rc=$?"; cat "$OUT/fwd_sweep.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/test_jagged_attention_gluon_bwd.py 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/tests_bwd.txt"; grep -E "passed|failed|Error|^E " "$OUT/tests_bwd.txt" | head -20
tail -2 "$OUT/tests_bwd.txt"
