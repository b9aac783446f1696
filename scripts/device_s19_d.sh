#!/usr/bin/env bash
# Session 19, fourth GPU call. (1) The forward's GPU tests call c did not reach (its timeout hit
# after 43 passed); (2) the backward's GPU tests with its trims (dQ: the first warpgroup skips
# the diagonal's second key tile; dK/dV: the second warpgroup skips the first query tile);
# (3) the backward A/B against the previous one (scripts/_variants/bwd_0_base.py), same
# process; (4) official rows (heavytail silu now takes the Gluon forward).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 70 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon.py -k "targets_and_fused or hypothesis or cross" 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/tests_fwd_rest.txt"; grep -E "passed|failed|^E " "$OUT/tests_fwd_rest.txt" | head
timeout 270 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon_bwd.py 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/tests_bwd.txt"; grep -E "passed|failed|^E " "$OUT/tests_bwd.txt" | head; tail -c 300 "$OUT/tests_bwd.txt"; echo
timeout 100 python3 scripts/gluon_variants.py --part bwd --budget-s 85 2>&1 | grep -vE "leaked|nanobind|^ - " | tee "$OUT/variants_bwd.txt"
for wa in "heavytail softmax" "heavytail silu" "dense95 softmax"; do set -- $wa
  timeout 45 gem bench attention --workload $1 --activation $2 --gpu-time --anchors varlen > "$OUT/bench_$2_$1.txt" 2>&1
  grep -E "gemcore|varlen|Error" "$OUT/bench_$2_$1.txt"
done
