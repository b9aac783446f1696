#!/usr/bin/env bash
# Session 19, third GPU call: the forward's first warpgroup takes only the keys it can see
# (causal: 64-key tiles skip the diagonal's second tile, 128-key tiles take the diagonal's first
# half alone). (1) the forward's GPU tests; (2) A/B against the previous forward (a copy in
# scripts/_variants/fwd_0_base.py), same process; (3) official rows.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon.py -x 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/tests_fwd.txt"; grep -E "passed|failed|^E " "$OUT/tests_fwd.txt" | head
timeout 130 python3 scripts/gluon_variants.py --part fwd --budget-s 110 2>&1 | grep -vE "leaked|nanobind|^ - " | tee "$OUT/variants_fwd.txt"
for w in dense95 heavytail; do for a in softmax silu; do
  timeout 60 gem bench attention --workload $w --activation $a --gpu-time --anchors varlen > "$OUT/bench_${a}_$w.txt" 2>&1
  grep -E "gemcore|varlen|Error" "$OUT/bench_${a}_$w.txt"
done; done
