#!/usr/bin/env bash
# Session 21: the four tests that failed on the H200 in device_s21_g.sh (CPU runs under mpirun on a
# GPU machine; calibrate tests that assumed no GPU), after their fix, and the other CPU-process
# planner / CLI tests on a GPU machine.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_planner_calibrate.py \
  "tests/test_training.py::test_two_process_fsdp_with_bbs_matches_one_process" 2>&1 | grep -E "passed|failed|^FAILED|^E " | head -20
timeout 110 python3 -m pytest -q -p no:cacheprovider -x tests/test_planner_apply.py tests/test_cli.py 2>&1 | grep -E "passed|failed|^FAILED|^E " | head -20
