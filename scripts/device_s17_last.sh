#!/usr/bin/env bash
# Session 17, last call: GemModel trains with the Gluon forward and backward (against the Triton
# kernels, same seeds), then the Gluon backward's GPU tests, on the final code (kernels identical
# in generated code to commit 703e6c8, which the benches measured).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 120 python3 scripts/gluon_train_check.py --hidden 512 --blocks 2 --max-len 2048 --batch 16 --steps 4 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/train_check.txt"; tail -8 "$OUT/train_check.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon_bwd.py 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/tests_bwd.txt"; grep -E "passed|failed|^E " "$OUT/tests_bwd.txt" | head -20
