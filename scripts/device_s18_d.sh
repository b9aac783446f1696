#!/usr/bin/env bash
# Session 18, last call: the Gluon backward's remaining GPU tests on the final code (hypothesis
# lengths, backend against the Triton backward, targets), then two backward variants against the
# final one (bwd_A): F = dQ's wgmma left in flight with a 4-slot ring, G = dK/dV's left in flight
# with a 3-slot ring.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon_bwd.py -k "hypothesis or backend or targets" 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/tests_rest.txt"; grep -E "passed|failed|Error|^E " "$OUT/tests_rest.txt" | head -20; tail -1 "$OUT/tests_rest.txt"
timeout 120 python3 scripts/gluon_variants.py --part bwd --budget-s 110 2>&1 | grep -vE "leaked|nanobind|^ - " > "$OUT/variants.txt"
echo "variants rc=$?"; cat "$OUT/variants.txt"
