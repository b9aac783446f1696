#!/usr/bin/env bash
# Prepared at the end of session 19 for the next session's first GPU call: the work-list
# kernels (commit 77da12e) ran only the A/B (bit-identical on the four anchor rows) and three
# random-length tests before the GPU time ran out. (1) Every Gluon forward GPU test on them
# (the backward's: device_next_s20_a2.sh, the next call, to stay under 600 s); (2) the list
# kernel's own GPU time.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 230 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon.py 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/tests_fwd.txt"; grep -E "passed|failed|^E " "$OUT/tests_fwd.txt" | head; tail -c 200 "$OUT/tests_fwd.txt"; echo
timeout 50 python3 scripts/work_list_timing.py 2>&1 | grep -vE "leaked|nanobind|^ - " | tee "$OUT/work_list_timing.txt"
