#!/usr/bin/env bash
# Session 21, last GPU call: the GPU tests not yet run on this session's code (the Triton attention
# kernels compiled, the attention API and benchmark, the model and trainer, the planner's
# GPU tests), with a time limit so the call returns.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 420 python3 -m pytest -q -p no:cacheprovider --durations=8 tests/test_jagged_attention_triton.py \
  tests/test_jagged_attention.py tests/test_bench_attention.py tests/test_model.py tests/test_training.py \
  tests/test_planner_calibrate.py tests/test_jagged_work_list.py 2>&1 | grep -vE "leaked|nanobind|^ - " > "$OUT/tests.txt"
grep -E "passed|failed|^FAILED|^E |slowest|s call|s setup" "$OUT/tests.txt" | head -30
