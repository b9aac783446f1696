#!/usr/bin/env bash
# Prepared at the end of session 19 for the next session's fourth GPU call: the three-field work
# list (GEMCORE_GLUON_RICH_LIST=1: each list entry carries its sequence's start and length, so an
# item costs one dependent load less; written and compiled only). The work lists cost dense95's
# forward 2.5 % in session 19 (427.8 -> 417.1 TFLOP/s) while gaining 19-31 % on heavytail; the
# suspected cause is that extra load per item. (1) The Gluon GPU tests with it on; (2) its speed
# against the default, each in its own process (the switch is read at import).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
GEMCORE_GLUON_RICH_LIST=1 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon.py -x \
  -k "hypothesis or targets_and_fused or cross_attention_matches or forward_matches" 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/tests_rich_fwd.txt"; grep -E "passed|failed|^E " "$OUT/tests_rich_fwd.txt" | head
GEMCORE_GLUON_RICH_LIST=1 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon_bwd.py -x \
  -k "hypothesis or targets_fused or gradients_match" 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/tests_rich_bwd.txt"; grep -E "passed|failed|^E " "$OUT/tests_rich_bwd.txt" | head
for rich in 0 1; do
  GEMCORE_GLUON_RICH_LIST=$rich timeout 110 python3 scripts/gluon_persistent_check.py --dkdv-stages 2 --budget-s 95 2>&1 \
    | grep -vE "leaked|nanobind|^ - " | sed "s/^/rich=$rich /" | tee -a "$OUT/rich_list.txt"
done
