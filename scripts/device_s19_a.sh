#!/usr/bin/env bash
# Prepared at the end of session 18 for the next session's first GPU call (the second is
# device_next_s19_b.sh): what session 18 wrote after its GPU time ran out, compiled only.
# (1) The Gluon forward's cross-attention GPU tests (cross attention is off by default:
#     GEMCORE_GLUON_CROSS=1 turns it on; the tests turn it on themselves).
# (2) The dK/dV kernel with LSE/delta converted where used (GEMCORE_GLUON_LATE_LSE=1: ptxas
#     spills 20 B instead of 180 with Triton 3.6): the backward's GPU tests with it, then its
#     speed against the default, each in its own process (the switch is read at import).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon.py -k "cross or scope or compiles" 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/tests_cross.txt"; grep -E "passed|failed|^E " "$OUT/tests_cross.txt" | head -20
GEMCORE_GLUON_LATE_LSE=1 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon_bwd.py 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/tests_late_lse.txt"; grep -E "passed|failed|^E " "$OUT/tests_late_lse.txt" | head; tail -1 "$OUT/tests_late_lse.txt"
for late in 0 1; do
  GEMCORE_GLUON_LATE_LSE=$late timeout 80 python3 scripts/gluon_persistent_check.py --activations softmax --dkdv-stages 2 --budget-s 60 2>&1 \
    | grep -vE "leaked|nanobind|^ - " | sed "s/^/late_lse=$late /" | tee -a "$OUT/late_lse.txt"
done
