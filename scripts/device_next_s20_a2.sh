#!/usr/bin/env bash
# Prepared at the end of session 19 for the next session's second GPU call (after
# device_next_s20_a.sh): every Gluon backward GPU test on the work-list kernels.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 290 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon_bwd.py 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/tests_bwd.txt"; grep -E "passed|failed|^E " "$OUT/tests_bwd.txt" | head; tail -c 200 "$OUT/tests_bwd.txt"; echo
