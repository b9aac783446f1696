#!/usr/bin/env bash
# Prepared at the end of session 20 for the next session's second GPU call: work lists built once
# per offsets tensor (cached_lists; the backward's missing list in one launch), one allocation per
# list, cached descriptor layouts and device facts (written with no GPU time left). (1) the list
# tests on the GPU and every Gluon GPU test, forward and backward; (2) the official rows of
# heavytail and dense95 softmax (they no longer include the list build: work_list_build_us);
# (3) the small model's step with and without the Gluon attention (is the Gluon path's host work
# what the one-token calibration misses?).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_triton.py -k "work_list or lists" 2>&1 | tail -1
timeout 280 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon.py tests/test_jagged_attention_gluon_bwd.py 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/tests_bwd.txt"; grep -E "passed|failed|^E " "$OUT/tests_bwd.txt" | head
for w in dense95 heavytail; do
  timeout 60 gem bench attention --workload $w --activation softmax --gpu-time --anchors varlen 2>&1 | grep -E "gemcore|varlen|Error|work_list"
done
for g in 1 0; do
  GEMCORE_GLUON_ATTENTION=$g timeout 60 python3 scripts/step_timeline.py --hidden 512 --blocks 4 --max-len 512 --batch 16 2>&1 \
    | grep -vE "Warning|warn|detach|float.loss" | head -9 | sed "s/^/gluon=$g /"
done
